//! An external MCP server (stdio command or Streamable HTTP URL) through the official Rust SDK.
//! The session is opened on first use, kept, and opened again when a call finds it dead.

use std::collections::HashMap;

use rmcp::model::{CallToolRequestParams, CallToolResult, MetaObject, RequestMetaObject};
use rmcp::service::RunningService;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{Peer, RoleClient, ServiceExt as _};
use serde_json::Value;
use tokio::sync::Mutex;

use crate::config::ServerConfig;
use crate::sandbox::ToolSpec;

type Session = RunningService<RoleClient, ()>;

pub struct McpServer {
    name: String,
    config: ServerConfig,
    session: Mutex<Option<Session>>,
}

/// How a call failed: the server answered with an error, or the session is unusable.
enum CallError {
    Tool(String),
    Session(String),
}

impl McpServer {
    pub fn new(name: String, config: ServerConfig) -> Self {
        Self {
            name,
            config,
            session: Mutex::new(None),
        }
    }

    async fn connect(&self) -> Result<Session, String> {
        let what =
            |e: &dyn std::fmt::Display| format!("connecting to MCP server {:?}: {e}", self.name);
        if let Some(command) = &self.config.command {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(&self.config.args).envs(&self.config.env);
            // The server's stderr is its log; keep it out of the gateway's stdout.
            cmd.stderr(std::process::Stdio::inherit());
            let transport = TokioChildProcess::new(cmd).map_err(|e| what(&e))?;
            ().serve(transport).await.map_err(|e| what(&e))
        } else {
            let url = self.config.url.clone().unwrap_or_default();
            let mut headers = HashMap::new();
            for (k, v) in &self.config.headers {
                let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|e| what(&e))?;
                let value = http::HeaderValue::from_str(v).map_err(|e| what(&e))?;
                headers.insert(name, value);
            }
            let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url)
                .custom_headers(headers);
            let transport = StreamableHttpClientTransport::from_config(config);
            ().serve(transport).await.map_err(|e| what(&e))
        }
    }

    /// A handle on a live session, opening one if there is none (or the last one closed).
    async fn peer(&self) -> Result<Peer<RoleClient>, String> {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| s.is_closed()) {
            guard.take();
        }
        if guard.is_none() {
            *guard = Some(self.connect().await?);
        }
        Ok(guard.as_ref().expect("just set").peer().clone())
    }

    /// Runs `f` on a live session; when the session itself fails, opens a new one and tries once
    /// more.
    async fn with_session<T, F, Fut>(&self, f: F) -> Result<T, String>
    where
        F: Fn(Peer<RoleClient>) -> Fut,
        Fut: Future<Output = Result<T, CallError>>,
    {
        for attempt in 0..2 {
            match f(self.peer().await?).await {
                Ok(v) => return Ok(v),
                Err(CallError::Tool(message)) => return Err(message),
                Err(CallError::Session(message)) => {
                    tracing::warn!(server = %self.name, "MCP session failed ({message}); reconnecting");
                    if let Some(dead) = self.session.lock().await.take() {
                        let _ = dead.cancel().await;
                    }
                    if attempt == 1 {
                        return Err(format!("MCP server {:?}: {message}", self.name));
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }

    pub async fn tools(&self) -> Result<Vec<ToolSpec>, String> {
        self.with_session(|peer| async move {
            peer.list_all_tools()
                .await
                .map_err(|e| CallError::Session(e.to_string()))
        })
        .await
        .map(|tools| {
            tools
                .into_iter()
                .map(|t| ToolSpec {
                    name: t.name.to_string(),
                    description: t.description.map(|d| d.to_string()).unwrap_or_default(),
                    input_schema: Value::Object((*t.input_schema).clone()),
                })
                .collect()
        })
    }

    /// Calls `tool` with `arguments`, carrying `trace` (`traceparent`, `tracestate`, `baggage`)
    /// in `params._meta`.
    pub async fn call(
        &self,
        tool: &str,
        arguments: &Value,
        trace: &HashMap<String, String>,
    ) -> Result<Value, String> {
        let Value::Object(arguments) = arguments else {
            return Err(format!(
                "{}.{tool}: arguments must be a JSON object",
                self.name
            ));
        };
        let mut meta = MetaObject::new();
        for (key, value) in trace {
            meta.0.insert(key.clone(), Value::String(value.clone()));
        }
        let mut params =
            CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments.clone());
        params.meta = Some(RequestMetaObject(meta));
        let result = self
            .with_session(|peer| {
                let params = params.clone();
                async move {
                    peer.call_tool(params).await.map_err(|e| match e {
                        rmcp::ServiceError::McpError(e) => CallError::Tool(e.message.to_string()),
                        other => CallError::Session(other.to_string()),
                    })
                }
            })
            .await?;
        result_value(&self.name, tool, result)
    }
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A tool result as the sandbox sees it: its structured content if any, else its text (one text
/// block as a string, several as a list).
fn result_value(server: &str, tool: &str, result: CallToolResult) -> Result<Value, String> {
    if result.is_error == Some(true) {
        return Err(format!("{server}.{tool} failed: {}", text_of(&result)));
    }
    if let Some(structured) = result.structured_content {
        return Ok(structured);
    }
    let texts: Vec<Value> = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| Value::String(t.text.clone())))
        .collect();
    Ok(match texts.len() {
        1 => texts.into_iter().next().expect("one"),
        _ => Value::Array(texts),
    })
}
