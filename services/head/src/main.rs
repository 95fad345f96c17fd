//! `nomad`: the head. `nomad up` starts a fleet, `nomad run` drives rollouts from a tasks JSONL
//! file through its gateway, `nomad traces` shows a run's rollouts.

mod driver;
mod memory;
mod run_id;
mod runs;
mod server;
mod supervisor;
mod tasks;
mod traces;
mod up;
mod verify;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_telemetry::{InitOptions, ServerIdentity, ServerType};

#[derive(Parser)]
#[command(
    name = "nomad",
    version,
    about = "Nomad head: start a fleet, run rollouts against it, and read their traces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the fleet (scheduler, device workers, gateway) as child processes; with --demo or
    /// --tasks, run a task set through it, then stop.
    Up(UpArgs),
    /// Run every task of a tasks JSONL file as one rollout and write one result line per task.
    Run(RunArgs),
    /// Serve the Head gRPC API: start runs of rollouts and report on them.
    Serve(ServeArgs),
    /// Show a run's rollouts as waterfall trees of their spans, slowest first.
    Traces(TracesArgs),
    /// Check a Nomad server's gRPC health (exit 0 when serving): for container health checks.
    Health {
        /// The server's address, e.g. 127.0.0.1:7002.
        address: String,
    },
}

#[derive(clap::Args)]
struct UpArgs {
    /// Fleet config (YAML or TOML): tools, and the `telemetry:` block every server reads.
    /// Default: the `embed` and `generate` tools on the models of scripts/fetch-models.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// CPU device workers to start (default: one per GPU that nvidia-smi lists, else one).
    #[arg(long)]
    workers: Option<usize>,
    /// Fetch the default models if missing, run the bundled demo tasks, print a summary and
    /// the run's traces, then stop.
    #[arg(long, conflicts_with = "tasks")]
    demo: bool,
    /// Run this tasks JSONL file through the fleet, then stop.
    #[arg(long)]
    tasks: Option<PathBuf>,
    /// Python script for tasks that give `inputs` (with --tasks).
    #[arg(long, requires = "tasks")]
    template: Option<PathBuf>,
    /// Results file (default: results.jsonl in the run directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    #[arg(long, default_value = "embed")]
    embed_tool: String,
    /// Run directories go here: runs/<run id>/ holds each server's log and telemetry.
    #[arg(long, default_value = "runs")]
    runs_dir: PathBuf,
    /// Where the default models are (fetched here when missing).
    #[arg(long, env = "NOMAD_MODELS_DIR", default_value = "models")]
    models_dir: PathBuf,
    /// Directory of the service binaries (default: the one holding `nomad`).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Seconds the fleet may take to start.
    #[arg(long, default_value_t = 120.0)]
    ready_timeout: f64,
}

