//! The built-in `nomad` upstream: the scheduler's tools, called with JSON arguments.

use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{CallToolRequest, ListToolsRequest};
use serde_json::{Value, json};

use super::nomad_json;
use crate::sandbox::ToolSpec;

pub const NAME: &str = "nomad";

/// The JSON Schema of a tool's arguments, from its kind.
pub fn input_schema(kind: &str) -> Value {
    match kind {
        "embed" => json!({
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "Text to embed."},
                "truncate": {"type": "boolean", "default": false,
                             "description": "Cut a text longer than the model's limit instead of refusing it."}
            },
            "required": ["text"]
        }),
        "generate" => json!({
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "The prompt (a user message unless chat is false)."},
                "max_tokens": {"type": "integer", "default": 64, "minimum": 1, "maximum": 2048},
                "temperature": {"type": "number", "default": 0, "minimum": 0, "maximum": 2},
                "seed": {"type": "integer", "default": 0},
                "chat": {"type": "boolean", "default": true}
            },
            "required": ["text"]
        }),
        _ => json!({
            "type": "object",
            "properties": {
                "input": {"type": "array", "items": {"type": "number"}, "description": "Tensor values, row-major."},
                "shape": {"type": "array", "items": {"type": "integer"}, "description": "Default: [len(input)]."}
            },
            "required": ["input"]
        }),
    }
}

#[derive(Clone)]
pub struct Nomad {
    pub scheduler: SchedulerClient<nomad_rpc::Channel>,
}

impl Nomad {
    pub async fn tools(&self) -> Result<Vec<ToolSpec>, String> {
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
                name: t.name,
            })
            .collect())
    }

    /// Calls `tool`; the caller's context is current (the client layer injects it).
    pub async fn call(&self, tool: &str, arguments: &Value) -> Result<Value, tonic::Status> {
        let input = nomad_json::input_from_value(arguments)
            .map_err(|e| tonic::Status::invalid_argument(format!("{NAME}.{tool}: {e}")))?;
        let reply = self
            .scheduler
            .clone()
            .call_tool(CallToolRequest {
                tool: tool.to_owned(),
                input: Some(input),
            })
            .await?
            .into_inner();
        let output = reply.output.ok_or_else(|| {
            tonic::Status::internal(format!("{NAME}.{tool}: the scheduler returned no output"))
        })?;
        nomad_json::output_to_json(&output)
            .map_err(|e| tonic::Status::internal(format!("{NAME}.{tool}: {e}")))
    }
}
