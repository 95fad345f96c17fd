//! The fleet's tools as MCP tools of their own, as the original Nomad's `nomad serve` offers
//! them: one MCP tool per scheduler tool (its own description, input schema and output schema;
//! JSON outputs as `structuredContent`), plus `get_model_card`. Each call goes through the
//! scheduler's queues (concurrent calls are batched), carries the caller's trace context from
//! `params._meta`, is recorded as an upstream call, stops when the caller cancels it, and
//! streams a generation's text as progress notifications.

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    MetaObject, PaginatedRequestParams, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Map, Value, json};

use crate::execute::Gateway;
use crate::sandbox::ToolSpec;
use crate::upstream::nomad;

use crate::tool_error::ERROR_CODE_META;

#[derive(Clone)]
pub struct DirectTools {
    pub gateway: Arc<Gateway>,
    pub tasks: Arc<crate::tasks::Tasks>,
}

/// An MCP output schema must describe an object: any other output is wrapped as
/// `{"result": ...}`, as the original's FastMCP wraps it.
fn output_schema(schema: &Value) -> (Map<String, Value>, bool) {
    if let Value::Object(map) = schema
        && map.get("type").and_then(Value::as_str) == Some("object")
    {
        return (map.clone(), false);
    }
    let wrapped = json!({"type": "object", "properties": {"result": schema},
                         "required": ["result"], "x-nomad-wrap-result": true});
    match wrapped {
        Value::Object(map) => (map, true),
        _ => unreachable!("built as an object"),
    }
}

fn mcp_tool(spec: &ToolSpec) -> Tool {
    let input = match &spec.input_schema {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    let mut tool = Tool::new(spec.name.clone(), spec.description.clone(), Arc::new(input));
    tool.annotations = spec.annotations.clone();
    if let Some(schema) = spec
        .output_schema
        .as_ref()
        .filter(|_| declares_output(spec))
    {
        tool.output_schema = Some(Arc::new(output_schema(schema).0));
    }
    tool
}

/// Whether the MCP tool of `spec` declares an output schema (the model card, text, does not).
fn declares_output(spec: &ToolSpec) -> bool {
    spec.output_schema.is_some() && spec.name != nomad::MODEL_CARD_TOOL
}

impl DirectTools {
    async fn specs(&self) -> Result<Vec<ToolSpec>, McpError> {
        self.gateway
            .upstreams
            .tools(nomad::NAME)
            .await
            .map_err(|e| McpError::internal_error(e.message, None))
    }
}

impl ServerHandler for DirectTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(crate::tasks::capabilities()).with_instructions(
            "Nomad's model tools, each an MCP tool of its own; get_model_card returns a tool's \
             model card.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(
            self.specs().await?.iter().map(mcp_tool).collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let cx = crate::mcp_call::trace_context(&request, &context);
        let specs = self.specs().await?;
        let Some(spec) = specs.iter().find(|t| t.name == request.name.as_ref()) else {
            let error = self
                .gateway
                .upstreams
                .missing(nomad::NAME, &request.name)
                .await;
            // No such tool is a protocol error in MCP (invalid params); its code rides in
            // `data`. A tool the fleet has but cannot serve is a failed call, named.
            if error.code == crate::tool_error::ToolErrorCode::NotFound {
                return Err(McpError::invalid_params(
                    error.message,
                    Some(json!({ERROR_CODE_META: error.code})),
                ));
            }
            return Ok(CallToolResponse::Complete(error_result(&error)));
        };
        let arguments = Value::Object(request.arguments.clone().unwrap_or_default());
        let caller = crate::tasks::Caller::of(&context);
        let has_output_schema = declares_output(spec);
        if self.tasks.wants_task(&spec.name, &context) {
            // The call runs on as a task; `tasks/cancel` drops it, which cancels its scheduler
            // request.
            let spec = spec.clone();
            let gateway = self.gateway.clone();
            let tasks = self.tasks.clone();
            let owner = caller.clone();
            let created = self
                .tasks
                .start(&caller, &spec.name.clone(), &cx, move |cx| {
                    Box::pin(async move {
                        let result = call(&gateway, &cx, &spec, &arguments, None).await;
                        Ok(tasks
                            .link_large(&owner, &spec.name, result, has_output_schema)
                            .await)
                    })
                })
                .await?;
            return Ok(CallToolResponse::Task(created));
        }
        let (progress, forwarding) = crate::mcp_call::progress(&request, &context);
        // A cancelled call is dropped here, which cancels its scheduler request.
        let called = tokio::select! {
            result = call(&self.gateway, &cx, spec, &arguments, progress.as_ref()) => Some(result),
            () = context.ct.cancelled() => None,
        };
        drop(progress);
        if let Some(forwarding) = forwarding {
            let _ = forwarding.await;
        }
        match called {
            Some(result) => Ok(CallToolResponse::Complete(
                self.tasks
                    .link_large(&caller, &spec.name, result, has_output_schema)
                    .await,
            )),
            None => Err(McpError::internal_error("the call was cancelled", None)),
        }
    }

    crate::tasks::task_methods!();
}

/// One call of a fleet tool through the scheduler, as an MCP result: text as text, JSON as
/// `structuredContent` (wrapped as `{"result": ...}` where its schema is not an object), a
/// failure as an error result naming its code.
async fn call(
    gateway: &Gateway,
    cx: &nomad_telemetry::Context,
    spec: &ToolSpec,
    arguments: &Value,
    progress: Option<&crate::upstream::Progress>,
) -> CallToolResult {
    let result = gateway
        .upstreams
        .call(cx, nomad::NAME, &spec.name, arguments, progress)
        .await;
    match result {
        Ok(Value::String(text))
            if spec.output_schema.is_none() || spec.name == nomad::MODEL_CARD_TOOL =>
        {
            CallToolResult::success(vec![ContentBlock::text(text)])
        }
        Ok(value) => {
            let wrap = spec
                .output_schema
                .as_ref()
                .is_some_and(|s| output_schema(s).1)
                || !value.is_object();
            CallToolResult::structured(if wrap {
                json!({"result": value})
            } else {
                value
            })
        }
        Err(error) => error_result(&error),
    }
}

/// A failed call's result: its words, and its code in `_meta` for a program to act on (retry,
/// fix the arguments).
fn error_result(error: &crate::tool_error::ToolError) -> CallToolResult {
    let mut result = CallToolResult::error(vec![ContentBlock::text(format!(
        "{}: {}",
        error.code.describe(),
        error.message
    ))]);
    let mut meta = MetaObject::new();
    meta.0.insert(ERROR_CODE_META.into(), json!(error.code));
    result.meta = Some(meta);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_that_is_not_an_object_is_wrapped_as_result() {
        let (schema, wrapped) = output_schema(&json!({"type": "integer"}));
        assert!(wrapped);
        assert_eq!(schema["properties"]["result"], json!({"type": "integer"}));
        let object = json!({"type": "object", "properties": {"norm": {"type": "number"}}});
        let (schema, wrapped) = output_schema(&object);
        assert!(!wrapped);
        assert_eq!(Value::Object(schema), object);
    }
}
