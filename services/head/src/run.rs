//! `nomad run`: every task of a tasks JSONL file as one rollout through a gateway, one result
//! line per task.

use std::path::PathBuf;

use anyhow::Context as _;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_rpc::{Service, ServiceArgs, StartOptions};
use nomad_telemetry::ServerType;

use crate::rollouts::{self, Runner};
use crate::up::fleet_file::FleetFile;
use crate::{run_id, tasks};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Tasks file: one JSON object per line (the format is below).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Results file (JSONL); `-` writes to stdout. Default: with --fleet, the fleet's run's
    /// `results.jsonl` (appended to, so `nomad report` and `nomad top` count these rollouts);
    /// else `results.jsonl` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The gateway to send rollouts to (default: the fleet's, else 127.0.0.1:7001).
    #[arg(long, env = "NOMAD_GATEWAY")]
    pub gateway: Option<String>,
    /// A fleet that `nomad up` started (`runs/<run id>/fleet.json`): its gateway, token and run
    /// id.
    #[arg(long)]
    pub fleet: Option<PathBuf>,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Config file (YAML or TOML): its `telemetry:` and `tls:` sections.
    #[arg(long, env = "NOMAD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Python script for tasks that give `inputs`: it reads them as `TASK` and sets `RESULT`.
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    #[arg(long, default_value = "embed")]
    pub embed_tool: String,
}

/// Returns whether every rollout succeeded.
pub async fn run(args: RunArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");

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
    let fleet = match args.fleet.as_deref() {
        Some(path) => Some(FleetFile::read_running(path).await?),
        None => None,
    };
    let gateway = args
        .gateway
        .clone()
        .or_else(|| fleet.as_ref().map(|f| f.gateway.clone()))
        .unwrap_or_else(|| "127.0.0.1:7001".to_owned());
    // A fleet's rollouts go with its run; a file named on the command line is written afresh.
    let fleet_results = fleet
        .as_ref()
        .and_then(|f| f.run_dir.as_ref())
        .map(|dir| dir.join("results.jsonl"));
    let (out, append) = match (&args.out, fleet_results) {
        (Some(out), _) => (out.clone(), false),
        (None, Some(results)) => (results, true),
        (None, None) => (PathBuf::from("results.jsonl"), false),
    };
    let mut run_id = String::new();
    let mut options = StartOptions {
        serves: false,
        token: fleet.as_ref().and_then(|f| f.token.clone()),
        ..Default::default()
    };
    // A fleet's client exports where the fleet does, unless its environment says otherwise;
    // console lines go to a file of its own in the fleet's run directory, so `nomad traces`,
    // `report` and `top` see these rollouts beside the fleet's spans.
    if let Some(fleet) = &fleet {
        options.env_defaults = fleet.telemetry_env.clone().into_iter().collect();
        if let Some(run_dir) = &fleet.run_dir {
            options.init.console_sink = nomad_telemetry::ConsoleSink::File(
                run_dir.join(format!("run-{}.jsonl", std::process::id())),
            );
        }
    }
    // A client: no server name or address file of its own.
    let service_args = ServiceArgs {
        config: args.config.clone(),
        server_name: None,
        addr_file: None,
    };
    let service = Service::start_with(ServerType::Head, &service_args, options, |settings| {
        // The fleet's run id, unless the environment or the config names one.
        if settings.run_id.is_none() {
            settings.run_id = fleet.as_ref().map(|f| f.run_id.clone());
        }
        run_id = run_id::assign(settings, &nomad_config::ProcessEnv)?;
        Ok(())
    })?;
    // After the config is read (a bad one is named first), before any rollout: a gateway that
    // is not there is named once.
    if fleet.is_none()
        && let Err(e) = check_gateway(&gateway, args.gateway.is_some()).await
    {
        service.stop().await;
        return Err(e);
    }
    let total = tasks.len();
    eprintln!(
        "run {run_id}: {total} tasks, concurrency {}",
        args.concurrency
    );
    let runner = Runner::new(
        GatewayClient::new(nomad_rpc::channel(&gateway)?),
        run_id.clone(),
        args.concurrency,
        args.embed_tool.clone(),
    );
    let mut results = Vec::new();
    // Ctrl-C (or SIGTERM) stops the run: what runs ends as cancelled, and every task still gets
    // its line.
    let (stopper, stop) = rollouts::Stop::new();
    let ran = {
        let run = rollouts::run_to_file(&runner, tasks, &out, append, &mut results, &stop);
        tokio::pin!(run);
        tokio::select! {
            ran = &mut run => ran,
            () = nomad_rpc::shutdown_signal() => {
                stopper.stop("the run was interrupted (Ctrl-C or SIGTERM) before this rollout finished");
                run.await
            }
        }
    };
    service.stop().await;
    ran?;
    let failed = results.iter().filter(|r| r.status == "error").count();
    let cancelled = results.iter().filter(|r| r.status == "cancelled").count();
    eprintln!(
        "run {run_id}: {} ok, {failed} failed, {cancelled} cancelled; results in {}",
        total - failed - cancelled,
        out.display()
    );
    Ok(failed + cancelled == 0)
}

/// Fails before any rollout when no gateway answers at `address`, naming it and how to point
/// the run at a fleet: every rollout would otherwise wait for it and fail alike.
async fn check_gateway(address: &str, named: bool) -> anyhow::Result<()> {
    use crate::up::fleet_file::{Unanswered, gateway_answers};
    let why = match gateway_answers(address).await {
        Ok(()) => return Ok(()),
        Err(Unanswered::Refused(e)) => format!("refuses connections ({e})"),
        Err(Unanswered::Silent) => "did not accept a connection within 3 s".to_owned(),
    };
    let source = if named {
        "--gateway (or NOMAD_GATEWAY)"
    } else {
        "the default, as neither --fleet nor --gateway was given"
    };
    anyhow::bail!(
        "no gateway at {address} ({source}): it {why}. Start a fleet with `nomad up` and pass \
         --fleet runs/<run id>/fleet.json (`nomad status` lists running fleets), or give the \
         gateway's address with --gateway HOST:PORT"
    )
}
