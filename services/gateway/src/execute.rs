//! The gateway's operations, shared by its MCP and gRPC front ends: run code or a script in the
//! sandbox, call one tool (search is `search::ToolSearch`). Spans and metrics are recorded here,
//! never the code text or argument values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram};
use serde_json::{Value, json};

use crate::config::GatewayConfig;
use crate::sandbox::{Outcome, Rejected, Sandbox, Source};
use crate::search::ToolSearch;
use crate::upstream::record::CallLog;
use crate::upstream::{Progress, RunTools, Upstreams};

/// The largest script `execute_mcp_script` runs (as the largest code a gRPC call carries).
pub const MAX_SCRIPT_BYTES: u64 = 4 << 20;

/// The reply to `execute_mcp_code` / `execute_mcp_script`.
#[derive(Debug, Clone)]
pub struct ExecuteReply {
    /// RESULT as JSON (`null` when unset or on failure).
    pub result: Value,
    pub stdout: String,
    pub stderr: String,
    /// -1 when the process was killed or never started.
    pub returncode: i32,
    /// Empty on success; else why it failed (`timeout`, `result too large`, the exception...).
    pub error: String,
    /// `ok`, `error` or `timeout`.
    pub status: &'static str,
    /// How long the sandboxed run took.
    pub duration_seconds: f64,
    /// With `gateway.record_tool_calls`: the run's tool calls (see `upstream::record`).
    pub tool_calls: Option<Vec<Value>>,
    /// Calls past the log's bound, not in `tool_calls`.
    pub tool_calls_dropped: u64,
}

impl ExecuteReply {
    pub fn to_json(&self) -> Value {
        let mut reply = json!({
            "result": self.result,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "returncode": self.returncode,
            "duration_seconds": self.duration_seconds,
            "status": self.status,
            "error": if self.error.is_empty() { Value::Null } else { Value::String(self.error.clone()) },
        });
        if let Some(calls) = &self.tool_calls {
            reply["tool_calls"] = json!(calls);
            if self.tool_calls_dropped > 0 {
                reply["tool_calls_dropped"] = json!(self.tool_calls_dropped);
            }
        }
        reply
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    #[error("execute_mcp_script needs gateway.workspace_root in the config")]
    NoRoot,
    #[error("script {0:?} is not a file inside the workspace root")]
    Outside(String),
    #[error(
        "script {path:?} is {bytes} bytes; a script may have at most {MAX_SCRIPT_BYTES} (split it, \
         or import the rest as a module from the workspace)"
    )]
    ScriptTooLarge { path: String, bytes: u64 },
    #[error("script {path:?} cannot be read as UTF-8 text: {message}")]
    Unreadable { path: String, message: String },
    /// The sandbox is at capacity (or could not start a process).
    #[error(transparent)]
    Rejected(#[from] Rejected),
}

impl ExecuteError {
    /// The gRPC status a caller gets.
    pub fn status(&self) -> tonic::Status {
        match self {
            ExecuteError::NoRoot
            | ExecuteError::Outside(_)
            | ExecuteError::ScriptTooLarge { .. }
            | ExecuteError::Unreadable { .. } => tonic::Status::invalid_argument(self.to_string()),
            ExecuteError::Rejected(Rejected::Spawn(_)) => tonic::Status::internal(self.to_string()),
            ExecuteError::Rejected(_) => tonic::Status::resource_exhausted(self.to_string()),
        }
    }
}

pub struct Gateway {
    pub upstreams: Arc<Upstreams>,
    pub search: ToolSearch,
    pub sandbox: Sandbox,
    workspace_root: Option<PathBuf>,
    /// `None`: tool calls are not recorded; `Some(payloads)`: recorded, with payloads or not.
    record_tool_calls: Option<bool>,
    requests: Counter<u64>,
    request_duration: Histogram<f64>,
    sandbox_duration: Histogram<f64>,
}

