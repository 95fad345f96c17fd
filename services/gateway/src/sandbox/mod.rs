//! Runs model-written Python in an isolated process. The code reaches upstream tools only
//! through the bridge (see `bridge`), which the gateway serves with a [`ToolHost`].
//!
//! The isolation itself (namespaces, the filesystem view, limits, Landlock, capabilities,
//! seccomp) is one sequence in the `nomad_jail` crate, taken by every run however it starts:
//! - `init`: starting `nomad-gateway sandbox-init`, a spawned run's (and the fork server's) first
//!   process; `fork_server`: the zygote that forks runs, each taking the same steps;
//! - `first_process`: a run's PID 1, by which the gateway ends it; `cgroup`: per-run cgroups
//!   where delegated;
//! - `view`: what the filesystem view holds; `isolation`: what holds, in words;
//! - `process`: one sandbox process from the gateway's side; `calls`: the bridge server;
//! - `pool`: admission (`max_concurrent`, `max_queued`) and the warm pool;
//! - `workspace`: the gateway's private directory.

pub mod bridge;
mod calls;
mod cgroup;
mod config;
mod first_process;
mod fork_server;
pub mod init;
mod isolation;
mod memory;
mod pool;
mod process;
mod self_test;
mod view;
mod workspace;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::tool_error::ToolError;
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram, ObservableGauge, ObservableUpDownCounter};
use serde_json::Value;

pub use self::config::SandboxConfig;
use self::init::{Limits, Spec};
pub use self::isolation::Isolation;
pub use self::pool::Rejected;
use self::pool::{Counts, Pool};
use self::process::{Job, Launch};

const RUNNER: &str = include_str!("runner.py");
const ZYGOTE: &str = include_str!("zygote.py");

/// One tool as the sandbox sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
    /// Shown by search only; the sandbox's modules need none of these.
    #[serde(skip)]
    pub title: String,
    #[serde(skip)]
    pub output_schema: Option<Value>,
    /// What MCP clients are told of its effects (read-only, idempotent, open world), when known.
    #[serde(skip)]
    pub annotations: Option<rmcp::model::ToolAnnotations>,
}

/// What sandboxed code can reach: the gateway's upstream tools.
pub trait ToolHost: Send + Sync {
    fn servers(&self) -> Vec<String>;
    fn tools(&self, server: &str) -> impl Future<Output = Result<Vec<ToolSpec>, ToolError>> + Send;
    fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
    ) -> impl Future<Output = Result<Value, ToolError>> + Send;
    /// Why `server.tool` is not among `tools(server)` (code imported a name the module lacks).
    fn missing(&self, server: &str, tool: &str) -> impl Future<Output = ToolError> + Send {
        let error = ToolError::not_found(format!("{server} has no tool {tool:?}"));
        async move { error }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub enum Source {
    Code(String),
    /// A script's text, read once from `path` (checked to be inside the workspace root).
    Script {
        path: PathBuf,
        text: String,
    },
}

#[derive(Debug, Clone, PartialEq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
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
    /// The run's processes and the files on its own tmpfs together held more than
    /// `sandbox.memory_bytes` (no cgroup: the gateway's own sampling), and it was killed.
    Memory {
        bytes: u64,
        limit: u64,
    },
    /// The process ended without reporting (killed, crashed, or exit() before the end).
    NoResult,
    Bridge(String),
    Spawn(String),
}

impl Failure {
    /// The `error.type` of the span and the gateway's `status`.
    pub fn kind(&self) -> &'static str {
        self.into()
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
            Failure::Memory { bytes, limit } => format!(
                "memory: the run held {} MiB (its processes, and the files in its /workspace, \
                 /tmp and /dev/shm), over sandbox.memory_bytes ({} MiB); the run was killed",
                bytes >> 20,
                limit >> 20
            ),
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
    /// Whether the run got a runner from the warm pool.
    pub warm: bool,
    /// How long the run waited for a slot before it started.
    pub queue_wait: Duration,
}

pub struct Sandbox {
    config: SandboxConfig,
    pool: Arc<Pool>,
    isolation: Isolation,
    starts: Counter<u64>,
    rejections: Counter<u64>,
    queue_wait: Histogram<f64>,
    _gauges: Gauges,
}

