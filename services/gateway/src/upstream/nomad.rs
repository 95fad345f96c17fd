//! The built-in `nomad` upstream: the scheduler's tools, called with JSON arguments.

use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    CallToolRequest, CallToolResponse, CallToolStreamEvent, ListToolsRequest,
    call_tool_stream_event,
};
use serde_json::{Value, json};

use super::nomad_json;
use crate::sandbox::ToolSpec;

pub const NAME: &str = "nomad";

/// How long listing the scheduler's tools may take.
const LIST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The JSON Schema of a tool's arguments, from its kind's table.
pub fn input_schema(kind: &str) -> Value {
    use nomad_proto::kinds::{InputType, OptionType};
    let Some(spec) = nomad_proto::kinds::kind(kind) else {
        return json!({"type": "object"});
    };
    let mut properties = serde_json::Map::new();
    let required = match spec.input {
        InputType::Text => {
            properties.insert(
                "text".into(),
                json!({"type": "string", "description": spec.input_description}),
            );
            "text"
        }
        InputType::Tensor => {
            properties.insert(
                "input".into(),
                json!({"type": "array", "items": {"type": "number"}, "description": spec.input_description}),
            );
            properties.insert(
                "shape".into(),
                json!({"type": "array", "items": {"type": "integer"}, "description": "Default: [len(input)]."}),
            );
            "input"
        }
    };
    for o in spec.options {
        let schema = match o.ty {
            OptionType::Bool => json!({"type": "boolean", "default": o.default != 0.0}),
            OptionType::Integer => json!({"type": "integer", "default": o.default as u64,
                                          "minimum": o.min as u64, "maximum": o.max as u64}),
            OptionType::Number => json!({"type": "number", "default": o.default,
                                         "minimum": o.min, "maximum": o.max}),
            OptionType::Strings => json!({"type": "array", "maxItems": o.max as u64,
                "items": {"type": "string", "minLength": 1,
                          "maxLength": nomad_proto::kinds::MAX_STRING_BYTES}}),
            OptionType::Messages => json!({"type": "array", "maxItems": o.max as u64,
                "items": {"type": "object", "required": ["role", "content"],
                          "additionalProperties": false,
                          "properties": {"role": {"enum": nomad_proto::kinds::ROLES},
                                         "content": {"type": "string"}}}}),
        };
        let mut schema = schema;
        schema["description"] = json!(o.description);
        properties.insert(o.name.into(), schema);
    }
    // A kind that takes a conversation takes it instead of the text.
    if spec.options.iter().any(|o| o.ty == OptionType::Messages) {
        return json!({"type": "object", "properties": properties,
                      "anyOf": [{"required": [required]}, {"required": ["messages"]}]});
    }
    json!({"type": "object", "properties": properties, "required": [required]})
}

pub struct Nomad {
    scheduler: SchedulerClient<nomad_rpc::Channel>,
    /// The scheduler's tools as last listed, kept for `ttl`.
    listing: tokio::sync::Mutex<Option<(std::time::Instant, Vec<ToolSpec>)>>,
    ttl: std::time::Duration,
}

impl Nomad {
    pub fn new(scheduler: SchedulerClient<nomad_rpc::Channel>, ttl: std::time::Duration) -> Self {
        Self {
            scheduler,
            listing: tokio::sync::Mutex::new(None),
            ttl,
        }
    }

    /// The scheduler's tools: the kept listing while it is fresh, else a new one.
    pub async fn tools(&self) -> Result<Vec<ToolSpec>, String> {
        let mut listing = self.listing.lock().await;
        if let Some((at, tools)) = listing.as_ref()
            && at.elapsed() < self.ttl
        {
            return Ok(tools.clone());
        }
        let tools = tokio::time::timeout(LIST_DEADLINE, self.list())
            .await
            .map_err(|_| {
                format!(
                    "listing the scheduler's tools: no answer within {} s",
                    LIST_DEADLINE.as_secs()
                )
            })??;
        *listing = Some((std::time::Instant::now(), tools.clone()));
        Ok(tools)
    }

    /// Whether the last listing, however old, has `tool`; never lists.
    pub async fn listed(&self, tool: &str) -> bool {
        let listing = self.listing.lock().await;
        listing
            .as_ref()
            .is_some_and(|(_, tools)| tools.iter().any(|t| t.name == tool))
    }

    async fn list(&self) -> Result<Vec<ToolSpec>, String> {
        let listed = self
            .scheduler
            .clone()
            .list_tools(ListToolsRequest {})
            .await
            .map_err(|s| format!("listing the scheduler's tools: {}", s.message()))?;
        Ok(listed
            .into_inner()
            .tools
            .into_iter()
            .map(|t| ToolSpec {
                description: if t.description.is_empty() {
                    format!("{} model", t.kind)
                } else {
                    t.description
                },
                input_schema: input_schema(&t.kind),
                title: String::new(),
                output_schema: None,
                name: t.name,
            })
            .collect())
    }

    /// Calls `tool`; the caller's context is current (the client layer injects it). With
    /// `progress`, the call streams and each piece of text the tool makes is offered there as it
    /// comes (dropped when the channel is full: the answer holds it all anyway).
    pub async fn call(
        &self,
        tool: &str,
        arguments: &Value,
        progress: Option<&tokio::sync::mpsc::Sender<String>>,
    ) -> Result<Value, tonic::Status> {
        let input = nomad_json::input_from_value(arguments)
            .map_err(|e| tonic::Status::invalid_argument(format!("{NAME}.{tool}: {e}")))?;
        let request = CallToolRequest {
            tool: tool.to_owned(),
            input: Some(input),
        };
        let mut scheduler = self.scheduler.clone();
        let reply = match progress {
            None => scheduler.call_tool(request).await.map(|r| r.into_inner()),
            Some(progress) => match scheduler.call_tool_stream(request).await {
                Ok(events) => streamed(events.into_inner(), progress).await,
                Err(status) => Err(status),
            },
        }
        .map_err(|s| unreachable_scheduler(tool, s))?;
        let output = reply.output.ok_or_else(|| {
            tonic::Status::internal(format!("{NAME}.{tool}: the scheduler returned no output"))
        })?;
        nomad_json::output_to_json(&output, reply.generation.as_ref())
            .map_err(|e| tonic::Status::internal(format!("{NAME}.{tool}: {e}")))
    }
}

/// The answer at the end of a streamed call, its text offered to `progress` on the way.
async fn streamed(
    mut events: tonic::Streaming<CallToolStreamEvent>,
    progress: &tokio::sync::mpsc::Sender<String>,
) -> Result<CallToolResponse, tonic::Status> {
    while let Some(event) = events.message().await? {
        match event.event {
            Some(call_tool_stream_event::Event::Text(text)) => {
                let _ = progress.try_send(text);
            }
            Some(call_tool_stream_event::Event::Done(answer)) => return Ok(answer),
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the scheduler ended the stream without an answer",
    ))
}

/// A connection that broke under the call reads as CANCELLED, UNKNOWN or INTERNAL; the caller did
/// neither, so it gets UNAVAILABLE (the scheduler's own statuses pass as they are).
fn unreachable_scheduler(tool: &str, status: tonic::Status) -> tonic::Status {
    if status.code() != tonic::Code::Unavailable && nomad_rpc::peer_lost(&status) {
        tonic::Status::unavailable(format!(
            "{NAME}.{tool}: the scheduler is unreachable: {}",
            status.message()
        ))
    } else {
        status
    }
}
