//! The gateway as an MCP server (official Rust SDK): `search_code_tools`, `execute_mcp_code`,
//! `execute_mcp_script`, over Streamable HTTP (with an optional bearer token) or stdio. The
//! trace context of a `tools/call` comes from `params._meta` (`traceparent`, `tracestate`,
//! `baggage`).

use std::collections::BTreeMap;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ListToolsResult,
    PaginatedRequestParams, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::execute::Gateway;
use crate::search::{DetailLevel, SearchRequest};

#[derive(Clone)]
pub struct McpFrontEnd {
    pub gateway: Arc<Gateway>,
    pub tasks: Arc<crate::tasks::Tasks>,
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

/// `search_code_tools`' arguments.
#[derive(Debug, Deserialize)]
struct SearchArgs {
    #[serde(default)]
    query: Option<String>,
    #[serde(default)]
    server_filter: Option<String>,
    #[serde(default)]
    detail_level: Option<String>,
    #[serde(default)]
    limit: Option<std::num::NonZeroUsize>,
}

/// `execute_mcp_code`'s arguments.
#[derive(Debug, Deserialize)]
struct CodeArgs {
    code: String,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
}

/// `execute_mcp_script`'s arguments.
#[derive(Debug, Deserialize)]
struct ScriptArgs {
    script_path: String,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
}

/// What an execute tool runs.
enum Run {
    Code(String),
    Script(String),
}

/// A tool's arguments read into `T`; a bad one is refused naming where it is (`env.HOME:
/// invalid type: integer `1`, expected a string`).
fn arguments<T: serde::de::DeserializeOwned>(
    tool: &str,
    args: Map<String, Value>,
) -> Result<T, McpError> {
    serde_path_to_error::deserialize(Value::Object(args)).map_err(|e| {
        let at = e.path().to_string();
        let message = if at == "." {
            format!("{tool}: {}", e.inner())
        } else {
            format!("{tool}: `{at}`: {}", e.inner())
        };
        McpError::invalid_params(message, None)
    })
}

fn complete(value: Value, failed: bool) -> CallToolResponse {
    CallToolResponse::Complete(result(value, failed))
}

fn result(value: Value, failed: bool) -> CallToolResult {
    if failed {
        CallToolResult::structured_error(value)
    } else {
        CallToolResult::structured(value)
    }
}

/// One sandboxed run, as its MCP result (a run that failed is an error result, not a
/// protocol error: its stdout and stderr are what the caller needs).
async fn execute(
    gateway: &Gateway,
    run: Run,
    env: BTreeMap<String, String>,
    cx: &nomad_telemetry::Context,
    progress: Option<crate::upstream::Progress>,
) -> CallToolResult {
    let ran = match run {
        Run::Code(code) => gateway.execute_code(code, env, cx, progress).await,
        Run::Script(path) => gateway.execute_script(&path, env, cx, progress).await,
    };
    match ran {
        Ok(reply) => result(reply.to_json(), !reply.error.is_empty()),
        Err(e) => result(json!({ "error": e.to_string() }), true),
    }
}

impl ServerHandler for McpFrontEnd {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(crate::tasks::capabilities()).with_instructions(
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
        let cx = crate::mcp_call::trace_context(&request, &context);
        let args = request.arguments.clone().unwrap_or_default();
        match request.name.as_ref() {
            "search_code_tools" => {
                let args: SearchArgs = arguments("search_code_tools", args)?;
                let detail = DetailLevel::parse(args.detail_level.as_deref())
                    .map_err(|e| McpError::invalid_params(e.to_string(), None))?;
                let request = SearchRequest {
                    query: args.query.as_deref().unwrap_or_default(),
                    server_filter: args.server_filter.as_deref().unwrap_or_default(),
                    detail,
                    limit: args.limit.map(std::num::NonZeroUsize::get),
                };
                match self.gateway.search.search(&request).await {
                    Ok(reply) => Ok(complete(reply.to_json(), false)),
                    Err(e) => Ok(complete(json!({ "error": e.to_string() }), true)),
                }
            }
            "execute_mcp_code" | "execute_mcp_script" => {
                // Read before anything starts: a bad argument runs nothing.
                let (run, env) = if request.name == "execute_mcp_code" {
                    let args: CodeArgs = arguments("execute_mcp_code", args)?;
                    if args.code.trim().is_empty() {
                        return Err(McpError::invalid_params(
                            "execute_mcp_code: `code` is empty: give the Python to run",
                            None,
                        ));
                    }
                    (Run::Code(args.code), args.env)
                } else {
                    let args: ScriptArgs = arguments("execute_mcp_script", args)?;
                    (Run::Script(args.script_path), args.env)
                };
                let env = env.unwrap_or_default();
                let caller = crate::tasks::Caller::of(&context);
                let tool = request.name.to_string();
                if self.tasks.wants_task(&tool, &context) {
                    // The run goes on as a task; `tasks/cancel` drops it, which kills it.
                    let gateway = self.gateway.clone();
                    let tasks = self.tasks.clone();
                    let owner = caller.clone();
                    let created = self
                        .tasks
                        .start(&caller, &tool.clone(), &cx, move |cx| {
                            Box::pin(async move {
                                let ran = execute(&gateway, run, env, &cx, None).await;
                                Ok(tasks.link_large(&owner, &tool, ran, false).await)
                            })
                        })
                        .await?;
                    return Ok(CallToolResponse::Task(created));
                }
                let (progress, forwarding) = crate::mcp_call::progress(&request, &context);
                let ran = execute(&self.gateway, run, env, &cx, progress).await;
                // Every progress notification goes out before the answer.
                if let Some(forwarding) = forwarding {
                    let _ = forwarding.await;
                }
                Ok(CallToolResponse::Complete(
                    self.tasks.link_large(&caller, &tool, ran, false).await,
                ))
            }
            other => Err(McpError::invalid_params(
                format!(
                    "unknown tool {other:?}; tools: search_code_tools, execute_mcp_code, execute_mcp_script"
                ),
                None,
            )),
        }
    }

