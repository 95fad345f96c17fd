//! `nomad head`: the Head gRPC API (start runs, report on them).

use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::head_server::HeadServer;
use nomad_rpc::{Service, ServiceArgs};
use nomad_telemetry::ServerType;

use crate::{grpc_service, run_registry};

#[derive(clap::Args)]
pub struct HeadArgs {
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub listen: String,
    /// The gateway to send rollouts to.
    #[arg(long, env = "NOMAD_GATEWAY", default_value = "127.0.0.1:7001")]
    pub gateway: String,
    /// Rollouts in flight per run when StartRun does not say.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    #[command(flatten)]
    pub service: ServiceArgs,
}

pub async fn serve(args: HeadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let service = Service::start(ServerType::Head, &args.service)?;
    let addr_file = args.service.addr_file.as_deref();
    let (listener, _) = service
        .listen("nomad head", &args.listen, addr_file)
        .await?;
    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(HeadServer::new(grpc_service::HeadService {
            gateway: GatewayClient::new(nomad_rpc::channel(&args.gateway)?),
            runs: run_registry::RunRegistry::new(service.config.section("head")?),
            default_concurrency: args.concurrency,
        }));
    server.serve(listener, nomad_rpc::shutdown_signal()).await?;
    service.stop().await;
    Ok(())
}
