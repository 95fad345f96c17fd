//! Runs model-written Python in an isolated subprocess. The code reaches upstream tools only
//! through the bridge (see `bridge`), which the gateway serves with a [`ToolHost`].

pub mod bridge;
pub mod isolation;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use self::bridge::{Decoder, Response};
use self::isolation::{ChildSetup, Limits, Ruleset};

const RUNNER: &str = include_str!("runner.py");
/// Concurrent tool calls one run may have in flight; more wait.
const MAX_CONCURRENT_CALLS: usize = 16;

/// The `sandbox:` config section.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Python interpreter (a path or a name on PATH).
    pub python: String,
    pub timeout_seconds: f64,
    /// Bytes of stdout / stderr kept; the rest is read and dropped.
    pub stdout_limit: usize,
    pub stderr_limit: usize,
    /// Largest RESULT, in bytes of JSON.
    pub result_limit: usize,
    pub memory_bytes: u64,
    pub max_processes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
    /// Where per-run workspaces are made (default: a directory under the system temp dir).
    pub workspace_dir: Option<PathBuf>,
    /// Environment passed to the code; nothing else of the gateway's environment is.
    pub env: BTreeMap<String, String>,
    /// Run even where the kernel cannot isolate (no namespaces or no Landlock). Off by default:
    /// start-up then fails, saying which layer is missing.
    pub allow_unisolated: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            // A system interpreter: the unprivileged sandbox user must be able to reach it
            // (one under a home directory, like pyenv's, usually is not).
            python: if Path::new("/usr/bin/python3").is_file() {
                "/usr/bin/python3"
            } else {
                "python3"
            }
            .into(),
            timeout_seconds: 30.0,
            stdout_limit: 64 << 10,
            stderr_limit: 64 << 10,
            result_limit: 65536,
            memory_bytes: 1 << 30,
            max_processes: 64,
            file_size_bytes: 64 << 20,
            open_files: 256,
            workspace_dir: None,
            env: BTreeMap::new(),
            allow_unisolated: false,
        }
    }
}

/// One tool as the sandbox sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

/// What sandboxed code can reach: the gateway's upstream tools.
pub trait ToolHost: Send + Sync {
    fn servers(&self) -> Vec<String>;
    fn tools(&self, server: &str) -> impl Future<Output = Result<Vec<ToolSpec>, String>> + Send;
    fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
    ) -> impl Future<Output = Result<Value, String>> + Send;
}

/// What to run.
#[derive(Debug, Clone)]
pub enum Source {
    Code(String),
    /// A script already checked to be inside the workspace root.
    Script(PathBuf),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    Timeout {
        seconds: f64,
    },
    ResultTooLarge {
        bytes: usize,
        limit: usize,
    },
    /// The code raised; `message` and `traceback` come from Python.
    Exception {
        kind: String,
        message: String,
        traceback: String,
    },
    /// The process ended without reporting (killed, crashed, or exit() before the end).
    NoResult,
    Bridge(String),
    Spawn(String),
}

impl Failure {
    /// The `error.type` of the span and the gateway's `status`.
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Timeout { .. } => "timeout",
            Failure::ResultTooLarge { .. } => "result_too_large",
            Failure::Exception { .. } => "exception",
            Failure::NoResult => "no_result",
            Failure::Bridge(_) => "bridge",
            Failure::Spawn(_) => "spawn",
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Failure::Timeout { seconds } => {
                format!("timeout: the code ran longer than {seconds} s and was killed")
            }
            Failure::ResultTooLarge { bytes, limit } => {
                format!("result too large: RESULT is {bytes} bytes of JSON, the limit is {limit}")
            }
            Failure::Exception {
                kind,
                message,
                traceback,
            } => format!("{kind}: {message}\n{traceback}"),
            Failure::NoResult => {
                "the code ended without reporting a result (killed or crashed; see stderr)".into()
            }
            Failure::Bridge(m) => format!("bridge error: {m}"),
            Failure::Spawn(m) => format!("could not start the sandbox: {m}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Outcome {
    /// RESULT as JSON (`null` when the code set none).
    pub result: Option<Value>,
    pub failure: Option<Failure>,
    pub stdout: String,
    pub stderr: String,
    /// The process's exit status; `None` when it was killed.
    pub returncode: Option<i32>,
    pub tool_calls: u32,
    pub duration: Duration,
}

/// Which isolation layers this gateway applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layers {
    pub namespaces: bool,
    pub landlock_abi: u32,
    pub drop_to_nobody: bool,
}

