//! `nomad-gateway`: the code-mode gateway. Serves the Gateway gRPC API and calls upstream tools
//! (the scheduler's, as the built-in `nomad` server).

mod nomad_tools;
mod service;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use nomad_proto::v1::gateway_server::GatewayServer;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::{InitOptions, ServerIdentity, ServerType};

#[derive(Parser)]
#[command(name = "nomad-gateway", version, about = "Nomad code-mode gateway")]
struct Args {
    /// Config file (YAML or TOML); its `telemetry:` block configures export.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7001")]
    listen: String,
    /// The scheduler serving the built-in `nomad` tools.
    #[arg(long, env = "NOMAD_SCHEDULER", default_value = "127.0.0.1:7002")]
    scheduler: String,
    /// Server name in telemetry (default: gateway).
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
            eprintln!("nomad-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
    let settings = nomad_telemetry::load_settings(&file)?;
    let identity = ServerIdentity::new(ServerType::Gateway).named(args.server_name);
    let telemetry = nomad_telemetry::init(settings, &identity, InitOptions::default())?;

    let scheduler = SchedulerClient::new(nomad_rpc::channel(&args.scheduler)?);
    let (listener, local) = nomad_rpc::bind(&args.listen).await?;
    if let Some(path) = &args.addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    tracing::info!("nomad-gateway listening on {local}");
    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(GatewayServer::new(service::GatewayService::new(scheduler)));
    server.serve(listener, nomad_rpc::shutdown_signal()).await?;
    tracing::info!("shutting down");
    telemetry.shutdown(Duration::from_secs(5)).await;
    Ok(())
}
