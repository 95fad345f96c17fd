//! An external MCP server (stdio command or Streamable HTTP URL) through the official Rust SDK.
//! The session is opened on first use, kept, and opened again when a call finds it dead. Every
//! connect and call has a deadline, no lock is held while connecting, and the tool listing is
//! kept for a while (`tools_ttl_seconds`) and dropped when the server says it changed
//! (`notifications/tools/list_changed`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, MetaObject, RequestMetaObject, ServerNotification,
    SubscriptionFilter,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, Peer, RoleClient, ServiceExt as _};
use serde_json::Value;
use tokio::sync::{Mutex, Notify};

use crate::config::{ServerConfig, Timing};
use crate::sandbox::ToolSpec;
use crate::tool_error::{ToolError, ToolErrorCode};

type Session = RunningService<RoleClient, Listener>;

/// Hears the server's notifications: a changed tool list drops the cached one and wakes the
/// search index.
#[derive(Clone)]
struct Listener {
    tools_changed: Arc<AtomicU64>,
    wake: Arc<Notify>,
}

impl Listener {
    fn tools_changed(&self) {
        self.tools_changed.fetch_add(1, Ordering::Relaxed);
        self.wake.notify_one();
    }
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed();
    }
}

/// A tool listing, as of when it was fetched.
struct Listing {
    at: Instant,
    generation: u64,
    tools: Vec<ToolSpec>,
}

pub struct McpServer {
    name: String,
    config: ServerConfig,
    timing: Timing,
    session: Mutex<Option<Session>>,
    /// Held while connecting, so concurrent callers wait for one connect (at most its deadline)
    /// rather than each opening a session; never held with `session`.
    connecting: Mutex<()>,
    listener: Listener,
    listing: Mutex<Option<Listing>>,
}

/// How a call failed: the server answered with an error, or the session is unusable.
enum CallError {
    Tool(ToolError),
    Session(String),
}

impl McpServer {
    /// `changed` is woken when the server's tools may have changed.
    pub fn new(name: String, config: ServerConfig, timing: Timing, changed: Arc<Notify>) -> Self {
        Self {
            name,
            config,
            timing,
            session: Mutex::new(None),
            connecting: Mutex::new(()),
            listener: Listener {
                tools_changed: Arc::default(),
                wake: changed,
            },
            listing: Mutex::new(None),
        }
    }

    async fn connect(&self) -> Result<Session, ToolError> {
        let deadline = self.timing.connect;
        match tokio::time::timeout(deadline, self.open()).await {
            Ok(session) => session,
            Err(_) => Err(ToolError::unavailable(format!(
                "connecting to MCP server {:?}: no session within {} s",
                self.name,
                deadline.as_secs_f64()
            ))),
        }
    }

