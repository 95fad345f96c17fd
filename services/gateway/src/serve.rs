//! Serving: the gateway built from its config (sandbox, upstreams, policy), then its gRPC
//! service and its MCP front end (Streamable HTTP or stdio) until a shutdown signal.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context as _;
use nomad_proto::v1::gateway_server::GatewayServer;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_rpc::{Service, StartOptions};
use nomad_telemetry::{ConsoleSink, InitOptions, ServerType};
use rmcp::ServiceExt as _;
use tokio::sync::watch;

use crate::{
    Args, config, direct, execute, grpc_service, mcp_http, mcp_server, sandbox, search, tasks,
    upstream,
};

pub async fn serve(args: Args) -> anyhow::Result<()> {
    let options = StartOptions {
        init: InitOptions {
            console_sink: if args.mcp_stdio {
                ConsoleSink::Stderr
            } else {
                ConsoleSink::Stdout
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let telemetry = Service::start_with(ServerType::Gateway, &args.service, options, |_| Ok(()))?;
    let file = &telemetry.config;
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

    let sandbox = sandbox::Sandbox::new(sandbox_config).await?;
    let tools_ttl = nomad_config::seconds(
        "gateway.tools_ttl_seconds",
        gateway_config.tools_ttl_seconds,
    )
    .map_err(anyhow::Error::msg)?;
    let changed = Arc::new(tokio::sync::Notify::new());
    let upstreams = Arc::new(upstream::Upstreams::new(
        upstream::nomad::Nomad::new(
            SchedulerClient::new(nomad_rpc::channel(&args.scheduler)?),
            tools_ttl,
            nomad_config::seconds(
                "gateway.scheduler_wait_seconds",
                gateway_config.scheduler_wait_seconds,
            )
            .map_err(anyhow::Error::msg)?,
            changed.clone(),
        ),
        servers
            .into_iter()
            .map(|(name, c)| {
                let timing = gateway_config
                    .timing(&name, &c)
                    .map_err(anyhow::Error::msg)?;
                let server =
                    upstream::mcp::McpServer::new(name.clone(), c, timing, changed.clone());
                Ok((name, server))
            })
            .collect::<anyhow::Result<_>>()?,
        upstream::policy::Policy::new(gateway_config.allowlist.clone(), gateway_config.redaction),
        changed,
    ));
    let search = search::ToolSearch::start(upstreams.clone(), &gateway_config.search, tools_ttl)
        .map_err(anyhow::Error::msg)?;
    let gateway = Arc::new(
        execute::Gateway::new(upstreams, search, sandbox, &gateway_config)
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
            let addr_file = args.service.addr_file.as_deref();
            let (listener, _) = telemetry
                .listen("nomad-gateway gRPC", &listen, addr_file)
                .await?;
            let mut server = nomad_rpc::RpcServer::new();
            server
                .routes()
                .add_service(GatewayServer::new(grpc_service::GatewayService {
                    gateway: gateway.clone(),
                }));
            Some(tokio::spawn(
                server.serve(listener, stopped(stop_rx.clone())),
            ))
        }
        None => None,
    };

    let tasks = tasks::Tasks::open(gateway_config.tasks.clone(), args.run_dir.as_deref())
        .context("gateway.tasks")?;
    let code = mcp_server::McpFrontEnd {
        gateway: gateway.clone(),
        tasks: tasks.clone(),
    };
    let tools = direct::DirectTools {
        gateway: gateway.clone(),
        tasks: tasks.clone(),
    };
    if args.mcp_stdio {
        tracing::info!(front = ?args.mcp_front, "nomad-gateway serving MCP on stdio");
        let stop = stopped(stop_rx.clone());
        match args.mcp_front {
            mcp_http::Front::Code => serve_stdio(code, stop).await?,
            mcp_http::Front::Tools => serve_stdio(tools, stop).await?,
        }
    } else {
        mcp_http::serve(
            code,
            tools,
            args.mcp_front,
            &args.mcp_listen,
            &gateway_config,
            args.mcp_addr_file.as_deref(),
            stopped(stop_rx.clone()),
        )
        .await?;
    }
    tasks.stop().await;
    if let Some(grpc) = grpc {
        grpc.await??;
    }
    gateway.sandbox.remove_directory();
    telemetry.stop().await;
    Ok(())
}

/// Serves `handler` on stdin/stdout until the client closes the session or the gateway stops.
async fn serve_stdio<H: rmcp::ServerHandler>(
    handler: H,
    stopped: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let running = handler
        .serve(rmcp::transport::stdio())
        .await
        .context("MCP over stdio")?;
    tokio::select! {
        _ = running.waiting() => {},
        _ = stopped => {},
    }
    Ok(())
}
