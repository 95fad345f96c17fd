//! The built-in `nomad` upstream: the scheduler's tools, called with JSON arguments.

use std::collections::HashMap;
use std::error::Error as _;

use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    CallToolRequest, CallToolResponse, CallToolStreamEvent, GetModelCardRequest, ListToolsRequest,
    ToolInfo, ToolState, call_tool_stream_event,
};
use serde_json::{Value, json};

use super::nomad_json;
use crate::sandbox::ToolSpec;
use crate::tool_error::{ToolError, ToolErrorCode};

pub const NAME: &str = "nomad";

/// The original Nomad's tool that reads a model tool's model card.
pub const MODEL_CARD_TOOL: &str = "get_model_card";

/// How long listing the scheduler's tools may take.
const LIST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The JSON Schema of a tool's arguments, from its kind's table.
/// What a built-in kind answers with, as a JSON schema (a Python model's is its own, reported
/// when it is described).
pub fn output_schema(kind: &str) -> Option<Value> {
    use nomad_proto::kinds::OutputType;
    let scored = |key: &str, ty: &str| {
        json!({"type": "object", "required": [key, "score"],
            "properties": {key: {"type": ty}, "score": {"type": "number"}}})
    };
    Some(match nomad_proto::kinds::kind(kind)?.output {
        OutputType::Tensor => json!({
            "type": "object",
            "required": ["output", "shape"],
            "properties": {
                "output": {"type": "array", "items": {"type": "number"},
                           "description": "The values, row-major."},
                "shape": {"type": "array", "items": {"type": "integer"}},
            },
        }),
        OutputType::Text => json!({
            "type": "object",
            "required": ["text"],
            "properties": {
                "text": {"type": "string"},
                "prompt_tokens": {"type": "integer"},
                "cached_prompt_tokens": {"type": "integer"},
                "completion_tokens": {"type": "integer"},
                "finish_reason": {"type": "string", "description": "stop or length."},
            },
        }),
        OutputType::Ranking => json!({
            "type": "array",
            "description": "The documents by score, best first (`index` into `documents`).",
            "items": scored("index", "integer"),
        }),
        OutputType::Labels => json!({
            "type": "object",
            "required": ["label", "scores"],
            "properties": {
                "label": {"type": "string", "description": "The best label."},
                "scores": {"type": "array", "items": scored("label", "string"),
                           "description": "Every label by score, best first."},
            },
        }),
        OutputType::Json => return None,
    })
}

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
        // The model's own schema replaces this once the model is described.
        InputType::Json => return json!({"type": "object"}),
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
            OptionType::Text => json!({"type": "string", "minLength": 1,
                "maxLength": nomad_proto::kinds::MAX_STRING_BYTES}),
            OptionType::Texts => json!({"type": "array", "maxItems": o.max as u64,
                "items": {"type": "string", "minLength": 1}}),
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

/// How often tools still being described are listed again.
const PENDING_POLL: std::time::Duration = std::time::Duration::from_secs(1);
/// How long that goes on at most (a tool's environment may take this long to build).
const PENDING_WATCH: std::time::Duration = std::time::Duration::from_secs(3600);

/// What one listing of the scheduler's tools gives: their specs, kinds and queue bounds, and
/// whether any is still being described.
/// A listing of the scheduler's tools, as [`Nomad::list`] reads it.
struct Listed {
    tools: Vec<ToolSpec>,
    kinds: HashMap<String, String>,
    max_pending: HashMap<String, u32>,
    /// The tools that cannot serve, with why (left out of `tools`).
    failed: HashMap<String, String>,
    pending: bool,
}

/// The scheduler's tools as listed at `at`.
struct Listing {
    at: std::time::Instant,
    tools: Vec<ToolSpec>,
    /// Each tool's kind (a Python model's arguments go as one JSON object).
    kinds: HashMap<String, String>,
    /// Each tool's queue bound (`max_pending`): requests beyond it are refused as queue_full.
    max_pending: HashMap<String, u32>,
    /// The tools that cannot serve, with why: a call to one is refused naming it.
    failed: HashMap<String, String>,
    /// Some tool was not described yet: the listing is kept for [`PENDING_POLL`] only.
    pending: bool,
}

pub struct Nomad {
    scheduler: SchedulerClient<nomad_rpc::Channel>,
    /// The scheduler's tools as last listed, kept for `ttl`.
    listing: tokio::sync::Mutex<Option<Listing>>,
    ttl: std::time::Duration,
    scheduler_wait: std::time::Duration,
    /// Woken when the tools change: a tool described (its own schema) or failed.
    changed: std::sync::Arc<tokio::sync::Notify>,
    watching: std::sync::atomic::AtomicBool,
}

