//! `nomad`: the head. `nomad run` drives rollouts from a tasks JSONL file through the gateway.

mod driver;
mod run_id;
mod runs;
mod server;
mod tasks;
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
    about = "Nomad head: run rollouts against a Nomad fleet"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run every task of a tasks JSONL file as one rollout and write one result line per task.
    Run(RunArgs),
    /// Serve the Head gRPC API: start runs of rollouts and report on them.
    Serve(ServeArgs),
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
            Command::Run(args) => rt.block_on(run(args)),
            Command::Serve(args) => rt.block_on(serve(args)).map(|()| true),
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

    let mut out: Box<dyn Write> = if args.out.as_os_str() == "-" {
        Box::new(std::io::stdout())
    } else {
        Box::new(
            std::fs::File::create(&args.out)
                .with_context(|| format!("creating results file {}", args.out.display()))?,
        )
    };

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
    let mut progress = driver::Progress::new(total);
    let mut write_error = None;
    let results = driver
        .run(tasks, |result| {
            progress.record(result);
            if write_error.is_none() {
                let line = serde_json::to_string(result).expect("results serialize");
                if let Err(e) = writeln!(out, "{line}").and_then(|_| out.flush()) {
                    write_error = Some(e);
                }
            }
        })
        .await;
    telemetry.shutdown(Duration::from_secs(5)).await;
    if let Some(e) = write_error {
        anyhow::bail!("writing results to {}: {e}", args.out.display());
    }
    let failed = results.iter().filter(|r| r.status != "ok").count();
    eprintln!(
        "run {run_id}: {} ok, {failed} failed; results in {}",
        total - failed,
        args.out.display()
    );
    Ok(failed == 0)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
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
