//! `nomad up`: the whole fleet as child processes on loopback (scheduler, one device worker per
//! GPU or `--workers` CPU workers, gateway), with a run directory holding every server's log and
//! telemetry; optionally a task set run through it (`--tasks`, `--demo`) before it stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use nomad_config::{ConfigFile, Env, ProcessEnv};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_rpc::{Service, StartOptions};
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{
    ConsoleSink, ExporterKind, InitOptions, KeyValue, ServerType, TelemetryBlock,
};
use serde_json::json;

use self::env::Layered;
use self::fleet::FleetPlan;
use crate::exit::Exit;
use crate::rollouts::{self, Runner};
use crate::supervisor::Supervisor;
use crate::{memory, run_id, tasks, traces};

pub(crate) mod env;
pub(crate) mod fleet;
pub(crate) mod fleet_file;
pub(crate) mod models;
pub(crate) mod ready;
pub(crate) mod run_dir;
mod summary;

pub(crate) use run_dir::write_private;
pub(crate) use summary::summarize;

/// The bundled task set of `--demo` and the agent script its tasks run.
pub(crate) const DEMO_TASKS: &str = include_str!("../../demo/tasks.jsonl");
pub(crate) const DEMO_AGENT: &str = include_str!("../../demo/agent.py");
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
    /// What the gateway's MCP endpoint offers (code mode; the tools under `nomad serve`).
    pub front: fleet::GatewayFront,
    /// Fail start-up when a tool cannot serve (a missing source, an environment that cannot
    /// install) instead of serving the others.
    pub strict: bool,
}

/// How long describing the tools may take at start-up, at most (each description is bounded by
/// the scheduler's `tool_manager.prepare_timeout_seconds` too).
const DESCRIBED_WITHIN: Duration = Duration::from_secs(7200);

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

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}