/// The tool spec of a scheduler's tool: a Python model's own schemas once it is described, else
/// its kind's.
/// The hints of a tool whose calls change nothing and reach nothing outside the fleet.
pub fn pure_annotations() -> rmcp::model::ToolAnnotations {
    let mut hints = rmcp::model::ToolAnnotations::new();
    hints.read_only_hint = Some(true);
    hints.idempotent_hint = Some(true);
    hints.open_world_hint = Some(false);
    hints
}

fn tool_spec(t: ToolInfo) -> ToolSpec {
    let parse = |text: &str| {
        serde_json::from_str::<Value>(text)
            .ok()
            .filter(Value::is_object)
    };
    ToolSpec {
        description: if t.description.is_empty() {
            format!("{} model", t.kind)
        } else {
            t.description
        },
        input_schema: parse(&t.input_schema_json).unwrap_or_else(|| input_schema(&t.kind)),
        title: String::new(),
        output_schema: parse(&t.output_schema_json).or_else(|| output_schema(&t.kind)),
        annotations: nomad_proto::kinds::kind(&t.kind)
            .filter(|kind| kind.pure)
            .map(|_| pure_annotations()),
        name: t.name,
    }
}

fn model_card_spec() -> ToolSpec {
    ToolSpec {
        name: MODEL_CARD_TOOL.into(),
        description: "Return the Markdown model card (the README.md of its model directory) of \
                      one of this server's model tools."
            .into(),
        input_schema: json!({"type": "object", "required": ["tool_name"],
            "properties": {"tool_name": {"type": "string",
                "description": "Name of the tool whose model card to fetch."}}}),
        title: String::new(),
        output_schema: Some(json!({"type": "string"})),
        annotations: Some(pure_annotations()),
    }
}

impl Nomad {
    /// `scheduler_wait`: how long a call waits for a scheduler that cannot be reached (one
    /// starting again) before it fails as UNAVAILABLE.
    pub fn new(
        scheduler: SchedulerClient<nomad_rpc::Channel>,
        ttl: std::time::Duration,
        scheduler_wait: std::time::Duration,
        changed: std::sync::Arc<tokio::sync::Notify>,
    ) -> Self {
        Self {
            scheduler,
            listing: tokio::sync::Mutex::new(None),
            ttl,
            scheduler_wait,
            changed,
            watching: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// While some tool is not described yet, lists the scheduler's tools every second and wakes
    /// whoever waits for changes (the search index) when a tool's state changes, so a Python
    /// model shows its own schema as soon as it has one.
    fn watch_pending(&self) {
        use std::sync::atomic::Ordering;
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut scheduler = self.scheduler.clone();
        let changed = self.changed.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let mut last: Option<Vec<(String, i32)>> = None;
            while started.elapsed() < PENDING_WATCH {
                tokio::time::sleep(PENDING_POLL).await;
                let Ok(Ok(listed)) =
                    tokio::time::timeout(LIST_DEADLINE, scheduler.list_tools(ListToolsRequest {}))
                        .await
                else {
                    continue;
                };
                let states: Vec<(String, i32)> = listed
                    .into_inner()
                    .tools
                    .into_iter()
                    .map(|t| (t.name, t.state))
                    .collect();
                let pending = states.iter().any(|(_, s)| *s == ToolState::Pending as i32);
                if last.as_ref() != Some(&states) {
                    if last.is_some() {
                        changed.notify_waiters();
                    }
                    last = Some(states);
                }
                if !pending {
                    changed.notify_waiters();
                    break;
                }
            }
        });
    }

    /// The scheduler's tools: the kept listing while it is fresh, else a new one.
    pub async fn tools(&self) -> Result<Vec<ToolSpec>, ToolError> {
        Ok(self.listing().await?.0)
    }

    /// The kept listing while it is fresh, else a new one: the tools, and each one's kind.
    async fn listing(&self) -> Result<(Vec<ToolSpec>, HashMap<String, String>), ToolError> {
        let mut listing = self.listing.lock().await;
        if let Some(l) = listing.as_ref() {
            let ttl = if l.pending { PENDING_POLL } else { self.ttl };
            if l.at.elapsed() < ttl {
                return Ok((l.tools.clone(), l.kinds.clone()));
            }
        }
        let tools = tokio::time::timeout(LIST_DEADLINE, self.list())
            .await
            .map_err(|_| {
                ToolError::new(
                    ToolErrorCode::DeadlineExceeded,
                    format!(
                        "listing the scheduler's tools: no answer within {} s",
                        LIST_DEADLINE.as_secs()
                    ),
                )
            })??;
        let Listed {
            tools,
            kinds,
            max_pending,
            failed,
            pending,
        } = tools;
        if pending {
            self.watch_pending();
        }
        *listing = Some(Listing {
            at: std::time::Instant::now(),
            tools: tools.clone(),
            kinds: kinds.clone(),
            max_pending,
            failed,
            pending,
        });
        Ok((tools, kinds))
    }

