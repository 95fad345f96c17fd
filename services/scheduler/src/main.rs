//! `nomad-scheduler`: the tool manager (rules in `nomad-scheduler-core`, run by `driver`).

mod catalog;
mod config;
mod driver;
mod error;
mod grpc_service;
mod metrics;
mod recent;
mod workers;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use nomad_proto::v1::scheduler_server::SchedulerServer;
use nomad_rpc::{Service, ServiceArgs};
use nomad_telemetry::ServerType;

/// Nomad scheduler (tool manager)
#[derive(Parser)]
#[command(name = "nomad-scheduler", version)]
struct Args {
    #[command(flatten)]
    service: ServiceArgs,
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7002")]
    listen: String,
    /// Check the config's tools and exit (0, or 2 saying what is wrong); `nomad up` runs it.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match args.check {
        true => config::check(args.service.config.as_deref()),
        false => nomad_rpc::bootstrap::main("nomad-scheduler", 1, || serve(args)),
    }
}

async fn serve(args: Args) -> anyhow::Result<ExitCode> {
    let service = Service::start(ServerType::Scheduler, &args.service)?;
    let manager: config::ToolManagerConfig = service.config.section("tool_manager")?;
    let tools = config::load_tools(&service.config, &manager)?;
    let registry = Arc::new(workers::WorkerRegistry::default());
    let deadlines = manager.deadlines().map_err(anyhow::Error::msg)?;
    let driver = driver::start(tools.clone(), &manager, registry.clone())?;
    let handle = driver.handle.clone();
    let reaper = tokio::spawn(driver::reap(
        registry.clone(),
        handle.clone(),
        manager.heartbeat(),
    ));
    let catalog = Arc::new(catalog::Catalog::new(tools, deadlines.prepare));
    let addr_file = args.service.addr_file.as_deref();
    let (listener, _) = service
        .listen("nomad-scheduler", &args.listen, addr_file)
        .await?;
    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(SchedulerServer::new(grpc_service::SchedulerService::new(
            catalog, &driver, registry, &manager,
        )));
    // On SIGINT/SIGTERM: refuse new requests, let accepted ones finish, then stop serving.
    let closing = handle.clone();
    let stop = async move {
        nomad_rpc::shutdown_signal().await;
        tracing::info!("stopping: finishing accepted requests");
        closing.close().await;
    };
    server.serve(listener, stop).await?;
    driver.finish(Duration::from_secs(30)).await;
    reaper.abort();
    service.stop().await;
    Ok(ExitCode::SUCCESS)
}