pub struct Sandbox {
    config: SandboxConfig,
    python: PathBuf,
    runner: PathBuf,
    workspace_base: PathBuf,
    /// Directories Python needs to read (its prefix, its sys.path, system libraries).
    read_only: Vec<PathBuf>,
    layers: Layers,
}

/// Nobody, for a gateway running as root.
const NOBODY: (u32, u32) = (65534, 65534);

fn resolve(program: &str) -> Option<PathBuf> {
    let p = Path::new(program);
    if p.components().count() > 1 {
        return p.canonicalize().ok();
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|c| c.is_file())
        .and_then(|c| c.canonicalize().ok())
}

impl Sandbox {
    /// Prepares the sandbox and proves it works: a first run must succeed under every layer
    /// (or, with `allow_unisolated`, under the layers that work, said loudly).
    pub async fn new(config: SandboxConfig) -> anyhow::Result<Self> {
        anyhow::ensure!(
            config.timeout_seconds > 0.0 && config.timeout_seconds <= 86_400.0,
            "sandbox.timeout_seconds must be greater than 0 and at most a day (86400); got {}",
            config.timeout_seconds
        );
        let python = resolve(&config.python).ok_or_else(|| {
            anyhow::anyhow!(
                "sandbox.python {:?} not found (give a path or put it on PATH)",
                config.python
            )
        })?;
        let workspace_base = config.workspace_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("nomad-gateway-{}", std::process::id()))
        });
        std::fs::create_dir_all(&workspace_base)?;
        let workspace_base = workspace_base.canonicalize()?;
        let runtime = workspace_base.join("runtime");
        std::fs::create_dir_all(&runtime)?;
        let runner = runtime.join("runner.py");
        std::fs::write(&runner, RUNNER)?;
        set_mode(&workspace_base, 0o755)?;
        set_mode(&runtime, 0o755)?;
        set_mode(&runner, 0o644)?;

        // The directories this interpreter reads from.
        let probe = tokio::process::Command::new(&python)
            .args([
                "-I",
                "-c",
                "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix] + sys.path))",
            ])
            .env_clear()
            .output()
            .await?;
        anyhow::ensure!(
            probe.status.success(),
            "{} does not run: {}",
            python.display(),
            String::from_utf8_lossy(&probe.stderr)
        );
        let mut read_only: Vec<PathBuf> = serde_json::from_slice::<Vec<String>>(&probe.stdout)?
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        if let Some(dir) = python.parent() {
            read_only.push(dir.to_owned());
        }
        for system in [
            "/usr",
            "/lib",
            "/lib64",
            "/bin",
            "/etc/ld.so.cache",
            "/etc/localtime",
            "/dev/urandom",
            "/dev/null",
            "/dev/zero",
        ] {
            read_only.push(PathBuf::from(system));
        }
        read_only.push(runtime.clone());
        read_only.sort();
        read_only.dedup();

        // SAFETY: geteuid has no preconditions.
        let as_root = unsafe { libc::geteuid() } == 0;
        if as_root && !reachable_by_others(&python) {
            anyhow::bail!(
                "sandbox.python {} is not readable and executable by other users, so the sandbox's \
                 unprivileged user cannot run it; use a system interpreter such as /usr/bin/python3",
                python.display()
            );
        }
        let wanted = Layers {
            namespaces: true,
            landlock_abi: isolation::landlock_abi(),
            drop_to_nobody: as_root,
        };
        let mut sandbox = Sandbox {
            config,
            python,
            runner,
            workspace_base,
            read_only,
            layers: wanted,
        };
        let mut problems = Vec::new();
        if wanted.landlock_abi == 0 {
            problems.push(
                "Landlock is not available (kernel 5.13+ with landlock in the LSM list)".to_owned(),
            );
        }
        if let Err(e) = sandbox.self_test().await {
            problems.push(format!("a first sandboxed run failed: {e}"));
            // Find which layer the kernel refuses.
            sandbox.layers.namespaces = false;
            if sandbox.self_test().await.is_ok() {
                problems.push("new user/network/PID namespaces are not allowed here".into());
            }
        }
        if !problems.is_empty() {
            if !sandbox.config.allow_unisolated {
                anyhow::bail!(
                    "the sandbox cannot isolate code on this machine: {}. Set sandbox.allow_unisolated: true \
                     to run model-written code without these protections",
                    problems.join("; ")
                );
            }
            tracing::error!(
                "RUNNING MODEL-WRITTEN CODE WITHOUT FULL ISOLATION (sandbox.allow_unisolated): {}",
                problems.join("; ")
            );
            sandbox.self_test().await?;
        }
        tracing::info!(
            namespaces = sandbox.layers.namespaces,
            landlock_abi = sandbox.layers.landlock_abi,
            unprivileged_user = sandbox.layers.drop_to_nobody,
            python = %sandbox.python.display(),
            "sandbox ready"
        );
        Ok(sandbox)
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    async fn self_test(&self) -> anyhow::Result<()> {
        let outcome = self
            .run(
                Source::Code("RESULT = 1".into()),
                &BTreeMap::new(),
                &[],
                &NoTools,
            )
            .await;
        match (&outcome.failure, &outcome.result) {
            (None, Some(Value::Number(_))) => Ok(()),
            (Some(f), _) => anyhow::bail!("{} (stderr: {})", f.describe(), outcome.stderr.trim()),
            _ => anyhow::bail!("unexpected result {:?}", outcome.result),
        }
    }

    /// Runs `source` with `env` (on top of the configured environment) and `context` (trace
    /// context variables), serving its tool calls from `host`.
    pub async fn run(
        &self,
        source: Source,
        env: &BTreeMap<String, String>,
        context: &[(String, String)],
        host: &impl ToolHost,
    ) -> Outcome {
        let started = Instant::now();
        let fail = |failure: Failure| Outcome {
            result: None,
            failure: Some(failure),
            stdout: String::new(),
            stderr: String::new(),
            returncode: None,
            tool_calls: 0,
            duration: started.elapsed(),
        };
        let workspace = self
            .workspace_base
            .join(format!("run-{}", uuid::Uuid::new_v4().simple()));
        let prepared = match self.prepare(&workspace, &source) {
            Ok(p) => p,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&workspace);
                return fail(Failure::Spawn(e.to_string()));
            }
        };
        let outcome = self.execute(prepared, env, context, host, started).await;
        if let Err(e) = std::fs::remove_dir_all(&workspace) {
            tracing::warn!("removing sandbox workspace {}: {e}", workspace.display());
        }
        outcome
    }

    fn prepare(&self, workspace: &Path, source: &Source) -> anyhow::Result<Prepared> {
        std::fs::create_dir(workspace)?;
        set_mode(workspace, 0o700)?;
        let (mode, path, mut read_only) = match source {
            Source::Code(code) => {
                let path = workspace.join("main.py");
                std::fs::write(&path, code)?;
                ("code", path, self.read_only.clone())
            }
            Source::Script(path) => {
                let mut read_only = self.read_only.clone();
                if let Some(dir) = path.parent() {
                    read_only.push(dir.to_owned());
                }
                ("script", path.clone(), read_only)
            }
        };
        if self.layers.drop_to_nobody {
            chown_tree(workspace, NOBODY)?;
        }
        read_only.retain(|p| !workspace.starts_with(p) || p.as_path() == Path::new("/"));
        let ruleset = if self.layers.landlock_abi > 0 {
            let ro: Vec<&Path> = read_only.iter().map(PathBuf::as_path).collect();
            Some(Ruleset::new(&ro, &[workspace, Path::new("/dev/null")])?)
        } else {
            None
        };
        Ok(Prepared {
            workspace: workspace.to_owned(),
            mode,
            path,
            ruleset,
        })
    }

    async fn execute(
        &self,
        prepared: Prepared,
        env: &BTreeMap<String, String>,
        context: &[(String, String)],
        host: &impl ToolHost,
        started: Instant,
    ) -> Outcome {
        let mut outcome = Outcome {
            result: None,
            failure: None,
            stdout: String::new(),
            stderr: String::new(),
            returncode: None,
            tool_calls: 0,
            duration: Duration::ZERO,
        };
        let (ours, theirs) = match StdUnixStream::pair() {
            Ok(pair) => pair,
            Err(e) => {
                outcome.failure = Some(Failure::Spawn(format!("socketpair: {e}")));
                return outcome;
            }
        };
        let theirs: OwnedFd = theirs.into();
        let timeout = Duration::from_secs_f64(self.config.timeout_seconds);
        let setup = ChildSetup {
            bridge_fd: theirs.as_raw_fd(),
            limits: Limits {
                address_space_bytes: self.config.memory_bytes,
                cpu_seconds: timeout.as_secs() + 1,
                processes: self.config.max_processes,
                file_size_bytes: self.config.file_size_bytes,
                open_files: self.config.open_files,
            },
            drop_to: self.layers.drop_to_nobody.then_some(NOBODY),
            namespaces: self.layers.namespaces,
            landlock: prepared.ruleset.as_ref().map(AsRawFd::as_raw_fd),
        };
        let mut command = tokio::process::Command::new(&self.python);
        command
            .arg("-I")
            .arg(&self.runner)
            .arg(prepared.mode)
            .arg(&prepared.path)
            .current_dir(&prepared.workspace)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LANG", "C.UTF-8")
            .env("HOME", &prepared.workspace)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(&self.config.env)
            .envs(env)
            .envs(context.iter().map(|(k, v)| (k.to_ascii_uppercase(), v)))
            .env("NOMAD_BRIDGE_FD", "3")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: `apply` makes only async-signal-safe calls on values prepared above.
        unsafe {
            command.pre_exec(move || setup.apply());
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                outcome.failure = Some(Failure::Spawn(e.to_string()));
                return outcome;
            }
        };
        drop(theirs);
        let pgid = child.id().map(|p| p as i32);
        let stdout = tokio::spawn(read_limited(child.stdout.take(), self.config.stdout_limit));
        let stderr = tokio::spawn(read_limited(child.stderr.take(), self.config.stderr_limit));
        let bridge = serve_bridge(ours, host);

        let waited = tokio::time::timeout(timeout, async {
            let (done, status) = tokio::join!(bridge, child.wait());
            (done, status)
        })
        .await;
        let kill_group = || {
            if let Some(pgid) = pgid {
                // SAFETY: kill(2) on our own child's process group.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
        };
        match waited {
            Ok((bridge_end, status)) => {
                kill_group(); // anything left in the group
                outcome.returncode = status.ok().and_then(|s| s.code());
                outcome.tool_calls = bridge_end.tool_calls;
                match bridge_end.done {
                    Some(Done { error: Some(e), .. }) => {
                        outcome.failure = Some(Failure::Exception {
                            kind: e.kind,
                            message: e.message,
                            traceback: e.traceback,
                        });
                    }
                    Some(Done { result, .. }) => {
                        let bytes = serde_json::to_vec(&result).map_or(0, |v| v.len());
                        if bytes > self.config.result_limit {
                            outcome.failure = Some(Failure::ResultTooLarge {
                                bytes,
                                limit: self.config.result_limit,
                            });
                        } else {
                            outcome.result = Some(result);
                        }
                    }
                    None => {
                        outcome.failure =
                            Some(bridge_end.error.map_or(Failure::NoResult, Failure::Bridge));
                    }
                }
            }
            Err(_) => {
                kill_group();
                let _ = child.wait().await;
                outcome.failure = Some(Failure::Timeout {
                    seconds: self.config.timeout_seconds,
                });
            }
        }
        // The pipes close when the process group is gone; do not wait on a stray holder forever.
        let collect = |handle: tokio::task::JoinHandle<String>| async move {
            tokio::time::timeout(Duration::from_secs(2), handle)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default()
        };
        outcome.stdout = collect(stdout).await;
        outcome.stderr = collect(stderr).await;
        outcome.duration = started.elapsed();
        outcome
    }
}

