//! Every tool the gateway can reach: the built-in `nomad` server and the configured MCP
//! servers, behind one call path that applies the allowlist, records the call (`recorder`: the
//! `upstream` span, metrics and a log line) and carries the caller's trace context.

pub mod mcp;
pub mod nomad;
pub mod nomad_json;
pub mod policy;
pub mod record;
mod recorder;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use nomad_telemetry::Context;
use opentelemetry::trace::FutureExt as _;
use serde_json::Value;
use tokio::sync::Notify;

use self::policy::Policy;
use self::recorder::Instruments;
use crate::sandbox::{ToolHost, ToolSpec};
use crate::tool_error::{ToolError, ToolErrorCode};

pub struct Upstreams {
    nomad: nomad::Nomad,
    servers: BTreeMap<String, mcp::McpServer>,
    policy: Policy,
    /// Woken when a server's tools may have changed (a new session, a list_changed notice).
    changed: Arc<Notify>,
    instruments: Instruments,
}

impl Upstreams {
    pub fn new(
        nomad: nomad::Nomad,
        servers: BTreeMap<String, mcp::McpServer>,
        policy: Policy,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            nomad,
            servers,
            policy,
            changed,
            instruments: Instruments::new(),
        }
    }

    pub fn server_names(&self) -> Vec<String> {
        std::iter::once(nomad::NAME.to_owned())
            .chain(self.servers.keys().cloned())
            .collect()
    }

    /// `server`'s tools that the allowlist lets through.
    pub async fn tools(&self, server: &str) -> Result<Vec<ToolSpec>, ToolError> {
        let tools = if server == nomad::NAME {
            self.nomad.tools().await
        } else {
            match self.servers.get(server) {
                Some(s) => s.tools().await,
                None => return Err(ToolError::not_found(self.unknown_server(server))),
            }
        }?;
        Ok(tools
            .into_iter()
            .filter(|t| self.policy.allows(server, &t.name))
            .collect())
    }

    /// The scheduler's tools and their kinds (the allowlist applied), for the OpenAI routes.
    pub async fn model_kinds(&self) -> Result<Vec<(String, String)>, ToolError> {
        Ok(self
            .nomad
            .kinds()
            .await?
            .into_iter()
            .filter(|(name, _)| self.policy.allows(nomad::NAME, name))
            .collect())
    }

    /// The queue bound (`max_pending`) of the fleet's model `name`, if it has one.
    pub async fn model_max_pending(&self, name: &str) -> Result<Option<u32>, ToolError> {
        self.nomad.max_pending(name).await
    }

    /// Woken when a server's tools may have changed.
    pub fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// The gateway's own call (search's embeddings): no allowlist, span or call metrics, which
    /// are for what sandboxed code calls.
    pub async fn call_unrecorded(
        &self,
        server: &str,
        tool: &str,
        arguments: &Value,
    ) -> Result<Value, ToolError> {
        if server == nomad::NAME {
            return self.nomad.call(tool, arguments, None).await;
        }
        match self.servers.get(server) {
            Some(upstream) => upstream.call(tool, arguments, &HashMap::new()).await,
            None => Err(ToolError::not_found(self.unknown_server(server))),
        }
    }

    /// Why `server.tool` is not among the tools [`Self::tools`] lists: not allowed, a model that
    /// failed to load (named), or no such tool (the ones there are named).
    pub async fn missing(&self, server: &str, tool: &str) -> ToolError {
        if !self.server_names().iter().any(|s| s == server) {
            return ToolError::not_found(self.unknown_server(server));
        }
        if !self.policy.allows(server, tool) {
            return ToolError::new(
                ToolErrorCode::PermissionDenied,
                format!("{server}:{tool} is not in the gateway's allowlist"),
            );
        }
        if server == nomad::NAME {
            match self.nomad.failed(tool).await {
                Ok(Some(why)) => return nomad::cannot_serve(tool, &why),
                Ok(None) => {}
                Err(e) => return e,
            }
        }
        match self.tools(server).await {
            Ok(tools) => {
                let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
                ToolError::not_found(format!(
                    "{server} has no tool {tool:?}; its tools: {}",
                    names.join(", ")
                ))
            }
            Err(e) => e,
        }
    }

    fn unknown_server(&self, server: &str) -> String {
        format!(
            "unknown upstream server {server:?}; configured: {}",
            self.server_names().join(", ")
        )
    }

    /// The names to record for a call: the server and tool as given when they exist (the
    /// tool in the server's last listing; this never lists), else `unknown`, so names
    /// sandboxed code makes up never become attribute values.
    async fn labels(&self, server: &str, tool: &str) -> (String, String) {
        const UNKNOWN: &str = "unknown";
        if !self.server_names().iter().any(|s| s == server) {
            return (UNKNOWN.into(), UNKNOWN.into());
        }
        let listed = if server == nomad::NAME {
            self.nomad.listed(tool).await
        } else {
            match self.servers.get(server) {
                Some(s) => s.listed(tool).await,
                None => false,
            }
        };
        let known = listed && self.policy.allows(server, tool);
        let tool = if known { tool } else { UNKNOWN };
        (server.to_owned(), tool.to_owned())
    }

    /// Calls `server.tool` in context `cx`, recording the span and metrics. With `progress`,
    /// text a `nomad` tool makes is offered there as it comes (see [`nomad::Nomad::call`]).
    pub async fn call(
        &self,
        cx: &Context,
        server: &str,
        tool: &str,
        arguments: &Value,
        progress: Option<&Progress>,
    ) -> Result<Value, ToolError> {
        let (server_label, tool_label) = self.labels(server, tool).await;
        let recorder = self.instruments.start(server_label, tool_label, cx);
        let span_cx = recorder.context();
        let result = async {
            if !self.policy.allows(server, tool) {
                return Err(ToolError::new(
                    ToolErrorCode::PermissionDenied,
                    format!("{server}:{tool} is not in the gateway's allowlist"),
                ));
            }
            if server == nomad::NAME {
                return self.nomad.call(tool, arguments, progress).await;
            }
            let Some(upstream) = self.servers.get(server) else {
                return Err(ToolError::not_found(self.unknown_server(server)));
            };
            let trace = nomad_telemetry::propagation::inject_map(span_cx);
            upstream.call(tool, arguments, &trace).await
        }
        .with_context(span_cx.clone())
        .await;
        recorder.finished(server, tool, arguments, &result);
        result
    }
}