/// Runs the fleet. Returns whether everything it ran succeeded.
pub async fn up(options: UpOptions) -> anyhow::Result<Exit> {
    let mut phases = nomad_telemetry::startup::Phases::begin();
    // `nomad serve` is this fleet with its tools at the front: it speaks as itself.
    let who = match options.front {
        fleet::GatewayFront::Code => "nomad up",
        _ => "nomad serve",
    };
    let user_env = ProcessEnv;
    let bin_dir = bin_dir(options.bin_dir.as_deref())?;
    // Fail on a bad config before anything starts.
    let user_config = options.config.as_deref().map(absolute).transpose()?;
    let file = ConfigFile::load(user_config.as_deref())?;
    // The head dials the fleet (health checks, the gateway) as the children serve it.
    nomad_rpc::tls::configure_from(&file, false)?;
    // One credential for the whole fleet: the user's, or a fresh one for this run (handed to
    // the children in their environment and kept in fleet.json for `nomad run` and users).
    let mut auth = nomad_rpc::auth::Auth::resolve(&file, &user_env)?;
    let generated = auth.token.is_none() && !auth.open;
    if generated {
        auth.token = Some(nomad_rpc::auth::random_token().into());
    }
    let token = auth.token.clone();
    nomad_rpc::auth::install(auth)?;
    phases.mark("config");
    let block: TelemetryBlock = file.section("telemetry")?;
    let restarts = file
        .section::<crate::supervisor::RestartPolicy>("supervise")?
        .checked()
        .map_err(anyhow::Error::msg)?;
    // Children get the block as NOMAD_OTEL_* variables (and read the same file), plus the
    // defaults; none of it replaces a variable of the user's.
    let defaults = env::telemetry_defaults(&block, &user_env);
    let mut settings = nomad_telemetry::config::resolve(
        &block,
        &Layered {
            user: &user_env,
            defaults: &defaults,
        },
    )?;
    let mut child_env = nomad_telemetry::config::block_env(&block, &user_env);
    child_env.extend(defaults);
    let run_id = run_id::assign(&mut settings, &user_env)?;
    // The run id may have come from SLURM_JOB_ID or chance: every child gets this one.
    child_env.retain(|(k, _)| k != "NOMAD_OTEL_RUN_ID");
    if user_env.non_empty("NOMAD_OTEL_RUN_ID").is_none() {
        child_env.push(("NOMAD_OTEL_RUN_ID".into(), run_id.clone()));
    }
    if user_env.non_empty("RUST_LOG").is_none() {
        child_env.push((
            "RUST_LOG".into(),
            nomad_telemetry::DEFAULT_LOG_FILTER.into(),
        ));
    }
    if generated && let Some(token) = &token {
        child_env.push(("NOMAD_AUTH_TOKEN".into(), token.to_string()));
    }
    let tasks = options
        .tasks
        .as_ref()
        .map(|set| tasks::parse(&set.text, &set.source, set.template.as_deref()))
        .transpose()
        .map_err(anyhow::Error::msg)?;

    // The tools as the scheduler reads them, before a run directory exists: a typo inside a
    // tool entry is named now, not in the log of a scheduler that could not start.
    if let Some(path) = &user_config {
        ready::check_tools(&bin_dir, path)?;
    }
    let run_dir = run_dir::create(&absolute(&options.runs_dir)?, &run_id)?;
    let (config, kept_config) = match user_config {
        Some(path) => {
            let kept = run_dir::keep_config(&run_dir, &path)?;
            (path, Some(kept))
        }
        None => {
            let models = absolute(&options.models_dir)?;
            if !models::models_present(&models) {
                models::fetch_models(&models)?;
                phases.mark("models");
            }
            (run_dir::default_config(&run_dir, &models)?, None)
        }
    };

    // Every server of the fleet serves /metrics on a port of its own, unless it was turned off.
    let prometheus = user_env
        .non_empty("NOMAD_OTEL_PROMETHEUS_LISTEN")
        .or_else(|| block.prometheus_listen.clone())
        .is_none_or(|v| !v.eq_ignore_ascii_case("off"));
    if prometheus && settings.prometheus_listen.is_none() {
        settings.prometheus_listen = Some(fleet::free_loopback_address()?.parse()?);
    }
    let console = settings.enabled && settings.exporter == ExporterKind::Console;
    let options_for_head = StartOptions {
        serves: false,
        init: InitOptions {
            console_sink: ConsoleSink::File(run_dir.join("head.jsonl")),
            ..Default::default()
        },
        gpu_count: None,
        token: None,
        startup: Some(phases),
        env_defaults: Vec::new(),
    };
    let telemetry = Service::with_settings(
        ServerType::Head,
        None,
        file,
        settings.clone(),
        options_for_head,
    )?;

    let gpus = if options.workers.is_some() {
        0
    } else {
        fleet::gpu_count()
    };
    let workers = options.workers.unwrap_or(gpus.max(1));
    anyhow::ensure!(workers > 0, "--workers must be at least 1");
    eprintln!(
        "{who}: run {run_id}: starting scheduler, {workers} device worker{} ({}), gateway",
        if workers == 1 { "" } else { "s" },
        if gpus > 0 { "one per GPU" } else { "CPU" }
    );
    let mut sup = Supervisor::new(&run_dir, restarts);
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
        prometheus,
        front: &options.front,
    };
    let mut started = fleet::start_fleet(&mut sup, &plan, &telemetry.startup).await;
    telemetry.startup.finish();
    // Every tool's source and environment is checked now, not at its first call.
    if let Ok(addresses) = &started {
        match fleet::wait_described(&mut sup, &addresses.scheduler, DESCRIBED_WITHIN).await {
            Ok(fleet::Described {
                failed,
                total,
                pins,
            }) => {
                run_dir::pin_kept_config(kept_config.as_deref(), &config, pins);
                for (tool, error) in &failed {
                    eprintln!("nomad: tool {tool} cannot serve: {error}");
                }
                // A fleet none of whose tools serve is not ready, strict or not.
                if total > 0 && failed.len() == total {
                    started = Err(anyhow::anyhow!(
                        "none of the {total} tools can serve (each one's reason is above)"
                    ));
                } else if options.strict && !failed.is_empty() {
                    started = Err(anyhow::anyhow!(
                        "{} of the {total} tools cannot serve (--strict)",
                        failed.len()
                    ));
                }
            }
            Err(e) => started = Err(e),
        }
    }
    let addresses = match started {
        Ok(a) => a,
        Err(e) => {
            sup.stop(Duration::from_secs(15)).await;
            telemetry.stop().await;
            return Err(e.context(format!(
                "starting the fleet (logs in {})",
                run_dir.display()
            )));
        }
    };

    let servers = sup.running();
    // What a client of this fleet (`nomad run --fleet`) needs to export its telemetry where the
    // fleet's goes: the user's variables first, then the config's and `nomad up`'s defaults. Not
    // the address of a scrape endpoint, nor a server's own name.
    let telemetry_env = {
        let wanted = |k: &str| {
            (k.starts_with("OTEL_") || k.starts_with("NOMAD_OTEL_"))
                && !matches!(k, "NOMAD_OTEL_PROMETHEUS_LISTEN" | "OTEL_SERVICE_NAME")
        };
        let mut vars: std::collections::BTreeMap<String, String> =
            std::env::vars().filter(|(k, _)| wanted(k)).collect();
        for (k, v) in &child_env {
            if wanted(k) {
                vars.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        vars
    };
    let fleet = json!({
        "run_id": run_id,
        "run_dir": run_dir,
        "config": config,
        "scheduler": addresses.scheduler,
        "gateway": addresses.gateway,
        "gateway_mcp": addresses.mcp_url,
        "tools_mcp": addresses.tools_url,
        "openai_base_url": addresses.openai_url,
        "telemetry_env": telemetry_env,
        "head_pid": std::process::id(),
        "token": token.as_deref(),
        "prometheus": addresses.prometheus.iter()
            .map(|(name, address)| (name.clone(), json!(address)))
            .chain(settings.prometheus_listen.map(|a| ("head".to_owned(), json!(a.to_string()))))
            .collect::<serde_json::Map<_, _>>(),
        "servers": servers.iter().map(|(name, pid)| json!({"name": name, "pid": pid})).collect::<Vec<_>>(),
    });
    let fleet_path = fleet_file::write(&run_dir, &fleet)?;
    ready::announce(&ready::Ready {
        who,
        run_id: &run_id,
        runs_dir: &options.runs_dir,
        run_dir: &run_dir,
        fleet_path: &fleet_path,
        addresses: &addresses,
        front: &options.front,
        token: token.as_deref(),
        servers: &servers,
    });

    let profiler = (settings.memory_profiling_enabled && settings.metrics_on()).then(|| {
        let profiler = Arc::new(memory::Profiler::new());
        profiler
            .clone()
            .run(sup.servers.clone(), settings.memory_profiling_interval)
    });

    let mut ok = true;
    let mut interrupted = false;
    // The rollouts that finished, and where their results went.
    let mut results = None;
    match (&options.tasks, tasks) {
        (Some(set), Some(tasks)) => {
            let out = match &set.out {
                Some(path) => path.clone(),
                None => run_dir.join("results.jsonl"),
            };
            let total = tasks.len();
            let runner = Runner::new(
                GatewayClient::new(nomad_rpc::channel(&addresses.gateway)?),
                run_id.clone(),
                options.concurrency,
                options.embed_tool.clone(),
            );
            eprintln!(
                "{who}: running {} from {} (concurrency {})",
                count(tasks.len(), "task"),
                set.source,
                options.concurrency
            );
            let mut finished = Vec::new();
            // A stop (Ctrl-C, or a server the fleet cannot do without) ends the rollouts still
            // running as cancelled, with why, and writes the ones not started as such: every
            // task gets its line.
            let (stopper, stop) = rollouts::Stop::new();
            let outcome = {
                let run = rollouts::run_to_file(&runner, tasks, &out, false, &mut finished, &stop);
                tokio::pin!(run);
                tokio::select! {
                    outcome = &mut run => outcome,
                    exit = sup.next_exit() => {
                        eprintln!("{who}: {}", sup.report(&exit));
                        stopper.stop(format!(
                            "the fleet stopped before this rollout finished: {} exited ({})",
                            exit.name, exit.status
                        ));
                        run.await
                    }
                    () = nomad_rpc::shutdown_signal() => {
                        interrupted = true;
                        stopper.stop(
                            "the run was interrupted (Ctrl-C or SIGTERM) before this rollout \
                             finished",
                        );
                        run.await
                    }
                }
            };
            outcome?;
            ok = finished.iter().all(|r| r.status == "ok");
            let cancelled = finished.iter().filter(|r| r.status == "cancelled").count();
            if cancelled > 0 {
                eprintln!(
                    "{who}: {cancelled} of {total} rollouts cancelled: the run {}",
                    if interrupted {
                        "was interrupted"
                    } else {
                        "stopped"
                    }
                );
            }
            results = Some((finished, out));
        }
        _ => {
            let stdio = options.front == fleet::GatewayFront::ToolsStdio;
            if !stdio {
                eprintln!("{who}: Ctrl-C (or SIGTERM) stops the fleet");
            }
            tokio::select! {
                exit = sup.next_exit() => {
                    // Over stdio the gateway ends when its client closes the session.
                    let ended = stdio && exit.name == "gateway" && exit.status.success();
                    if !ended {
                        eprintln!("{who}: {}", sup.report(&exit));
                        ok = false;
                    }
                }
                () = nomad_rpc::shutdown_signal() => {}
            }
        }
    }

    if let Some(profiler) = profiler {
        profiler.abort();
    }
    eprintln!(
        "{who}: {}stopping the fleet",
        if interrupted { "interrupted; " } else { "" }
    );
    for exit in sup.stop(Duration::from_secs(15)).await {
        // A server stopped by our SIGTERM exits 0 after flushing; anything else is news.
        if !exit.status.success() {
            eprintln!("  {} exited ({})", exit.name, exit.status);
        }
    }
    telemetry.stop().await;

    if let Some((results, out)) = results {
        summarize(&results, &out);
        if console {
            let report = run_dir.join("report.html");
            match crate::report::write(&run_dir, &run_id, &report, 3) {
                Ok(()) => println!("Report: {}", report.display()),
                Err(e) => eprintln!("{who}: writing the run's report: {e:#}"),
            }
        }
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
        "{who}: run {run_id} done; logs and telemetry in {}{}",
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
    Ok(if interrupted {
        Exit::Interrupted
    } else {
        Exit::from(ok)
    })
}

/// `n` of `thing`, in the plural when it is not one ("1 task", "3 tasks").
pub(crate) fn count(n: usize, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// Where the service binaries are: `given`, else the directory holding `nomad`.
pub fn bin_dir(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    match given {
        Some(dir) => Ok(dir.to_owned()),
        None => Ok(std::env::current_exe()
            .context("locating the nomad binary")?
            .parent()
            .context("the nomad binary has no directory")?
            .to_owned()),
    }
}

#[derive(clap::Args)]
pub struct UpArgs {
    /// Fleet config (YAML or TOML): tools, and the `telemetry:` block every server reads.
    /// Default: the `embed` and `generate` tools on the models of scripts/fetch-models.
    #[arg(long, env = "NOMAD_CONFIG")]
    pub config: Option<PathBuf>,
    /// CPU device workers to start (default: one per GPU that nvidia-smi lists, else one).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Fetch the default models if missing, run the bundled demo tasks, print a summary and
    /// the run's traces, then stop.
    #[arg(long, conflicts_with = "tasks")]
    pub demo: bool,
    /// Run this tasks JSONL file through the fleet, then stop.
    #[arg(long)]
    pub tasks: Option<PathBuf>,
    /// Python script for tasks that give `inputs` (with --tasks).
    #[arg(long, requires = "tasks")]
    pub template: Option<PathBuf>,
    /// Results file (default: results.jsonl in the run directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    #[arg(long, default_value = "embed")]
    pub embed_tool: String,
    /// Run directories go here: runs/<run id>/ holds each server's log and telemetry.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Where the default models are (fetched here when missing).
    #[arg(long, env = "NOMAD_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Directory of the service binaries (default: the one holding `nomad`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Seconds the fleet may take to start.
    #[arg(long, default_value_t = 120.0)]
    pub ready_timeout: f64,
    /// Fail start-up when any tool cannot serve (a missing source, an environment that cannot
    /// install); without it the others serve and the failure is printed. A fleet none of whose
    /// tools can serve always fails.
    #[arg(long)]
    pub strict: bool,
}

/// `nomad up` from its arguments.
pub async fn command(args: UpArgs) -> anyhow::Result<Exit> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let ready_timeout =
        nomad_config::seconds("--ready-timeout", args.ready_timeout).map_err(anyhow::Error::msg)?;
    let tasks = if args.demo {
        Some(TaskSet::demo())
    } else {
        args.tasks
            .as_ref()
            .map(|path| -> anyhow::Result<TaskSet> {
                let read = |p: &PathBuf, what: &str| {
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {what} {}", p.display()))
                };
                Ok(TaskSet {
                    source: path.display().to_string(),
                    text: read(path, "tasks file")?,
                    template: args
                        .template
                        .as_ref()
                        .map(|t| read(t, "template"))
                        .transpose()?,
                    out: None,
                    show_traces: false,
                })
            })
            .transpose()?
    }
    .map(|set| TaskSet {
        out: args.out.clone(),
        ..set
    });
    up(UpOptions {
        config: args.config,
        workers: args.workers,
        runs_dir: args.runs_dir,
        models_dir: args.models_dir,
        bin_dir: args.bin_dir,
        tasks,
        concurrency: args.concurrency,
        embed_tool: args.embed_tool,
        ready_timeout,
        front: fleet::GatewayFront::Code,
        strict: args.strict,
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_tasks_parse_with_their_agent() {
        let tasks = tasks::parse(DEMO_TASKS, "demo", Some(DEMO_AGENT)).unwrap();
        assert_eq!(tasks.len(), 20);
        let kinds: std::collections::BTreeSet<&str> =
            tasks.iter().map(|t| t.verify.name()).collect();
        assert_eq!(kinds, ["exact", "numeric", "similarity"].into());
    }
}