struct Gauges {
    _isolation: ObservableGauge<f64>,
    _counts: Vec<ObservableUpDownCounter<i64>>,
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
        config.check().map_err(anyhow::Error::msg)?;
        let python = resolve(&config.python).ok_or_else(|| {
            anyhow::anyhow!(
                "sandbox.python {:?} not found (give a path or put it on PATH)",
                config.python
            )
        })?;
        // SAFETY: geteuid has no preconditions.
        let as_root = unsafe { libc::geteuid() } == 0;
        if as_root && !reachable_by_others(&python) {
            anyhow::bail!(
                "sandbox.python {} is not readable and executable by other users, so the sandbox's \
                 unprivileged user cannot run it; use a system interpreter such as /usr/bin/python3",
                python.display()
            );
        }
        let parent = config
            .workspace_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        let base = workspace::make_private_dir(&parent, "nomad-gateway-", 0o755)?;
        let runtime = base.join("runtime");
        let mount_point = base.join("root");
        for dir in [&runtime, &mount_point] {
            std::fs::create_dir(dir)?;
            set_mode(dir, 0o755)?;
        }
        for (name, text) in [
            ("runner.py", RUNNER),
            ("zygote.py", ZYGOTE),
            (nomad_frame::PYTHON_FILE, nomad_frame::PYTHON),
        ] {
            std::fs::write(runtime.join(name), text)?;
            set_mode(&runtime.join(name), 0o644)?;
        }
        // The fork server's interpreter loads the isolation library from the view.
        let library = jail_library().and_then(|found| {
            let copy = runtime.join(nomad_jail::LIBRARY);
            std::fs::copy(&found, &copy)
                .and_then(|_| set_mode(&copy, 0o644))
                .map_err(|e| format!("copying {}: {e}", found.display()))
        });

        let view = view::view_for(&python, &base).await?;
        let cgroup = cgroup::Cgroups::detect();
        let mut spec = Spec {
            python: python.clone(),
            args: Vec::new(),
            runtime: runtime.clone(),
            mount_point,
            view,
            disk_bytes: config.disk_bytes,
            max_files: config.max_files,
            limits: Limits {
                address_space_bytes: config.memory_bytes,
                cpu_seconds: config.timeout_seconds.ceil() as u64 + 1,
                processes: config.max_processes,
                file_size_bytes: config.file_size_bytes,
                open_files: config.open_files,
            },
            drop_to: as_root.then_some(NOBODY),
            namespaces: true,
            proc: true,
            host_workspace: None,
            cgroup: None,
            seccomp: true,
            landlock: true,
            zygote: false,
        };
        let mut launch = Launch {
            spec: spec.clone(),
            base: base.clone(),
            preload: config.preload.clone(),
            stdout_limit: config.stdout_limit,
            stderr_limit: config.stderr_limit,
            result_limit: config.result_limit,
            call_limit: config.max_call_bytes,
            budget: calls::Budget {
                in_flight: config.max_calls_in_flight,
                total: config.max_tool_calls,
            },
            bridge_memory: calls::BridgeMemory::new(config.bridge_memory_bytes),
            // A cgroup's memory.max bounds a run as a whole; without one, the gateway does.
            memory_watch: cgroup.is_err().then_some(config.memory_bytes),
            fork_server: None,
        };
        // The largest frame, parsed, must fit, or a run sending one would wait for ever.
        let largest = calls::PARSE_FACTOR as u64 * launch.frame_limit() as u64 + (64 << 10);
        if config.bridge_memory_bytes < largest {
            anyhow::bail!(
                "sandbox.bridge_memory_bytes ({}) cannot hold one parsed frame of the largest \
                 size the limits allow ({largest} bytes: {} times the largest of max_call_bytes, \
                 result_limit and twice stderr_limit); raise it or lower those limits",
                config.bridge_memory_bytes,
                calls::PARSE_FACTOR
            );
        }
        let cgroups = cgroup.as_ref().ok();
        let run_limits = cgroup::RunLimits {
            memory_bytes: config.memory_bytes,
            processes: config.max_processes,
            cpu_cores: config.cpu_cores,
        };