    crate::tasks::task_methods!();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused<T: serde::de::DeserializeOwned + std::fmt::Debug>(
        tool: &str,
        args: Value,
    ) -> String {
        let Value::Object(map) = args else {
            panic!("arguments are an object")
        };
        arguments::<T>(tool, map).unwrap_err().message.into_owned()
    }

    #[test]
    fn a_bad_argument_is_refused_naming_where_it_is() {
        let cases = [
            (
                refused::<CodeArgs>("execute_mcp_code", json!({})),
                "execute_mcp_code: missing field `code`",
            ),
            (
                refused::<CodeArgs>("execute_mcp_code", json!({"code": 5})),
                "execute_mcp_code: `code`: invalid type: integer `5`, expected a string",
            ),
            (
                refused::<CodeArgs>("execute_mcp_code", json!({"code": "x", "env": {"HOME": 1}})),
                "execute_mcp_code: `env.HOME`: invalid type: integer `1`, expected a string",
            ),
            (
                refused::<ScriptArgs>("execute_mcp_script", json!({"script_path": ["a"]})),
                "execute_mcp_script: `script_path`: invalid type: sequence, expected a string",
            ),
            (
                refused::<SearchArgs>("search_code_tools", json!({"limit": 0})),
                "search_code_tools: `limit`: invalid value: integer `0`, expected a nonzero usize",
            ),
        ];
        for (got, expected) in cases {
            assert_eq!(got, expected);
        }
        let Value::Object(ok) = json!({"code": "print(1)", "env": null}) else {
            unreachable!()
        };
        let args: CodeArgs = arguments("execute_mcp_code", ok).unwrap();
        assert_eq!((args.code.as_str(), args.env), ("print(1)", None));
    }
}
