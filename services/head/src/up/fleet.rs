//! Starting the fleet: the scheduler, the device workers and the gateway as supervised children,
//! each ready when its health check says so and every worker has registered.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_proto::v1::ListWorkersRequest;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::KeyValue;
use nomad_telemetry::startup::Startup;

use crate::supervisor::{ChildSpec, Supervisor};
use crate::up::run_dir::addr_file;

/// GPUs `nvidia-smi -L` lists; 0 when there is no such tool.
pub fn gpu_count() -> usize {
    std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

fn binary(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} is missing; build every service first (cargo build --workspace --bins) or pass --bin-dir",
        path.display()
    );
    Ok(path)
}

/// Checks each server's `grpc.health.v1` status and waits for `workers` registrations; each
/// wait is a `ready` phase of `startup`.
pub(crate) async fn wait_ready(
    sup: &mut Supervisor,
    addresses: &[(usize, String)],
    scheduler: &str,
    workers: usize,
    timeout: Duration,
    startup: &Startup,
) -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    let deadline = tokio::time::Instant::now() + timeout;
    for (index, address) in addresses {
        let phase = startup.phase(
            "ready",
            vec![KeyValue::new(
                "nomad.server.name",
                sup.name(*index).to_owned(),
            )],
        );
        let mut client = HealthClient::new(nomad_rpc::channel(address)?);
        loop {
            let status = client
                .check(HealthCheckRequest::default())
                .await
                .map(|r| r.into_inner().status);
            if matches!(status, Ok(s) if s == ServingStatus::Serving as i32) {
                break;
            }
            if let Some(exit) = sup.try_exit() {
                anyhow::bail!("{}", sup.report(&exit));
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{} at {address} is not serving after {timeout:?} ({status:?})",
                sup.name(*index)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        phase.end();
    }
    let _registered = startup.phase(
        "ready",
        vec![KeyValue::new("nomad.startup.workers", workers as i64)],
    );
    let mut client = SchedulerClient::new(nomad_rpc::channel(scheduler)?);
    loop {
        let registered = client
            .list_workers(ListWorkersRequest {})
            .await
            .map(|r| r.into_inner().workers.len())
            .unwrap_or(0);
        if registered >= workers {
            return Ok(());
        }
        if let Some(exit) = sup.try_exit() {
            anyhow::bail!("{}", sup.report(&exit));
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{registered} of {workers} device workers registered with the scheduler after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tools once described: those that cannot serve (with why), how many there are, and each
/// source that was pinned (its text as the config wrote it, and the digest or commit it named).
pub(crate) struct Described {
    pub failed: Vec<(String, String)>,
    pub total: usize,
    pub pins: Vec<(String, String)>,
}

/// Waits until the scheduler has described every tool (a Python model's environment may be
/// building).
pub(crate) async fn wait_described(
    sup: &mut Supervisor,
    scheduler: &str,
    timeout: Duration,
) -> anyhow::Result<Described> {
    use nomad_proto::v1::{ListToolsRequest, ToolState};
    let started = tokio::time::Instant::now();
    let deadline = started + timeout;
    let mut client = SchedulerClient::new(nomad_rpc::channel(scheduler)?);
    let mut told = false;
    loop {
        let tools = client
            .list_tools(ListToolsRequest {})
            .await
            .map(|r| r.into_inner().tools)
            .unwrap_or_default();
        let pending: Vec<&str> = tools
            .iter()
            .filter(|t| t.state() == ToolState::Pending)
            .map(|t| t.name.as_str())
            .collect();
        if pending.is_empty() {
            let total = tools.len();
            let pins = tools
                .iter()
                .filter(|t| !t.pinned_source.is_empty() && t.pinned_source != t.source)
                .map(|t| (t.source.clone(), t.pinned_source.clone()))
                .collect();
            let failed = tools
                .into_iter()
                .filter(|t| t.state() == ToolState::Failed)
                .map(|t| (t.name, t.error))
                .collect();
            return Ok(Described {
                failed,
                total,
                pins,
            });
        }
        // Only worth saying when it takes a while (an environment being built).
        if !told && started.elapsed() > Duration::from_secs(3) {
            eprintln!(
                "nomad: waiting for {} to be described (a Python model's environment is built \
                 once per host; see the device worker's log)",
                pending.join(", ")
            );
            told = true;
        }
        if let Some(exit) = sup.try_exit() {
            anyhow::bail!("{}", sup.report(&exit));
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "tools not described after {timeout:?}: {}",
            pending.join(", ")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A free loopback address for a child to listen on (gRPC, MCP, Prometheus), kept for its
/// restarts. Another process could take it before the child binds it; the child then fails at
/// start-up, naming the address.
pub fn free_loopback_address() -> anyhow::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
}

/// What the gateway's MCP endpoint offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayFront {
    /// Code mode at /mcp (and the tools at /tools) on a free loopback port.
    Code,
    /// The fleet's tools, each an MCP tool of its own, at /mcp on `listen` (`nomad serve -t http`).
    ToolsHttp { listen: String },
    /// The fleet's tools over the head's own stdin and stdout (`nomad serve`).
    ToolsStdio,
}

/// What to start, and where.
#[derive(Clone, Copy)]
pub struct FleetPlan<'a> {
    pub bin_dir: &'a Path,
    pub run_dir: &'a Path,
    pub config: &'a Path,
    pub env: &'a [(String, String)],
    pub workers: usize,
    /// Workers get `--device cuda:<i>` when there are GPUs.
    pub gpus: usize,
    pub timeout: Duration,
    /// Give each child a Prometheus endpoint on a free loopback port.
    pub prometheus: bool,
    pub front: &'a GatewayFront,
}

/// The started fleet's addresses, as written to `fleet.json`.
pub struct Addresses {
    pub scheduler: String,
    pub gateway: String,
    /// `/mcp`: code mode, or the fleet's tools under `nomad serve`; "stdio" over stdio.
    pub mcp_url: String,
    /// The fleet's tools, each an MCP tool of its own (none over stdio).
    pub tools_url: Option<String>,
    /// The OpenAI-compatible routes' base URL (none over stdio).
    pub openai_url: Option<String>,
    /// Each child's Prometheus endpoint (`name`, `IP:port`).
    pub prometheus: Vec<(String, String)>,
}

/// Starts every server, each spawn a `spawn` phase of `startup` whose context the server
/// continues (its own `nomad.server.startup` joins the head's start-up trace).
pub async fn start_fleet(
    sup: &mut Supervisor,
    plan: &FleetPlan<'_>,
    startup: &Startup,
) -> anyhow::Result<Addresses> {
    let FleetPlan {
        bin_dir,
        run_dir,
        config,
        env,
        workers,
        gpus,
        timeout,
        prometheus,
        front,
    } = *plan;
    let mut scrape = Vec::new();
    // Each spawn's span, open until the server listens: the server's start-up continues it.
    let mut spec =
        |name: &str, server_type: &'static str, program: &str, args: Vec<String>, stdio: bool| {
            let mut env = env.to_vec();
            let phase = startup.phase(
                "spawn",
                vec![KeyValue::new("nomad.server.name", name.to_owned())],
            );
            env.extend(nomad_telemetry::propagation::inject_env(phase.context()));
            if prometheus {
                let address = free_loopback_address()?;
                env.push(("NOMAD_OTEL_PROMETHEUS_LISTEN".into(), address.clone()));
                scrape.push((name.to_owned(), address));
            }
            let mut args = args;
            // A fixed address, so that a server started again is found where it was.
            args.extend([
                "--config".into(),
                config.display().to_string(),
                "--listen".into(),
                free_loopback_address()?,
                "--addr-file".into(),
                addr_file(run_dir, name).display().to_string(),
            ]);
            let mut ready_files = vec![addr_file(run_dir, name)];
            if server_type == "gateway" {
                ready_files.push(addr_file(run_dir, "gateway-mcp"));
            }
            let child = ChildSpec {
                name: name.into(),
                server_type,
                program: binary(bin_dir, program)?,
                args,
                env,
                stdio,
                ready_files,
                restart: true,
            };
            Ok::<_, anyhow::Error>((child, phase))
        };
    let (child, spawning) = spec("scheduler", "scheduler", "nomad-scheduler", vec![], false)?;
    let scheduler_index = sup.spawn(child)?;
    let scheduler = sup
        .wait_for_file(scheduler_index, &addr_file(run_dir, "scheduler"), timeout)
        .await?;
    spawning.end();
    let mut addresses = vec![(scheduler_index, scheduler.clone())];
    for i in 0..workers {
        let name = format!("device-worker-{i}");
        let mut args = vec![
            "--scheduler".into(),
            scheduler.clone(),
            "--worker-id".into(),
            format!("worker-{i}"),
        ];
        if gpus > 0 {
            args.extend(["--device".into(), format!("cuda:{i}")]);
        }
        let (child, spawning) = spec(&name, "device-worker", "nomad-device-worker", args, false)?;
        let index = sup.spawn(child)?;
        let address = sup
            .wait_for_file(index, &addr_file(run_dir, &name), timeout)
            .await?;
        spawning.end();
        addresses.push((index, address));
    }
    // `nomad serve -t http` listens only once every tool is described, so that a client's
    // first call finds its tool (a Python model's environment may take minutes to build).
    if matches!(front, GatewayFront::ToolsHttp { .. }) {
        wait_described(sup, &scheduler, super::DESCRIBED_WITHIN).await?;
    }
    let mcp_addr_file = addr_file(run_dir, "gateway-mcp");
    // The task store is kept in the run directory, so a gateway started again finds it.
    let mut args = vec![
        "--scheduler".into(),
        scheduler.clone(),
        "--run-dir".into(),
        run_dir.display().to_string(),
    ];
    let code_listen = free_loopback_address()?;
    let listen = match front {
        GatewayFront::Code => Some(code_listen.as_str()),
        GatewayFront::ToolsHttp { listen } => Some(listen.as_str()),
        GatewayFront::ToolsStdio => None,
    };
    match listen {
        Some(listen) => args.extend([
            "--mcp-listen".into(),
            listen.to_owned(),
            "--mcp-addr-file".into(),
            mcp_addr_file.display().to_string(),
        ]),
        None => args.push("--mcp-stdio".into()),
    }
    if *front != GatewayFront::Code {
        args.extend(["--mcp-front".into(), "tools".into()]);
    }
    let stdio = *front == GatewayFront::ToolsStdio;
    let (child, spawning) = spec("gateway", "gateway", "nomad-gateway", args, stdio)?;
    let gateway_index = sup.spawn(child)?;
    let gateway = sup
        .wait_for_file(gateway_index, &addr_file(run_dir, "gateway"), timeout)
        .await?;
    spawning.end();
    let mcp = match listen {
        Some(_) => Some(
            sup.wait_for_file(gateway_index, &mcp_addr_file, timeout)
                .await?,
        ),
        None => None,
    };
    addresses.push((gateway_index, gateway.clone()));
    wait_ready(sup, &addresses, &scheduler, workers, timeout, startup).await?;
    Ok(Addresses {
        scheduler,
        gateway,
        mcp_url: match &mcp {
            Some(mcp) => format!("http://{mcp}/mcp"),
            None => "stdio".into(),
        },
        tools_url: mcp.as_ref().map(|mcp| format!("http://{mcp}/tools")),
        openai_url: mcp.map(|mcp| format!("http://{mcp}/v1")),
        prometheus: scrape,
    })
}
