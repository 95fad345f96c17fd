//! The gateway's operations, shared by its MCP and gRPC front ends: run code or a script in the
//! sandbox, call one tool (search is `search::ToolSearch`). Their spans and metrics are the
//! `recorder`'s, which never sees the code text or argument values.

mod recorder;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nomad_telemetry::Context;
use serde_json::{Value, json};

pub use self::recorder::RunStatus;
use self::recorder::{Instruments, RequestKind};

use crate::config::GatewayConfig;
use crate::sandbox::{Outcome, Rejected, Sandbox, Source};
use crate::search::ToolSearch;
use crate::upstream::record::{Recording, ToolCall};
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
    /// `Ok`, `Error` or `Timeout` (a rejected run has no reply).
    pub status: RunStatus,
    /// How long the sandboxed run took.
    pub duration_seconds: f64,
    /// With `gateway.record_tool_calls`: the run's tool calls (see `upstream::record`).
    pub tool_calls: Option<Vec<ToolCall>>,
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
            "status": self.status.as_str(),
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
    recording: Recording,
    instruments: Instruments,
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
            recording: Recording::new(config.record_tool_calls, config.record_tool_call_payloads),
            instruments: Instruments::new(),
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
            RequestKind::ExecuteMcpCode,
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
        let kind = RequestKind::ExecuteMcpScript;
        let (path, text) = self
            .read_script(script_path)
            .inspect_err(|_| self.instruments.refused(kind))?;
        let size = text.len();
        self.execute(kind, Source::Script { path, text }, size, env, cx, progress)
            .await
    }

    async fn execute(
        &self,
        kind: RequestKind,
        source: Source,
        code_size: usize,
        env: BTreeMap<String, String>,
        cx: &Context,
        progress: Option<Progress>,
    ) -> Result<ExecuteReply, ExecuteError> {
        let timeout = self.sandbox.config().timeout_seconds;
        let recorder = self.instruments.start_run(kind, code_size, timeout, cx);
        // The sandbox's own calls, and its environment, carry the run's context.
        let run_cx = recorder.run_context().clone();
        let trace: Vec<(String, String)> = nomad_telemetry::propagation::inject_map(&run_cx)
            .into_iter()
            .collect();
        let log = self.recording.log();
        let tools = RunTools {
            upstreams: &self.upstreams,
            cx: run_cx,
            log: log.as_ref(),
            progress,
        };
        let ran = self
            .sandbox
            .run(source, &env, recorder.run_context(), &trace, &tools)
            .await;
        drop(tools);
        let outcome = match ran {
            Ok(outcome) => outcome,
            Err(rejected) => {
                recorder.rejected(&rejected);
                return Err(rejected.into());
            }
        };
        let mut reply = reply_of(&outcome);
        if let Some(log) = log {
            let (calls, dropped) = log.finish();
            reply.tool_calls = Some(calls);
            reply.tool_calls_dropped = dropped;
        }
        recorder.finished(&outcome, &reply);
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
        let recorder = self.instruments.start_call();
        let result = self.upstreams.call(cx, server, tool, arguments, None).await;
        recorder.finished(result.is_ok());
        result
    }
}

fn reply_of(outcome: &Outcome) -> ExecuteReply {
    let (status, error) = match &outcome.failure {
        None => (RunStatus::Ok, String::new()),
        Some(f @ crate::sandbox::Failure::Timeout { .. }) => (RunStatus::Timeout, f.describe()),
        Some(f) => (RunStatus::Error, f.describe()),
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