/// Where a run's streamed tool text goes as it is made (the MCP caller's progress
/// notifications); bounded, and text that does not fit is not offered.
pub type Progress = tokio::sync::mpsc::Sender<String>;

/// The tool host one sandboxed run sees: every call runs in that run's context, is logged for
/// the caller when it asked, and streams its text to the caller's progress when it asked.
pub struct RunTools<'a> {
    pub upstreams: &'a Upstreams,
    pub cx: Context,
    pub log: Option<&'a record::CallLog>,
    pub progress: Option<Progress>,
}

impl ToolHost for RunTools<'_> {
    fn servers(&self) -> Vec<String> {
        self.upstreams.server_names()
    }

    async fn tools(&self, server: &str) -> Result<Vec<ToolSpec>, ToolError> {
        self.upstreams.tools(server).await
    }

    async fn missing(&self, server: &str, tool: &str) -> ToolError {
        self.upstreams.missing(server, tool).await
    }

    async fn call(&self, server: &str, tool: &str, arguments: Value) -> Result<Value, ToolError> {
        let started = Instant::now();
        let result = self
            .upstreams
            .call(&self.cx, server, tool, &arguments, self.progress.as_ref())
            .await;
        if let Some(log) = self.log {
            log.record(server, tool, started, &arguments, &result, |v| {
                self.upstreams.policy.redact(v)
            });
        }
        result
    }
}