    /// Why `tool` cannot serve, when the scheduler has it and it failed to load (a listing kept
    /// while fresh).
    pub async fn failed(&self, tool: &str) -> Result<Option<String>, ToolError> {
        self.listing().await?;
        Ok(self.kept_failure(tool).await)
    }

    /// Why `tool` cannot serve, from the kept listing alone (never lists).
    async fn kept_failure(&self, tool: &str) -> Option<String> {
        let listing = self.listing.lock().await;
        listing.as_ref().and_then(|l| l.failed.get(tool).cloned())
    }

    /// Each tool's name and kind (a listing kept while fresh); `get_model_card` is not a model.
    pub async fn kinds(&self) -> Result<Vec<(String, String)>, ToolError> {
        let (tools, kinds) = self.listing().await?;
        Ok(tools
            .into_iter()
            .filter_map(|t| kinds.get(&t.name).map(|k| (t.name, k.clone())))
            .collect())
    }

    /// The queue bound of `tool` (a listing kept while fresh), if the scheduler has it.
    pub async fn max_pending(&self, tool: &str) -> Result<Option<u32>, ToolError> {
        self.listing().await?;
        let listing = self.listing.lock().await;
        Ok(listing
            .as_ref()
            .and_then(|l| l.max_pending.get(tool).copied()))
    }

    /// Whether the last listing, however old, has `tool`; never lists.
    pub async fn listed(&self, tool: &str) -> bool {
        let listing = self.listing.lock().await;
        listing
            .as_ref()
            .is_some_and(|l| l.tools.iter().any(|t| t.name == tool))
    }

    /// Tools that failed to load are left out of the tools and kept with why; also each one's
    /// kind and queue bound, and whether any is still being described.
    async fn list(&self) -> Result<Listed, ToolError> {
        let listed = self
            .scheduler
            .clone()
            .list_tools(ListToolsRequest {})
            .await
            .map_err(|s| {
                let code = if nomad_rpc::peer_lost(&s) {
                    ToolErrorCode::Unavailable
                } else {
                    s.code().into()
                };
                ToolError::new(
                    code,
                    format!("listing the scheduler's tools: {}", s.message()),
                )
            })?;
        let (failed, tools): (Vec<ToolInfo>, Vec<ToolInfo>) = listed
            .into_inner()
            .tools
            .into_iter()
            .partition(|t| t.state() == ToolState::Failed);
        let failed = failed.into_iter().map(|t| (t.name, t.error)).collect();
        let pending = tools.iter().any(|t| t.state() == ToolState::Pending);
        let kinds = tools
            .iter()
            .map(|t| (t.name.clone(), t.kind.clone()))
            .collect();
        let max_pending = tools
            .iter()
            .map(|t| (t.name.clone(), t.max_pending))
            .collect();
        let mut specs: Vec<ToolSpec> = tools.into_iter().map(tool_spec).collect();
        if !specs.iter().any(|t| t.name == MODEL_CARD_TOOL) {
            specs.push(model_card_spec());
        }
        Ok(Listed {
            tools: specs,
            kinds,
            max_pending,
            failed,
            pending,
        })
    }

    /// Calls `tool`; the caller's context is current (the client layer injects it). With
    /// `progress`, the call streams and each piece of text the tool makes is offered there as it
    /// comes (dropped when the channel is full: the answer holds it all anyway).
    pub async fn call(
        &self,
        tool: &str,
        arguments: &Value,
        progress: Option<&tokio::sync::mpsc::Sender<String>>,
    ) -> Result<Value, ToolError> {
        let (_, kinds) = self.listing().await?;
        if let Some(why) = self.kept_failure(tool).await {
            return Err(cannot_serve(tool, &why));
        }
        let kind = kinds.get(tool).map(String::as_str);
        if tool == MODEL_CARD_TOOL && kind.is_none() {
            return self.model_card(arguments).await;
        }
        let input = if kind == Some(nomad_proto::kinds::PYTHON.name) {
            nomad_json::arguments_input(arguments)
        } else {
            nomad_json::input_from_value(arguments, kind.and_then(nomad_proto::kinds::kind))
        }
        .map_err(|e| match kind {
            Some(_) => ToolError::invalid_argument(format!("{NAME}.{tool}: {e}")),
            // Not in the listing, which may be older than the tool: arguments that could fit
            // some kind go to the scheduler, which knows; these fit none, so the name is wrong.
            None => {
                let mut names: Vec<&str> = kinds.keys().map(String::as_str).collect();
                names.sort_unstable();
                ToolError::not_found(format!(
                    "{NAME}.{tool}: no such tool; the scheduler has {}",
                    names.join(", ")
                ))
            }
        })?;
        let request = CallToolRequest {
            tool: tool.to_owned(),
            input: Some(input),
        };
        // A scheduler starting again (the fleet restarts what dies) is waited for: a call that
        // never reached it is made again.
        let scheduler = &self.scheduler;
        let reply = match progress {
            None => nomad_rpc::while_unreachable(self.scheduler_wait, || {
                let (mut scheduler, request) = (scheduler.clone(), request.clone());
                async move { scheduler.call_tool(request).await }
            })
            .await
            .map(|r| r.into_inner()),
            Some(progress) => {
                let opened = nomad_rpc::while_unreachable(self.scheduler_wait, || {
                    let (mut scheduler, request) = (scheduler.clone(), request.clone());
                    async move { scheduler.call_tool_stream(request).await }
                })
                .await;
                match opened {
                    Ok(events) => streamed(events.into_inner(), progress).await,
                    Err(status) => Err(status),
                }
            }
        }
        .map_err(|s| unreachable_scheduler(tool, s, self.scheduler_wait))?;
        let output = reply.output.ok_or_else(|| {
            ToolError::internal(format!("{NAME}.{tool}: the scheduler returned no output"))
        })?;
        nomad_json::output_to_json(&output, reply.generation.as_ref())
            .map_err(|e| ToolError::internal(format!("{NAME}.{tool}: {e}")))
    }
}