#[derive(clap::Args)]
struct TracesArgs {
    /// The run id (`nomad.run.id`).
    run_id: String,
    /// A run directory of console-exporter files (default: runs/<RUN_ID>).
    #[arg(long, conflicts_with = "jaeger")]
    from: Option<PathBuf>,
    /// Query Jaeger's api_v3 gRPC QueryService at this address (e.g. 127.0.0.1:16685).
    #[arg(long)]
    jaeger: Option<String>,
    /// How far back to search Jaeger, in hours.
    #[arg(long, default_value_t = 24.0)]
    lookback_hours: f64,
    /// Most traces Jaeger is asked for.
    #[arg(long, default_value_t = 1000)]
    search_depth: i32,
    /// Print every rollout with its spans as JSON.
    #[arg(long)]
    json: bool,
    /// Waterfalls to print (the slowest rollouts).
    #[arg(long, default_value_t = 5)]
    limit: usize,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7000")]
    listen: String,
    /// The gateway to send rollouts to.
    #[arg(long, env = "NOMAD_GATEWAY", default_value = "127.0.0.1:7001")]
    gateway: String,
    /// Rollouts in flight per run when StartRun does not say.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Config file (YAML or TOML); its `telemetry:` block configures export.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Write the bound address here once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Tasks file: one JSON object per line ({"id", "tool", "arguments", "server"?}).
    #[arg(long)]
    tasks: PathBuf,
    /// Results file (JSONL); `-` writes to stdout.
    #[arg(long, default_value = "results.jsonl")]
    out: PathBuf,
    /// The gateway to send rollouts to.
    #[arg(long, env = "NOMAD_GATEWAY", default_value = "127.0.0.1:7001")]
    gateway: String,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Config file (YAML or TOML); its `telemetry:` block configures export.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Python script for tasks that give `inputs`: it reads them as `TASK` and sets `RESULT`.
    #[arg(long)]
    template: Option<PathBuf>,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    #[arg(long, default_value = "embed")]
    embed_tool: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = nomad_rpc::runtime()
        .context("starting the runtime")
        .and_then(|rt| match cli.command {
            Command::Up(args) => rt.block_on(up(args)),
            Command::Run(args) => rt.block_on(run(args)),
            Command::Serve(args) => rt.block_on(serve(args)).map(|()| true),
            Command::Traces(args) => rt.block_on(show_traces(args)),
            Command::Health { address } => rt.block_on(health(&address)),
        });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nomad: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Returns whether every rollout succeeded.
async fn run(args: RunArgs) -> anyhow::Result<bool> {
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
    nomad_rpc::tls::configure_from(&file, false)?;
    let mut settings = nomad_telemetry::load_settings(&file)?;
    let run_id = run_id::resolve(settings.run_id.as_deref(), &nomad_config::ProcessEnv);
    settings.run_id = Some(run_id.clone());

    let text = std::fs::read_to_string(&args.tasks)
        .with_context(|| format!("reading tasks file {}", args.tasks.display()))?;
    let template = args
        .template
        .as_ref()
        .map(|p| {
            std::fs::read_to_string(p).with_context(|| format!("reading template {}", p.display()))
        })
        .transpose()?;
    let tasks = tasks::parse(
        &text,
        &args.tasks.display().to_string(),
        template.as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");

    let identity = ServerIdentity::new(ServerType::Head);
    let telemetry = nomad_telemetry::init(settings, &identity, InitOptions::default())?;
    let total = tasks.len();
    eprintln!(
        "run {run_id}: {total} tasks, concurrency {}",
        args.concurrency
    );
    let driver = driver::Driver::new(
        GatewayClient::new(nomad_rpc::channel(&args.gateway)?),
        run_id.clone(),
        args.concurrency,
        args.embed_tool.clone(),
    );
    let results = run_tasks(&driver, tasks, &args.out).await;
    telemetry.shutdown(Duration::from_secs(5)).await;
    let results = results?;
    let failed = results.iter().filter(|r| r.status != "ok").count();
    eprintln!(
        "run {run_id}: {} ok, {failed} failed; results in {}",
        total - failed,
        args.out.display()
    );
    Ok(failed == 0)
}

/// Runs `tasks` with a progress bar, writing each result to `out` (`-`: stdout) as it comes.
pub(crate) async fn run_tasks(
    driver: &driver::Driver,
    tasks: Vec<tasks::Task>,
    out: &std::path::Path,
) -> anyhow::Result<Vec<driver::RolloutResult>> {
    let mut sink: Box<dyn Write + Send> = if out.as_os_str() == "-" {
        Box::new(std::io::stdout())
    } else {
        Box::new(
            std::fs::File::create(out)
                .with_context(|| format!("creating results file {}", out.display()))?,
        )
    };
    let mut progress = driver::Progress::new(tasks.len());
    let mut write_error = None;
    let results = driver
        .run(tasks, |result| {
            progress.record(result);
            if write_error.is_none() {
                let line = serde_json::to_string(result).expect("results serialize");
                if let Err(e) = writeln!(sink, "{line}").and_then(|_| sink.flush()) {
                    write_error = Some(e);
                }
            }
        })
        .await;
    if let Some(e) = write_error {
        anyhow::bail!("writing results to {}: {e}", out.display());
    }
    Ok(results)
}

async fn up(args: UpArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let ready_timeout = Duration::try_from_secs_f64(args.ready_timeout)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--ready-timeout must be a positive number of seconds"))?;
    let tasks = if args.demo {
        Some(up::TaskSet::demo())
    } else {
        args.tasks
            .as_ref()
            .map(|path| -> anyhow::Result<up::TaskSet> {
                let read = |p: &PathBuf, what: &str| {
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {what} {}", p.display()))
                };
                Ok(up::TaskSet {
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
    .map(|set| up::TaskSet {
        out: args.out.clone(),
        ..set
    });
    up::up(up::UpOptions {
        config: args.config,
        workers: args.workers,
        runs_dir: args.runs_dir,
        models_dir: args.models_dir,
        bin_dir: args.bin_dir,
        tasks,
        concurrency: args.concurrency,
        embed_tool: args.embed_tool,
        ready_timeout,
    })
    .await
}

/// Returns whether the run has any rollouts.
async fn show_traces(args: TracesArgs) -> anyhow::Result<bool> {
    let spans = match &args.jaeger {
        Some(url) => {
            let lookback = Duration::try_from_secs_f64(args.lookback_hours * 3600.0)
                .ok()
                .filter(|d| !d.is_zero() && *d < Duration::from_secs(100 * 365 * 86_400))
                .ok_or_else(|| {
                    anyhow::anyhow!("--lookback-hours must be a positive number of hours")
                })?;
            anyhow::ensure!(args.search_depth > 0, "--search-depth must be at least 1");
            traces::load_jaeger(url, &args.run_id, lookback, args.search_depth).await?
        }
        None => {
            let dir = args
                .from
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(&args.run_id));
            traces::load_dir(&dir)?
        }
    };
    let rollouts = traces::rollouts(spans, &args.run_id);
    if rollouts.is_empty() {
        eprintln!("no rollouts of run {} found", args.run_id);
        return Ok(false);
    }
    traces::print(&rollouts, args.json, args.limit);
    Ok(true)
}

/// Whether the server at `address` reports SERVING within 5 s.
async fn health(address: &str) -> anyhow::Result<bool> {
    // Over TLS when NOMAD_TLS_CA is set.
    nomad_rpc::tls::configure_from(&nomad_config::ConfigFile::default(), false)?;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let mut client = HealthClient::new(nomad_rpc::channel(address)?);
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        client.check(HealthCheckRequest::default()),
    )
    .await;
    match reply {
        Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32 => Ok(true),
        Ok(Ok(r)) => {
            eprintln!("{address}: {:?}", r.get_ref().status());
            Ok(false)
        }
        Ok(Err(status)) => {
            eprintln!("{address}: {}", status.message());
            Ok(false)
        }
        Err(_) => {
            eprintln!("{address}: no answer within 5 s");
            Ok(false)
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
    nomad_rpc::tls::configure_from(&file, true)?;
    let settings = nomad_telemetry::load_settings(&file)?;
    let identity = ServerIdentity::new(ServerType::Head);
    let telemetry = nomad_telemetry::init(settings, &identity, InitOptions::default())?;

    let (listener, local) = nomad_rpc::bind(&args.listen).await?;
    if let Some(path) = &args.addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    tracing::info!("nomad head listening on {local}");
    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(nomad_proto::v1::head_server::HeadServer::new(
            server::HeadService {
                gateway: GatewayClient::new(nomad_rpc::channel(&args.gateway)?),
                runs: runs::RunRegistry::default(),
                default_concurrency: args.concurrency,
            },
        ));
    server.serve(listener, nomad_rpc::shutdown_signal()).await?;
    tracing::info!("shutting down");
    telemetry.shutdown(Duration::from_secs(5)).await;
    Ok(())
}
