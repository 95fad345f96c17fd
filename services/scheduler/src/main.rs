//! `nomad-scheduler`: the tool manager. Serves the Scheduler gRPC API; device workers register
//! with it.

mod config;
mod driver;
mod metrics;
mod service;
mod workers;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use nomad_proto::v1::scheduler_server::SchedulerServer;
use nomad_telemetry::{InitOptions, ServerIdentity, ServerType};

#[derive(Parser)]
#[command(
    name = "nomad-scheduler",
    version,
    about = "Nomad scheduler (tool manager)"
)]
struct Args {
    /// Config file (YAML or TOML) with `tools:`, `tool_manager:` and `telemetry:`.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7002")]
    listen: String,
    /// Server name in telemetry (default: scheduler).
    #[arg(long)]
    server_name: Option<String>,
    /// Write the bound address here once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = nomad_rpc::runtime()
        .context("starting the runtime")
        .and_then(|rt| rt.block_on(serve(args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nomad-scheduler: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
    nomad_rpc::tls::configure_from(&file, true)?;
    let settings = nomad_telemetry::load_settings(&file)?;
    let manager: config::ToolManagerConfig = file.section("tool_manager")?;
    let tools = config::validate(file.section("tools")?, &manager)?;
    let identity = ServerIdentity::new(ServerType::Scheduler).named(args.server_name);
    let telemetry = nomad_telemetry::init(settings, &identity, InitOptions::default())?;
    if tools.is_empty() {
        tracing::warn!("no tools configured: every call will be rejected as unknown_tool");
    }

    let timing = manager.timing().map_err(anyhow::Error::msg)?;
    let registry = Arc::new(workers::WorkerRegistry::default());
    let published = Arc::new(std::sync::Mutex::new(metrics::Published::default()));
    let _gauges = metrics::gauges(published.clone(), registry.clone());
    let (driver, handle) = driver::Driver::new(
        tools.clone(),
        timing,
        registry.clone(),
        Arc::new(metrics::Metrics::new()),
        published,
    );
    let driving = tokio::spawn(driver.run());

    let interval = Duration::from_millis(u64::from(manager.heartbeat_interval_ms.max(50)));
    let reaper = {
        let registry = registry.clone();
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                for worker in registry.reap(interval * 3) {
                    tracing::warn!(worker_id = %worker.id, "worker missed its heartbeats: dropped");
                    handle
                        .worker_down(worker.generation, "it stopped heartbeating".into())
                        .await;
                }
            }
        })
    };

    let (listener, local) = nomad_rpc::bind(&args.listen).await?;
    if let Some(path) = &args.addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    tracing::info!("nomad-scheduler listening on {local}");
    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(SchedulerServer::new(service::SchedulerService {
            tools,
            driver: handle.clone(),
            workers: registry,
            heartbeat_interval_ms: manager.heartbeat_interval_ms.max(50),
        }));
    // On SIGINT/SIGTERM: refuse new requests (manager_closed), let accepted ones finish, then
    // stop serving once the in-flight calls have their answers.
    let closing = handle.clone();
    server
        .serve(listener, async move {
            nomad_rpc::shutdown_signal().await;
            tracing::info!("stopping: finishing accepted requests");
            closing.close().await;
        })
        .await?;
    handle.close().await;
    if tokio::time::timeout(Duration::from_secs(30), driving)
        .await
        .is_err()
    {
        tracing::warn!("requests still open after 30 s; stopping anyway");
    }
    reaper.abort();
    tracing::info!("shutting down");
    telemetry.shutdown(Duration::from_secs(5)).await;
    Ok(())
}