impl Nomad {
    /// `get_model_card(tool_name)`: the tool's model card, as text.
    async fn model_card(&self, arguments: &Value) -> Result<Value, ToolError> {
        let Some(tool) = arguments.get("tool_name").and_then(Value::as_str) else {
            return Err(ToolError::invalid_argument(format!(
                "{NAME}.{MODEL_CARD_TOOL}: arguments need `tool_name` (a string)"
            )));
        };
        let card = self
            .scheduler
            .clone()
            .get_model_card(GetModelCardRequest {
                tool: tool.to_owned(),
            })
            .await
            .map_err(|s| unreachable_scheduler(MODEL_CARD_TOOL, s, self.scheduler_wait))?;
        Ok(Value::String(card.into_inner().text))
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
            Some(call_tool_stream_event::Event::Done(answer)) => {
                // Read on to the stream's end, so the call ends with the scheduler's status
                // rather than as abandoned (and its span with it).
                while let Ok(Some(_)) = events.message().await {}
                return Ok(answer);
            }
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the scheduler ended the stream without an answer",
    ))
}

/// A scheduler that could not be reached, or a connection that broke under the call (which reads
/// as CANCELLED, UNKNOWN or INTERNAL; the caller did neither), is UNAVAILABLE, saying which; the
/// scheduler's own statuses keep their codes.
fn unreachable_scheduler(
    tool: &str,
    status: tonic::Status,
    waited: std::time::Duration,
) -> ToolError {
    if nomad_rpc::never_sent(&status) {
        ToolError::unavailable(format!(
            "{NAME}.{tool}: the scheduler could not be reached within {:.1} s \
             (gateway.scheduler_wait_seconds): {}",
            waited.as_secs_f64(),
            status.message()
        ))
    } else if nomad_rpc::peer_lost(&status) && status.source().is_some() {
        ToolError::unavailable(format!(
            "{NAME}.{tool}: the connection to the scheduler was lost during the call (the \
             scheduler stopped or restarted): {}",
            status.message()
        ))
    } else if status.code() != tonic::Code::Unavailable && nomad_rpc::peer_lost(&status) {
        ToolError::unavailable(format!(
            "{NAME}.{tool}: the scheduler is unreachable: {}",
            status.message()
        ))
    } else {
        status.into()
    }
}

/// The refusal of a call to a tool whose model failed to load, naming why.
pub fn cannot_serve(tool: &str, why: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::FailedPrecondition,
        format!(
            "{NAME}.{tool} cannot serve: {why} (`nomad status` and the device worker's log say more)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use nomad_proto::v1::{Tensor, ToolOutput, tool_output};

    #[test]
    fn every_built_in_kind_says_what_it_answers_with() {
        for kind in nomad_proto::kinds::names() {
            let schema = super::output_schema(kind);
            assert_eq!(schema.is_none(), kind == "python", "{kind}: {schema:?}");
        }
        // What the gateway makes of a tensor and of a text answers as the schemas say.
        let tensor = ToolOutput {
            value: Some(tool_output::Value::Tensor(Tensor::from_f32(
                &[1.0, 2.0],
                vec![2],
            ))),
        };
        let text = ToolOutput {
            value: Some(tool_output::Value::Text("hi".into())),
        };
        for (kind, output) in [("embed", tensor), ("generate", text)] {
            let value = super::nomad_json::output_to_json(&output, None).unwrap();
            let schema = super::output_schema(kind).unwrap();
            for key in schema["required"].as_array().unwrap() {
                let key = key.as_str().unwrap();
                assert!(value.get(key).is_some(), "{kind}: {value} lacks {key}");
            }
        }
    }
}
