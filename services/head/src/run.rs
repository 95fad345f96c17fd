//! `nomad run`: every task of a tasks JSONL file as one rollout through a gateway, one result
//! line per task.

use std::path::PathBuf;

use anyhow::Context as _;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_rpc::{Service, ServiceArgs, StartOptions};
use nomad_telemetry::ServerType;

use crate::rollouts::{self, Runner};
use crate::{run_id, tasks};

#[derive(clap::Args)]
pub struct RunArgs {
    /// Tasks file: one JSON object per line ({"id", "tool", "arguments", "server"?}).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Results file (JSONL); `-` writes to stdout.
    #[arg(long, default_value = "results.jsonl")]
    pub out: PathBuf,
    /// The gateway to send rollouts to.
    #[arg(long, env = "NOMAD_GATEWAY", default_value = "127.0.0.1:7001")]
    pub gateway: String,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    #[command(flatten)]
    pub service: ServiceArgs,
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
    let mut run_id = String::new();
    let options = StartOptions {
        serves: false,
        ..Default::default()
    };
    let service = Service::start_with(ServerType::Head, &args.service, options, |settings| {
        run_id = run_id::assign(settings, &nomad_config::ProcessEnv)?;
        Ok(())
    })?;
    let total = tasks.len();
    eprintln!(
        "run {run_id}: {total} tasks, concurrency {}",
        args.concurrency
    );
    let runner = Runner::new(
        GatewayClient::new(nomad_rpc::channel(&args.gateway)?),
        run_id.clone(),
        args.concurrency,
        args.embed_tool.clone(),
    );
    let results = rollouts::run_to_file(&runner, tasks, &args.out).await;
    service.stop().await;
    let results = results?;
    let failed = results.iter().filter(|r| r.status != "ok").count();
    eprintln!(
        "run {run_id}: {} ok, {failed} failed; results in {}",
        total - failed,
        args.out.display()
    );
    Ok(failed == 0)
}
