//! The gateway as an MCP server (official Rust SDK): `search_code_tools`, `execute_mcp_code`,
//! `execute_mcp_script`, over Streamable HTTP (with an optional bearer token) or stdio. The
//! trace context of a `tools/call` comes from `params._meta` (`traceparent`, `tracestate`,
//! `baggage`).

use std::collections::BTreeMap;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Map, Value, json};

use crate::execute::Gateway;
use crate::search::{DetailLevel, SearchRequest};

#[derive(Clone)]
pub struct McpFrontEnd {
    pub gateway: Arc<Gateway>,
}

fn schema(value: Value) -> Arc<Map<String, Value>> {
    match value {
        Value::Object(map) => Arc::new(map),
        _ => unreachable!("tool schemas are objects"),
    }
}

/// The tools offered: `execute_mcp_script` only where there is a workspace root to run
/// scripts from (without one, every call of it would fail).
fn tools(scripts: bool) -> Vec<Tool> {
    let env = json!({"type": "object", "additionalProperties": {"type": "string"},
                     "description": "Environment variables for the code."});
    let mut tools = vec![
        Tool::new(
            "search_code_tools",
            "Find upstream tools for a task, in plain words or by name (ranked by words and by \
             meaning), with how to call each from code: `from mcp_tools.<server> import <tool>` \
             and its Python signature. Says how it ranked and which servers could not be listed.",
            schema(json!({
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": crate::search::MAX_QUERY_BYTES,
                              "description": "What the tool should do, or its name; empty lists every tool."},
                    "server_filter": {"type": "string", "description": "Only this upstream server."},
                    "detail_level": {"type": "string", "enum": ["brief", "full"], "default": "brief",
                                     "description": "brief: description, import and signature; full: also the input and output schema."},
                    "limit": {"type": "integer", "minimum": 1,
                              "description": "At most this many tools (default 20; every tool for an empty query)."}
                }
            })),
        ),
        Tool::new(
            "execute_mcp_code",
            "Run Python in a sandbox. Call tools as `from mcp_tools.<server> import <tool>` \
             (sync, or `<tool>_async` to await). Set `RESULT` to what you want back (JSON). \
             Returns result, stdout, stderr, returncode, duration_seconds, status and error. \
             With a progress token, text the `nomad` tools generate arrives as progress \
             notifications as it is made.",
            schema(json!({
                "type": "object",
                "properties": {"code": {"type": "string"}, "env": env},
                "required": ["code"]
            })),
        ),
    ];
    if scripts {
        tools.push(Tool::new(
            "execute_mcp_script",
            "Run a Python script file from the gateway's workspace root in the sandbox, as \
             execute_mcp_code runs code.",
            schema(json!({
                "type": "object",
                "properties": {"script_path": {"type": "string"}, "env": env},
                "required": ["script_path"]
            })),
        ));
    }
    for tool in &mut tools {
        tool.annotations = Some(if tool.name == "search_code_tools" {
            crate::upstream::nomad::pure_annotations()
        } else {
            // Code calls any upstream tool, MCP servers beyond the fleet among them.
            let mut hints = rmcp::model::ToolAnnotations::new();
            hints.read_only_hint = Some(false);
            hints.idempotent_hint = Some(false);
            hints.open_world_hint = Some(true);
            hints
        });
    }
    tools
}

fn string(args: &Map<String, Value>, key: &str) -> Result<Option<String>, McpError> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(McpError::invalid_params(
            format!("`{key}` must be a string"),
            None,
        )),
    }
}

fn env(args: &Map<String, Value>) -> Result<BTreeMap<String, String>, McpError> {
    match args.get("env") {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(McpError::invalid_params(
                    format!("env.{k} must be a string"),
                    None,
                )),
            })
            .collect(),
        Some(_) => Err(McpError::invalid_params(
            "`env` must be an object of strings",
            None,
        )),
    }
}

fn complete(value: Value, failed: bool) -> CallToolResponse {
    CallToolResponse::Complete(if failed {
        CallToolResult::structured_error(value)
    } else {
        CallToolResult::structured(value)
    })
}

impl ServerHandler for McpFrontEnd {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_instructions(
            "Nomad's code-mode gateway: search the upstream tools, then run Python that calls them.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(tools(
            self.gateway.runs_scripts(),
        )))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let cx = nomad_telemetry::propagation::extract_map(&crate::mcp_call::carrier(
            &request, &context,
        ));
        let args = request.arguments.clone().unwrap_or_default();
        match request.name.as_ref() {
            "search_code_tools" => {
                let query = string(&args, "query")?.unwrap_or_default();
                let server = string(&args, "server_filter")?.unwrap_or_default();
                let detail = DetailLevel::parse(string(&args, "detail_level")?.as_deref())
                    .map_err(|e| McpError::invalid_params(e.to_string(), None))?;
                let limit = match args.get("limit") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
                        McpError::invalid_params(
                            "`limit` must be a whole number of at least 1",
                            None,
                        )
                    })? as usize),
                };
                let request = SearchRequest {
                    query: &query,
                    server_filter: &server,
                    detail,
                    limit,
                };
                match self.gateway.search.search(&request).await {
                    Ok(reply) => Ok(complete(reply.to_json(), false)),
                    Err(e) => Ok(complete(json!({ "error": e.to_string() }), true)),
                }
            }
            "execute_mcp_code" | "execute_mcp_script" => {
                let (progress, forwarding) = crate::mcp_call::progress(&request, &context);
                let env = env(&args)?;
                let ran = if request.name == "execute_mcp_code" {
                    let code = string(&args, "code")?
                        .filter(|c| !c.trim().is_empty())
                        .ok_or_else(|| McpError::invalid_params("`code` is required", None))?;
                    self.gateway.execute_code(code, env, &cx, progress).await
                } else {
                    let path = string(&args, "script_path")?.ok_or_else(|| {
                        McpError::invalid_params("`script_path` is required", None)
                    })?;
                    self.gateway.execute_script(&path, env, &cx, progress).await
                };
                // Every progress notification goes out before the answer.
                if let Some(forwarding) = forwarding {
                    let _ = forwarding.await;
                }
                match ran {
                    Ok(reply) => Ok(complete(reply.to_json(), !reply.error.is_empty())),
                    Err(e) => Ok(complete(json!({ "error": e.to_string() }), true)),
                }
            }
            other => Err(McpError::invalid_params(
                format!(
                    "unknown tool {other:?}; tools: search_code_tools, execute_mcp_code, execute_mcp_script"
                ),
                None,
            )),
        }
    }
}