        // Find what this kernel allows, one refused layer at a time.
        let mut problems = Vec::new();
        let report = loop {
            spec.args = runner_args(&spec);
            launch.spec = spec.clone();
            match self_test::self_test(&launch, cgroups, run_limits).await {
                Ok((report, _)) => break report,
                Err(e) if spec.proc && e.contains("mounting /proc") => {
                    tracing::warn!(
                        "the kernel refuses the sandbox its own /proc (as in a container that \
                         masks parts of /proc): runs get none ({e})"
                    );
                    spec.proc = false;
                }
                Err(e) if spec.namespaces && !config.allow_unisolated => {
                    anyhow::bail!(
                        "the sandbox cannot isolate code on this machine: {e}. Set \
                         sandbox.allow_unisolated: true to run model-written code without \
                         namespaces and the filesystem view"
                    );
                }
                Err(e) if spec.namespaces => {
                    problems.push(format!("namespaces refused ({e})"));
                    spec.namespaces = false;
                    spec.proc = false;
                }
                Err(e) if spec.seccomp && config.allow_unisolated => {
                    problems.push(format!("seccomp refused ({e})"));
                    spec.seccomp = false;
                }
                Err(e) => anyhow::bail!("the sandbox does not work on this machine: {e}"),
            }
        };
        if config.fork_server && spec.namespaces && cgroups.is_none() {
            launch.fork_server = match &library {
                Ok(()) => self_test::start_fork_server(&launch, &report, run_limits)
                    .await
                    .map(fork_server::ForkServers::new),
                Err(why) => {
                    tracing::warn!(
                        "sandbox fork server not used, each run starts an interpreter: {why}"
                    );
                    None
                }
            };
        }
        let isolation = Isolation {
            report: report.clone(),
            cgroup: cgroup
                .as_ref()
                .map(|c| c.dir().to_owned())
                .map_err(Clone::clone),
        };
        let lost = isolation.lost();
        let in_force: Vec<&str> = isolation
            .layers()
            .into_iter()
            .filter_map(|(name, on)| on.then_some(name))
            .collect();
        if !report.namespaces || !report.seccomp {
            tracing::error!(
                "RUNNING MODEL-WRITTEN CODE WITHOUT FULL ISOLATION (sandbox.allow_unisolated): {}",
                lost.join("; ")
            );
        }
        match &isolation.cgroup {
            Ok(dir) => tracing::info!(
                "sandbox limits: a cgroup per run under {} (memory.max, pids.max, cpu.max)",
                dir.display()
            ),
            Err(why) => tracing::info!(
                "sandbox limits: per-process rlimits (address space, processes, CPU seconds, \
                 file size), and each run's memory as a whole (the PSS of all its processes, \
                 sampled every {} ms) within sandbox.memory_bytes; no per-run cgroup: {why}",
                memory::INTERVAL.as_millis()
            ),
        }
        tracing::info!(
            layers = %in_force.join(","),
            landlock_abi = report.landlock_abi,
            supplementary_groups = report.supplementary_groups,
            python = %python.display(),
            directory = %base.display(),
            "sandbox ready"
        );
        raise_open_files_limit(config.max_concurrent());
        let ledger = memory::Ledger::new(config.memory_budget());
        tracing::info!(
            budget_mib = ledger.budget() >> 20,
            max_concurrent = config.max_concurrent(),
            "sandbox admission: runs are admitted while what they hold (sampled every {} ms) \
             leaves room in the budget for one more, at most max_concurrent at once",
            memory::INTERVAL.as_millis()
        );
        let pool = Arc::new(Pool::new(
            launch,
            report,
            cgroup.ok(),
            run_limits,
            pool::Admission {
                ledger,
                max_concurrent: config.max_concurrent(),
                max_queued: config.max_queued,
                warm: config.warm,
            },
        ));
        tokio::spawn(pool.clone().keep_warm());
        tokio::spawn(pool.clone().keep_fork_server());
        let gauges = gauges(&isolation, &pool);
        Ok(Sandbox {
            config,
            pool,
            isolation,
            starts: defs::GATEWAY_SANDBOX_STARTS.u64_counter(),
            rejections: defs::GATEWAY_SANDBOX_REJECTIONS.u64_counter(),
            queue_wait: defs::GATEWAY_SANDBOX_QUEUE_WAIT.f64_histogram(),
            _gauges: gauges,
        })
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Removes the gateway's private directory (at shutdown; runs still alive keep their view,
    /// which holds binds of it, not the directory itself).
    pub fn remove_directory(&self) {
        workspace::remove_tree(&self.pool.launch.base);
    }

    pub fn isolation(&self) -> &Isolation {
        &self.isolation
    }

    pub fn counts(&self) -> &Counts {
        &self.pool.counts
    }

    pub fn max_concurrent(&self) -> usize {
        self.pool.max_concurrent()
    }

    /// Runs `source` with `env` (on top of the configured environment) and `context` (trace
    /// context variables), serving its tool calls from `host`. A run waits for a free slot at
    /// most its own timeout.
    pub async fn run(
        &self,
        source: Source,
        env: &BTreeMap<String, String>,
        cx: &Context,
        context: &[(String, String)],
        host: &impl ToolHost,
    ) -> Result<Outcome, Rejected> {
        let timeout = Duration::from_secs_f64(self.config.timeout_seconds);
        let (mode, filename, text) = match source {
            Source::Code(code) => ("code", "<code>".to_owned(), code),
            Source::Script { path, text } => ("script", path.display().to_string(), text),
        };
        // The wait for a slot is a span of its own, so a slow rollout's waterfall says where
        // its time went before its code started.
        let waiting = GroupSpan::start(SpanGroup::Sandbox, "nomad.gateway.sandbox.queue_wait", cx);
        let wait_started = Instant::now();
        let acquired = self.pool.acquire(timeout).await;
        let queue_wait = wait_started.elapsed();
        let admission = acquired
            .as_ref()
            .map_or_else(Rejected::reason, |_| "admitted");
        self.queue_wait.record(
            queue_wait.as_secs_f64(),
            &[KeyValue::new("outcome", admission)],
        );
        let (process, mut running) = match acquired {
            Ok(p) => {
                waiting.set_ok();
                p
            }
            Err(e) => {
                waiting.set_error(e.reason(), e.to_string());
                self.rejections
                    .add(1, &[KeyValue::new("reason", e.reason())]);
                return Err(e);
            }
        };
        drop(waiting);
        self.starts.add(
            1,
            &[KeyValue::new(
                "start",
                if process.warm { "warm" } else { "cold" },
            )],
        );
        let env = self
            .config
            .env
            .iter()
            .chain(env)
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(
                context
                    .iter()
                    .map(|(k, v)| (k.to_ascii_uppercase(), v.clone())),
            )
            .collect();
        let job = Job {
            mode,
            filename,
            source: text,
            env,
        };
        let mut outcome = process
            .run(
                job,
                &self.pool.expected,
                host,
                timeout,
                &self.pool.launch,
                &mut running.memory,
            )
            .await;
        drop(running);
        self.pool.finished();
        outcome.queue_wait = queue_wait;
        Ok(outcome)
    }
}

