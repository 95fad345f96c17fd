//! The gateway's operations, shared by its MCP and gRPC front ends: search the upstream tools,
//! run code or a script in the sandbox, call one tool. Spans and metrics are recorded here,
//! never the code text or argument values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram};
use serde_json::{Value, json};

use crate::sandbox::{Outcome, Rejected, Sandbox, Source};
use crate::schema;
use crate::upstream::{RunTools, Upstreams};

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
}

impl ExecuteReply {
    pub fn to_json(&self) -> Value {
        json!({
            "result": self.result,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "returncode": self.returncode,
            "error": if self.error.is_empty() { Value::Null } else { Value::String(self.error.clone()) },
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    #[error("execute_mcp_script needs gateway.workspace_root in the config")]
    NoRoot,
    #[error("script {0:?} is not a file inside the workspace root")]
    Outside(String),
    /// The sandbox is at capacity (or could not start a process).
    #[error(transparent)]
    Rejected(#[from] Rejected),
}

impl ExecuteError {
    /// The gRPC status a caller gets.
    pub fn status(&self) -> tonic::Status {
        match self {
            ExecuteError::NoRoot | ExecuteError::Outside(_) => {
                tonic::Status::invalid_argument(self.to_string())
            }
            ExecuteError::Rejected(Rejected::Spawn(_)) => tonic::Status::internal(self.to_string()),
            ExecuteError::Rejected(_) => tonic::Status::resource_exhausted(self.to_string()),
        }
    }
}

pub struct Gateway {
    pub upstreams: Upstreams,
    pub sandbox: Sandbox,
    workspace_root: Option<PathBuf>,
    requests: Counter<u64>,
    request_duration: Histogram<f64>,
    sandbox_duration: Histogram<f64>,
}

impl Gateway {
    pub fn new(
        upstreams: Upstreams,
        sandbox: Sandbox,
        workspace_root: Option<PathBuf>,
    ) -> std::io::Result<Self> {
        let workspace_root = workspace_root.map(|r| r.canonicalize()).transpose()?;
        Ok(Self {
            upstreams,
            sandbox,
            workspace_root,
            requests: defs::GATEWAY_REQUESTS.u64_counter(),
            request_duration: defs::GATEWAY_REQUEST_DURATION.f64_histogram(),
            sandbox_duration: defs::GATEWAY_SANDBOX_DURATION.f64_histogram(),
        })
    }

    /// `script_path` resolved (symlinks too) and checked to be a file under the workspace root.
    pub fn resolve_script(&self, script_path: &str) -> Result<PathBuf, ExecuteError> {
        let root = self.workspace_root.as_ref().ok_or(ExecuteError::NoRoot)?;
        let candidate = if Path::new(script_path).is_absolute() {
            PathBuf::from(script_path)
        } else {
            root.join(script_path)
        };
        match candidate.canonicalize() {
            Ok(p) if p.starts_with(root) && p.is_file() => Ok(p),
            _ => Err(ExecuteError::Outside(script_path.to_owned())),
        }
    }

    pub async fn execute_code(
        &self,
        code: String,
        env: BTreeMap<String, String>,
        cx: &Context,
    ) -> Result<ExecuteReply, ExecuteError> {
        let size = code.len();
        self.execute("execute_mcp_code", Source::Code(code), size, env, cx)
            .await
    }

    pub async fn execute_script(
        &self,
        script_path: &str,
        env: BTreeMap<String, String>,
        cx: &Context,
    ) -> Result<ExecuteReply, ExecuteError> {
        let path = self.resolve_script(script_path);
        let path = match path {
            Ok(p) => p,
            Err(e) => {
                let kind = [KeyValue::new("request.kind", "execute_mcp_script")];
                self.requests.add(1, &kind);
                self.request_duration
                    .record(0.0, &[kind[0].clone(), KeyValue::new("status", "error")]);
                return Err(e);
            }
        };
        let size = std::fs::metadata(&path).map_or(0, |m| m.len() as usize);
        self.execute("execute_mcp_script", Source::Script(path), size, env, cx)
            .await
    }

    async fn execute(
        &self,
        kind: &'static str,
        source: Source,
        code_size: usize,
        env: BTreeMap<String, String>,
        cx: &Context,
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
        let tools = RunTools {
            upstreams: &self.upstreams,
            cx: run_cx,
        };
        let outcome = match self.sandbox.run(source, &env, &trace, &tools).await {
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
        let reply = reply_of(&outcome);
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

    /// Tools matching `query` (every word, case-insensitive, in name or description), best
    /// first: name matches before description matches.
    pub async fn search(
        &self,
        query: &str,
        server_filter: &str,
        full: bool,
        limit: usize,
    ) -> Result<Vec<Value>, String> {
        let words: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
        let servers: Vec<String> = self
            .upstreams
            .server_names()
            .into_iter()
            .filter(|s| server_filter.is_empty() || s == server_filter)
            .collect();
        if servers.is_empty() {
            return Err(format!(
                "unknown server {server_filter:?}; configured: {}",
                self.upstreams.server_names().join(", ")
            ));
        }
        let mut found = Vec::new();
        for server in servers {
            let tools = match self.upstreams.tools(&server).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(%server, "listing tools failed: {e}");
                    continue;
                }
            };
            for tool in tools {
                let name = tool.name.to_lowercase();
                let text = format!("{name} {}", tool.description.to_lowercase());
                if !words.iter().all(|w| text.contains(w.as_str())) {
                    continue;
                }
                let rank = usize::from(!words.iter().all(|w| name.contains(w.as_str())));
                let signature = schema::python_signature(&tool.name, &tool.input_schema);
                let import = format!(
                    "from mcp_tools.{} import {}",
                    schema::identifier(&server),
                    schema::identifier(&tool.name)
                );
                let mut entry = json!({
                    "server": server,
                    "name": tool.name,
                    "description": if full { tool.description.clone() } else { first_line(&tool.description).to_owned() },
                    "signature": signature,
                    "import": import,
                });
                if full {
                    entry["input_schema"] = tool.input_schema.clone();
                    entry["async"] = json!(format!(
                        "await {}_async(...)",
                        schema::identifier(&tool.name)
                    ));
                }
                found.push((rank, entry));
            }
        }
        found.sort_by_key(|(rank, _)| *rank);
        Ok(found
            .into_iter()
            .take(limit.max(1))
            .map(|(_, e)| e)
            .collect())
    }

    /// One upstream call on behalf of a gRPC caller (`request.kind` `call_tool`).
    pub async fn call_tool(
        &self,
        cx: &Context,
        server: &str,
        tool: &str,
        arguments: &Value,
    ) -> Result<Value, tonic::Status> {
        let started = Instant::now();
        let kind = KeyValue::new("request.kind", "call_tool");
        self.requests.add(1, std::slice::from_ref(&kind));
        let result = self.upstreams.call(cx, server, tool, arguments).await;
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
    }
}