impl Gateway {
    pub fn new(
        upstreams: Arc<Upstreams>,
        search: ToolSearch,
        sandbox: Sandbox,
        config: &GatewayConfig,
    ) -> std::io::Result<Self> {
        let workspace_root = config
            .workspace_root
            .as_ref()
            .map(|r| r.canonicalize())
            .transpose()?;
        Ok(Self {
            upstreams,
            search,
            sandbox,
            workspace_root,
            record_tool_calls: config
                .record_tool_calls
                .then_some(config.record_tool_call_payloads),
            requests: defs::GATEWAY_REQUESTS.u64_counter(),
            request_duration: defs::GATEWAY_REQUEST_DURATION.f64_histogram(),
            sandbox_duration: defs::GATEWAY_SANDBOX_DURATION.f64_histogram(),
        })
    }

    /// `script_path` resolved (symlinks too) and checked to be a file under the workspace root.
    /// Whether `execute_mcp_script` can run anything (a workspace root is configured).
    pub fn runs_scripts(&self) -> bool {
        self.workspace_root.is_some()
    }

    /// Opens `script_path` once and reads it (at most [`MAX_SCRIPT_BYTES`]). What counts is the
    /// file actually opened, as the kernel names it: a regular file inside the workspace root.
    /// A path checked first and read later could be swapped for a link in between.
    pub fn read_script(&self, script_path: &str) -> Result<(PathBuf, String), ExecuteError> {
        use std::io::Read as _;
        use std::os::fd::AsRawFd as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let root = self.workspace_root.as_ref().ok_or(ExecuteError::NoRoot)?;
        let candidate = if Path::new(script_path).is_absolute() {
            PathBuf::from(script_path)
        } else {
            root.join(script_path)
        };
        let outside = || ExecuteError::Outside(script_path.to_owned());
        // Non-blocking, so a FIFO planted in the root cannot hold the call at open().
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&candidate)
            .map_err(|_| outside())?;
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|_| outside())?;
        let metadata = file.metadata().map_err(|_| outside())?;
        if !opened.starts_with(root) || !metadata.is_file() {
            return Err(outside());
        }
        if metadata.len() > MAX_SCRIPT_BYTES {
            return Err(ExecuteError::ScriptTooLarge {
                path: script_path.to_owned(),
                bytes: metadata.len(),
            });
        }
        let mut text = String::new();
        file.take(MAX_SCRIPT_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| ExecuteError::Unreadable {
                path: script_path.to_owned(),
                message: e.to_string(),
            })?;
        Ok((opened, text))
    }

    /// Runs `code`; with `progress`, text the `nomad` tools make is offered there as it comes.
    pub async fn execute_code(
        &self,
        code: String,
        env: BTreeMap<String, String>,
        cx: &Context,
        progress: Option<Progress>,
    ) -> Result<ExecuteReply, ExecuteError> {
        let size = code.len();
        self.execute(
            "execute_mcp_code",
            Source::Code(code),
            size,
            env,
            cx,
            progress,
        )
        .await
    }

    pub async fn execute_script(
        &self,
        script_path: &str,
        env: BTreeMap<String, String>,
        cx: &Context,
        progress: Option<Progress>,
    ) -> Result<ExecuteReply, ExecuteError> {
        let (path, text) = match self.read_script(script_path) {
            Ok(read) => read,
            Err(e) => {
                let kind = [KeyValue::new("request.kind", "execute_mcp_script")];
                self.requests.add(1, &kind);
                self.request_duration
                    .record(0.0, &[kind[0].clone(), KeyValue::new("status", "error")]);
                return Err(e);
            }
        };
        let size = text.len();
        self.execute(
            "execute_mcp_script",
            Source::Script { path, text },
            size,
            env,
            cx,
            progress,
        )
        .await
    }

    async fn execute(
        &self,
        kind: &'static str,
        source: Source,
        code_size: usize,
        env: BTreeMap<String, String>,
        cx: &Context,
        progress: Option<Progress>,
    ) -> Result<ExecuteReply, ExecuteError> {
        let started = Instant::now();
        self.requests.add(1, &[KeyValue::new("request.kind", kind)]);
        let timeout = self.sandbox.config().timeout_seconds;
        let span = GroupSpan::start(SpanGroup::Gateway, format!("nomad.gateway.{kind}"), cx);
        span.set_attributes([
            KeyValue::new("nomad.gateway.request_id", uuid::Uuid::new_v4().to_string()),
            KeyValue::new("nomad.gateway.code_size", code_size as i64),
            KeyValue::new("nomad.gateway.timeout_seconds", timeout),
        ]);
        let run_span = GroupSpan::start(
            SpanGroup::Sandbox,
            "nomad.gateway.sandbox.run",
            span.context(),
        );
        run_span.set_attribute(KeyValue::new("nomad.gateway.timeout_seconds", timeout));
        // The sandbox's own calls, and its environment, carry the run's context.
        let run_cx = run_span.context().clone();
        let trace: Vec<(String, String)> = nomad_telemetry::propagation::inject_map(&run_cx)
            .into_iter()
            .collect();
        let log = self.record_tool_calls.map(CallLog::new);
        let tools = RunTools {
            upstreams: &self.upstreams,
            cx: run_cx,
            log: log.as_ref(),
            progress,
        };
        let ran = self
            .sandbox
            .run(source, &env, run_span.context(), &trace, &tools)
            .await;
        drop(tools);
        let outcome = match ran {
            Ok(outcome) => outcome,
            Err(rejected) => {
                for s in [&run_span, &span] {
                    s.set_attribute(KeyValue::new("nomad.gateway.status", "rejected"));
                    s.set_error("rejected", rejected.to_string());
                }
                self.request_duration.record(
                    started.elapsed().as_secs_f64(),
                    &[
                        KeyValue::new("request.kind", kind),
                        KeyValue::new("status", "rejected"),
                    ],
                );
                return Err(rejected.into());
            }
        };
        let mut reply = reply_of(&outcome);
        if let Some(log) = log {
            let (calls, dropped) = log.finish();
            reply.tool_calls = Some(calls);
            reply.tool_calls_dropped = dropped;
        }
        let returncode = i64::from(reply.returncode);
        for s in [&run_span, &span] {
            s.set_attributes([
                KeyValue::new("nomad.gateway.returncode", returncode),
                KeyValue::new(
                    "nomad.gateway.tool_call_count",
                    i64::from(outcome.tool_calls),
                ),
                KeyValue::new("nomad.gateway.status", reply.status),
                KeyValue::new(
                    "nomad.gateway.sandbox.start",
                    if outcome.warm { "warm" } else { "cold" },
                ),
                KeyValue::new(
                    "nomad.gateway.sandbox.queue_wait_seconds",
                    outcome.queue_wait.as_secs_f64(),
                ),
            ]);
            match &outcome.failure {
                Some(f) => s.set_error(f.kind(), first_line(&reply.error)),
                None => s.set_ok(),
            }
        }
        drop(run_span);
        self.sandbox_duration.record(
            outcome.duration.as_secs_f64(),
            &[
                KeyValue::new("request.kind", kind),
                KeyValue::new("status", reply.status),
                KeyValue::new("returncode", returncode),
            ],
        );
        self.request_duration.record(
            started.elapsed().as_secs_f64(),
            &[
                KeyValue::new("request.kind", kind),
                KeyValue::new("status", reply.status),
                KeyValue::new("returncode", returncode),
            ],
        );
        Ok(reply)
    }

    /// One upstream call on behalf of a gRPC caller (`request.kind` `call_tool`).
    pub async fn call_tool(
        &self,
        cx: &Context,
        server: &str,
        tool: &str,
        arguments: &Value,
    ) -> Result<Value, crate::tool_error::ToolError> {
        let started = Instant::now();
        let kind = KeyValue::new("request.kind", "call_tool");
        self.requests.add(1, std::slice::from_ref(&kind));
        let result = self.upstreams.call(cx, server, tool, arguments, None).await;
        let status = if result.is_ok() { "ok" } else { "error" };
        self.request_duration.record(
            started.elapsed().as_secs_f64(),
            &[kind, KeyValue::new("status", status)],
        );
        result
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}

fn reply_of(outcome: &Outcome) -> ExecuteReply {
    let (status, error) = match &outcome.failure {
        None => ("ok", String::new()),
        Some(f @ crate::sandbox::Failure::Timeout { .. }) => ("timeout", f.describe()),
        Some(f) => ("error", f.describe()),
    };
    ExecuteReply {
        result: outcome.result.clone().unwrap_or(Value::Null),
        stdout: outcome.stdout.clone(),
        stderr: outcome.stderr.clone(),
        returncode: outcome.returncode.unwrap_or(-1),
        error,
        status,
        duration_seconds: outcome.duration.as_secs_f64(),
        tool_calls: None,
        tool_calls_dropped: 0,
    }
}