struct Prepared {
    workspace: PathBuf,
    mode: &'static str,
    path: PathBuf,
    ruleset: Option<Ruleset>,
}

/// Whether users other than the owner can reach and run `path` (every directory above it
/// searchable, the file readable and executable).
fn reachable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode())
            .unwrap_or(0)
    };
    path.ancestors().skip(1).all(|dir| mode(dir) & 0o001 != 0) && mode(path) & 0o005 == 0o005
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

fn chown_tree(path: &Path, (uid, gid): (u32, u32)) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), (uid, gid))?;
        }
    }
    Ok(())
}

/// Reads to the end, keeping the first `limit` bytes (and saying how much was dropped).
async fn read_limited(stream: Option<impl AsyncRead + Unpin>, limit: usize) -> String {
    let Some(mut stream) = stream else {
        return String::new();
    };
    let mut kept = Vec::new();
    let mut total = 0usize;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total += n;
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
    let mut text = String::from_utf8_lossy(&kept).into_owned();
    if total > kept.len() {
        text.push_str(&format!(
            "\n[... {} more bytes dropped: output limit {limit}]",
            total - kept.len()
        ));
    }
    text
}

#[derive(Debug, Deserialize)]
struct DoneError {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    traceback: String,
}

#[derive(Debug, Deserialize)]
struct Done {
    #[serde(default)]
    result: Value,
    #[serde(default)]
    error: Option<DoneError>,
}