/// `-I` (isolated: no environment, no user site, no script directory on the path), `-B` (no
/// bytecode writes), the runner.
fn runner_args(spec: &Spec) -> Vec<String> {
    let runner = if spec.namespaces {
        Path::new(init::RUNTIME_DIR).join("runner.py")
    } else {
        spec.runtime.join("runner.py")
    };
    vec!["-I".into(), "-B".into(), runner.display().to_string()]
}

fn gauges(isolation: &Isolation, pool: &Arc<Pool>) -> Gauges {
    let layers = isolation.layers();
    let isolation = defs::GATEWAY_SANDBOX_ISOLATION.f64_observable_gauge(move |o| {
        for (layer, on) in &layers {
            o.observe(f64::from(u8::from(*on)), &[KeyValue::new("layer", *layer)]);
        }
    });
    let count = |def: &defs::MetricDef, read: fn(&Counts) -> usize| {
        let pool = pool.clone();
        def.i64_observable_up_down_counter(move |o| o.observe(read(&pool.counts) as i64, &[]))
    };
    Gauges {
        _isolation: isolation,
        _counts: vec![
            count(&defs::GATEWAY_SANDBOX_RUNS_ACTIVE, |c| {
                c.running.load(Ordering::Relaxed)
            }),
            count(&defs::GATEWAY_SANDBOX_RUNS_QUEUED, |c| {
                c.queued.load(Ordering::Relaxed)
            }),
            count(&defs::GATEWAY_SANDBOX_WARM, |c| {
                c.warm.load(Ordering::Relaxed)
            }),
            memory_gauge(
                &defs::GATEWAY_SANDBOX_MEMORY_USAGE,
                pool,
                memory::Ledger::held,
            ),
            memory_gauge(
                &defs::GATEWAY_SANDBOX_MEMORY_LIMIT,
                pool,
                memory::Ledger::budget,
            ),
        ],
    }
}

/// Each run holds a few descriptors in the gateway (its bridge, its output pipes): hundreds of
/// runs need more than the usual soft limit of 1,024, so the soft limit is raised to the hard one.
fn raise_open_files_limit(max_concurrent: usize) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_err() {
        tracing::warn!(soft, hard, "could not raise the open-files limit");
    }
    let limit = getrlimit(Resource::RLIMIT_NOFILE).map_or(soft, |(soft, _)| soft);
    // Bridge, stdout, stderr and a child handle per run, and room for everything else.
    let needed = 4 * max_concurrent as u64 + 256;
    if limit < needed {
        tracing::warn!(
            limit,
            needed,
            "the open-files limit is low for sandbox.max_concurrent runs at once; raise it \
             (ulimit -n) or lower max_concurrent"
        );
    }
}

fn memory_gauge(
    def: &defs::MetricDef,
    pool: &Arc<Pool>,
    read: fn(&memory::Ledger) -> u64,
) -> ObservableUpDownCounter<i64> {
    let ledger = pool.ledger.clone();
    def.i64_observable_up_down_counter(move |o| {
        o.observe(i64::try_from(read(&ledger)).unwrap_or(i64::MAX), &[])
    })
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

/// The isolation library (`nomad_jail` built as a shared library): beside the gateway's
/// binary, or in cargo's `deps/` there.
fn jail_library() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding the gateway's binary: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    [dir.to_owned(), dir.join("deps")]
        .into_iter()
        .map(|d| d.join(nomad_jail::LIBRARY))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            format!(
                "no {} beside {} (or in deps/ there): install it with the gateway's binary",
                nomad_jail::LIBRARY,
                exe.display()
            )
        })
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(test)]
#[path = "limits_tests.rs"]
mod limits_tests;