    async fn open(&self) -> Result<Session, ToolError> {
        let what = |e: &dyn std::fmt::Display| {
            ToolError::unavailable(format!("connecting to MCP server {:?}: {e}", self.name))
        };
        let listener = self.listener.clone();
        if let Some(command) = &self.config.command {
            let mut cmd = tokio::process::Command::new(command);
            // A clean environment: nothing of the gateway's (its token, exporter headers) but
            // what a program needs to run, and the server's own `env`.
            cmd.env_clear();
            for key in ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ"] {
                if let Some(value) = std::env::var_os(key) {
                    cmd.env(key, value);
                }
            }
            cmd.args(&self.config.args).envs(&self.config.env);
            // The server's stderr is its log; keep it out of the gateway's stdout.
            cmd.stderr(std::process::Stdio::inherit());
            let transport = TokioChildProcess::new(cmd).map_err(|e| what(&e))?;
            listener.serve(transport).await.map_err(|e| what(&e))
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
            listener.serve(transport).await.map_err(|e| what(&e))
        }
    }

    /// The live session's peer, if there is one.
    async fn live_peer(&self) -> Option<Peer<RoleClient>> {
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_some_and(|s| s.is_closed()) {
            guard.take();
        }
        guard.as_ref().map(|s| s.peer().clone())
    }

    /// A handle on a live session, opening one if there is none (or the last one closed).
    async fn peer(&self) -> Result<Peer<RoleClient>, ToolError> {
        if let Some(peer) = self.live_peer().await {
            return Ok(peer);
        }
        let _connecting = self.connecting.lock().await;
        // Someone else may have connected while this caller waited.
        if let Some(peer) = self.live_peer().await {
            return Ok(peer);
        }
        let session = self.connect().await?;
        let peer = session.peer().clone();
        self.listen_for_tool_changes(&peer);
        *self.session.lock().await = Some(session);
        // A new session may see other tools.
        self.listing.lock().await.take();
        self.listener.wake.notify_one();
        Ok(peer)
    }

    /// On connections of protocol 2026-07-28 and later a server sends `tools/list_changed` only
    /// on a `subscriptions/listen` stream that asked for it: ask, and hear it there for as long
    /// as the session lives. Servers on earlier versions refuse, and send it unasked (heard by
    /// [`Listener`]).
    fn listen_for_tool_changes(&self, peer: &Peer<RoleClient>) {
        let (peer, listener, deadline) = (peer.clone(), self.listener.clone(), self.timing.call);
        let name = self.name.clone();
        tokio::spawn(async move {
            let filter = SubscriptionFilter::builder().tools_list_changed().build();
            let mut subscription = match tokio::time::timeout(deadline, peer.listen(filter)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(server = %name, "no subscriptions/listen ({e}); relying on unasked notifications");
                    return;
                }
                Err(_) => return,
            };
            while let Ok(Some(notification)) = subscription.next().await {
                if matches!(
                    notification,
                    ServerNotification::ToolListChangedNotification(_)
                ) {
                    listener.tools_changed();
                }
            }
        });
    }

    /// Runs `f` on a live session; when the session itself fails, opens a new one and tries once
    /// more.
    async fn with_session<T, F, Fut>(&self, f: F) -> Result<T, ToolError>
    where
        F: Fn(Peer<RoleClient>) -> Fut,
        Fut: Future<Output = Result<T, CallError>>,
    {
        for attempt in 0..2 {
            match f(self.peer().await?).await {
                Ok(v) => return Ok(v),
                Err(CallError::Tool(error)) => return Err(error),
                Err(CallError::Session(message)) => {
                    tracing::warn!(server = %self.name, "MCP session failed ({message}); reconnecting");
                    if let Some(dead) = self.session.lock().await.take() {
                        let _ = dead.cancel().await;
                    }
                    if attempt == 1 {
                        return Err(ToolError::unavailable(format!(
                            "MCP server {:?}: {message}",
                            self.name
                        )));
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }

    /// The server's tools: the kept listing while it is fresh and unchanged, else a new one.
    pub async fn tools(&self) -> Result<Vec<ToolSpec>, ToolError> {
        let generation = self.listener.tools_changed.load(Ordering::Relaxed);
        if let Some(listing) = self.listing.lock().await.as_ref()
            && listing.generation == generation
            && listing.at.elapsed() < self.timing.tools_ttl
        {
            return Ok(listing.tools.clone());
        }
        let deadline = self.timing.call;
        let tools: Vec<ToolSpec> = self
            .with_session(|peer| async move {
                match tokio::time::timeout(deadline, peer.list_all_tools()).await {
                    Ok(listed) => listed.map_err(|e| CallError::Session(e.to_string())),
                    Err(_) => Err(CallError::Tool(ToolError::new(
                        ToolErrorCode::DeadlineExceeded,
                        format!(
                            "listing tools: no answer within {} s",
                            deadline.as_secs_f64()
                        ),
                    ))),
                }
            })
            .await?
            .into_iter()
            .map(|t| ToolSpec {
                title: t
                    .title
                    .clone()
                    .or_else(|| t.annotations.as_ref().and_then(|a| a.title.clone()))
                    .unwrap_or_default(),
                output_schema: t
                    .output_schema
                    .as_ref()
                    .map(|s| Value::Object((**s).clone())),
                annotations: t.annotations.clone(),
                name: t.name.to_string(),
                description: t.description.map(|d| d.to_string()).unwrap_or_default(),
                input_schema: Value::Object((*t.input_schema).clone()),
            })
            .collect();
        *self.listing.lock().await = Some(Listing {
            at: Instant::now(),
            generation,
            tools: tools.clone(),
        });
        Ok(tools)
    }

    /// Whether the last listing, however old, has `tool`; never lists.
    pub async fn listed(&self, tool: &str) -> bool {
        let listing = self.listing.lock().await;
        listing
            .as_ref()
            .is_some_and(|l| l.tools.iter().any(|t| t.name == tool))
    }

    /// Calls `tool` with `arguments`, carrying `trace` (`traceparent`, `tracestate`, `baggage`)
    /// in `params._meta`.
    pub async fn call(
        &self,
        tool: &str,
        arguments: &Value,
        trace: &HashMap<String, String>,
    ) -> Result<Value, ToolError> {
        let Value::Object(arguments) = arguments else {
            return Err(ToolError::invalid_argument(format!(
                "{}.{tool}: arguments must be a JSON object",
                self.name
            )));
        };
        let mut meta = MetaObject::new();
        for (key, value) in trace {
            meta.0.insert(key.clone(), Value::String(value.clone()));
        }
        let mut params =
            CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments.clone());
        params.meta = Some(RequestMetaObject(meta));
        let deadline = self.timing.call;
        let result = self
            .with_session(|peer| {
                let params = params.clone();
                async move {
                    match tokio::time::timeout(deadline, peer.call_tool(params)).await {
                        Ok(called) => called.map_err(|e| match e {
                            rmcp::ServiceError::McpError(e) => {
                                CallError::Tool(ToolError::new(code_of(&e.code), e.message))
                            }
                            other => CallError::Session(other.to_string()),
                        }),
                        // Not retried: the tool may still be working on it.
                        Err(_) => Err(CallError::Tool(ToolError::new(
                            ToolErrorCode::DeadlineExceeded,
                            format!(
                                "no answer within {} s (the server's call timeout)",
                                deadline.as_secs_f64()
                            ),
                        ))),
                    }
                }
            })
            .await?;
        result_value(&self.name, tool, result)
    }
}

/// A JSON-RPC error from the server as a tool error code: the two a caller can act on keep
/// their meaning; any other is the tool's own failure.
fn code_of(code: &rmcp::model::ErrorCode) -> ToolErrorCode {
    match *code {
        rmcp::model::ErrorCode::INVALID_PARAMS => ToolErrorCode::InvalidArgument,
        rmcp::model::ErrorCode::METHOD_NOT_FOUND => ToolErrorCode::NotFound,
        _ => ToolErrorCode::Unknown,
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
fn result_value(server: &str, tool: &str, result: CallToolResult) -> Result<Value, ToolError> {
    if result.is_error == Some(true) {
        return Err(ToolError::new(
            ToolErrorCode::Unknown,
            format!("{server}.{tool} failed: {}", text_of(&result)),
        ));
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