#[derive(Debug, Default)]
struct BridgeEnd {
    done: Option<Done>,
    tool_calls: u32,
    /// A protocol violation that ended the bridge.
    error: Option<String>,
}

/// Serves the runner's requests until it closes the bridge.
async fn serve_bridge(stream: StdUnixStream, host: &impl ToolHost) -> BridgeEnd {
    let mut end = BridgeEnd::default();
    if let Err(e) = stream.set_nonblocking(true) {
        end.error = Some(e.to_string());
        return end;
    }
    let stream = match tokio::net::UnixStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => {
            end.error = Some(e.to_string());
            return end;
        }
    };
    let (mut reader, writer) = stream.into_split();
    let writer = Arc::new(Mutex::new(writer));
    let mut decoder = Decoder::default();
    let mut buffer = vec![0u8; 64 << 10];
    let mut calls = futures::stream::FuturesUnordered::new();
    use futures::StreamExt as _;
    'read: loop {
        tokio::select! {
            // At most MAX_CONCURRENT_CALLS in flight: past that the runner's writes block.
            read = reader.read(&mut buffer), if calls.len() < MAX_CONCURRENT_CALLS => {
                let n = match read {
                    Ok(0) | Err(_) => break 'read,
                    Ok(n) => n,
                };
                decoder.push(&buffer[..n]);
                loop {
                    let message = match decoder.next_frame() {
                        Ok(Some(m)) => m,
                        Ok(None) => break,
                        Err(e) => {
                            end.error = Some(e.to_string());
                            break 'read;
                        }
                    };
                    if message.method == "done" {
                        end.done = serde_json::from_value(message.params).ok();
                        continue;
                    }
                    let Some(id) = message.id else { continue };
                    if message.method == "call_tool" {
                        end.tool_calls += 1;
                    }
                    let writer = writer.clone();
                    calls.push(async move {
                        let response = handle(host, id, &message.method, message.params).await;
                        if let Ok(frame) = bridge::encode(&response)
                            .or_else(|e| bridge::encode(&Response::error(id, e.to_string())))
                        {
                            let _ = writer.lock().await.write_all(&frame).await;
                        }
                    });
                }
            }
            Some(()) = calls.next(), if !calls.is_empty() => {}
        }
    }
    while calls.next().await.is_some() {}
    end
}

