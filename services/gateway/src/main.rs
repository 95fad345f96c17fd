//! `nomad-gateway`: the code-mode gateway. An MCP server (Streamable HTTP and stdio) and a gRPC
//! service exposing search, sandboxed code execution and tool calls over the upstream tools: the
//! scheduler's (as the built-in `nomad` server) and external MCP servers.

mod config;
mod execute;
mod mcp_server;
mod sandbox;
mod schema;
mod service;
mod upstream;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use nomad_proto::v1::gateway_server::GatewayServer;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::{ConsoleSink, InitOptions, ServerIdentity, ServerType};
use rmcp::ServiceExt as _;
use tokio::sync::watch;

#[derive(Parser)]
#[command(name = "nomad-gateway", version, about = "Nomad code-mode gateway")]
struct Args {
    /// Config file (YAML or TOML) with `gateway:`, `servers:`, `sandbox:` and `telemetry:`.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve gRPC on (default 127.0.0.1:7001; none with --mcp-stdio unless given).
    #[arg(long)]
    listen: Option<String>,
    /// Address to serve MCP over Streamable HTTP on, at /mcp.
    #[arg(long, default_value = "127.0.0.1:7010")]
    mcp_listen: String,
    /// Serve MCP over stdin/stdout instead of HTTP (logs and console telemetry go to stderr).
    #[arg(long)]
    mcp_stdio: bool,
    /// The scheduler serving the built-in `nomad` tools.
    #[arg(long, env = "NOMAD_SCHEDULER", default_value = "127.0.0.1:7002")]
    scheduler: String,
    /// Server name in telemetry (default: gateway).
    #[arg(long)]
    server_name: Option<String>,
    /// Write the bound gRPC address here once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Write the bound MCP HTTP address here once listening.
    #[arg(long)]
    mcp_addr_file: Option<PathBuf>,
}

fn main() -> ExitCode {
    // The first process of every sandboxed run is this binary in its own mode (see
    // `sandbox::init`): checked before anything else is set up.
    let mut raw = std::env::args_os();
    if raw.nth(1).as_deref() == Some(std::ffi::OsStr::new(sandbox::init::ARG)) {
        let spec = raw.next().unwrap_or_default();
        sandbox::init::main(&spec);
    }
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
    nomad_rpc::tls::configure_from(&file, true)?;
    let settings = nomad_telemetry::load_settings(&file)?;
    let gateway_config: config::GatewayConfig = file.section("gateway")?;
    let servers: BTreeMap<String, config::ServerConfig> = file.section("servers")?;
    let sandbox_config: sandbox::SandboxConfig = file.section("sandbox")?;
    for (name, server) in &servers {
        server.check(name).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            name != upstream::nomad::NAME,
            "servers.nomad: the name `nomad` is the built-in server"
        );
    }
    let token = std::env::var("NOMAD_GATEWAY_TOKEN")
        .ok()
        .or(gateway_config.token.clone());

    let identity = ServerIdentity::new(ServerType::Gateway).named(args.server_name);
    let options = InitOptions {
        console_sink: if args.mcp_stdio {
            ConsoleSink::Stderr
        } else {
            ConsoleSink::Stdout
        },
    };
    let telemetry = nomad_telemetry::init(settings, &identity, options)?;

    let sandbox = sandbox::Sandbox::new(sandbox_config).await?;
    let upstreams = upstream::Upstreams::new(
        upstream::nomad::Nomad {
            scheduler: SchedulerClient::new(nomad_rpc::channel(&args.scheduler)?),
        },
        servers
            .into_iter()
            .map(|(name, c)| (name.clone(), upstream::mcp::McpServer::new(name, c)))
            .collect(),
        upstream::policy::Policy::new(gateway_config.allowlist.clone(), gateway_config.redaction),
    );
    let gateway = Arc::new(
        execute::Gateway::new(upstreams, sandbox, gateway_config.workspace_root.clone())
            .context("gateway.workspace_root")?,
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        nomad_rpc::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let grpc_listen = args
        .listen
        .clone()
        .or_else(|| (!args.mcp_stdio).then(|| "127.0.0.1:7001".to_owned()));
    let grpc = match grpc_listen {
        Some(listen) => {
            let (listener, local) = nomad_rpc::bind(&listen).await?;
            if let Some(path) = &args.addr_file {
                nomad_rpc::write_addr_file(path, local)?;
            }
            tracing::info!("nomad-gateway gRPC listening on {local}");
            let mut server = nomad_rpc::RpcServer::new();
            server
                .routes()
                .add_service(GatewayServer::new(service::GatewayService {
                    gateway: gateway.clone(),
                }));
            Some(tokio::spawn(
                server.serve(listener, stopped(stop_rx.clone())),
            ))
        }
        None => None,
    };

    let front = mcp_server::McpFrontEnd {
        gateway: gateway.clone(),
    };
    if args.mcp_stdio {
        tracing::info!("nomad-gateway serving MCP on stdio");
        let running = front
            .serve(rmcp::transport::stdio())
            .await
            .context("MCP over stdio")?;
        tokio::select! {
            _ = running.waiting() => {},
            _ = stopped(stop_rx.clone()) => {},
        }
    } else {
        serve_mcp_http(
            front,
            &args.mcp_listen,
            token,
            args.mcp_addr_file.as_deref(),
            stopped(stop_rx.clone()),
        )
        .await?;
    }
    if let Some(grpc) = grpc {
        grpc.await??;
    }
    tracing::info!("shutting down");
    gateway.sandbox.remove_directory();
    telemetry.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

/// Streamable HTTP at `/mcp`. Without a token it only binds loopback addresses.
async fn serve_mcp_http(
    front: mcp_server::McpFrontEnd,
    listen: &str,
    token: Option<String>,
    addr_file: Option<&std::path::Path>,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let (listener, local) = nomad_rpc::bind(listen).await?;
    anyhow::ensure!(
        token.is_some() || local.ip().is_loopback(),
        "the MCP endpoint would listen on {local} with no token: set gateway.token or \
         NOMAD_GATEWAY_TOKEN, or listen on a loopback address"
    );
    if let Some(path) = addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    let service = StreamableHttpService::new(
        move || Ok(front.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service).layer(
        axum::middleware::from_fn_with_state(Arc::new(token), bearer_auth),
    );
    tracing::info!("nomad-gateway MCP (Streamable HTTP) listening on http://{local}/mcp");
    axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await?;
    let _: SocketAddr = local;
    Ok(())
}

/// 401 unless the request carries `Authorization: Bearer <token>` (when a token is set).
async fn bearer_auth(
    axum::extract::State(token): axum::extract::State<Arc<Option<String>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    if let Some(expected) = token.as_deref() {
        let given = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time compare: a mismatch takes as long wherever it is.
        let ok = given.is_some_and(|g| {
            g.len() == expected.len()
                && g.bytes()
                    .zip(expected.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            return (
                http::StatusCode::UNAUTHORIZED,
                [(http::header::WWW_AUTHENTICATE, "Bearer")],
                "missing or wrong bearer token",
            )
                .into_response();
        }
    }
    next.run(request).await
}