async fn handle(host: &impl ToolHost, id: u64, method: &str, params: Value) -> Response {
    let text = |key: &str| {
        params
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    match method {
        "list_servers" => Response::ok(id, serde_json::json!(host.servers())),
        "list_tools" => match host.tools(&text("server")).await {
            Ok(tools) => Response::ok(id, serde_json::to_value(tools).unwrap_or_default()),
            Err(e) => Response::error(id, e),
        },
        "call_tool" => {
            let arguments = params
                .get("arguments")
                .cloned()
                .unwrap_or(Value::Object(Default::default()));
            match host.call(&text("server"), &text("tool"), arguments).await {
                Ok(value) => Response::ok(id, value),
                Err(e) => Response::error(id, e),
            }
        }
        other => Response::error(id, format!("unknown bridge method {other:?}")),
    }
}

/// A host with no tools (the start-up self-test).
struct NoTools;

impl ToolHost for NoTools {
    fn servers(&self) -> Vec<String> {
        Vec::new()
    }

    async fn tools(&self, server: &str) -> Result<Vec<ToolSpec>, String> {
        Err(format!("no server {server:?}"))
    }

    async fn call(&self, server: &str, tool: &str, _arguments: Value) -> Result<Value, String> {
        Err(format!("no tool {server}.{tool}"))
    }
}
