//! Starting the fleet: the scheduler, the device workers and the gateway as supervised children,
//! each ready when its health check says so and every worker has registered.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_proto::v1::ListWorkersRequest;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::KeyValue;
use nomad_telemetry::startup::Startup;

use crate::supervisor::{ChildSpec, Supervisor};

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

/// A free loopback port for a child's Prometheus endpoint. Another process could take it
/// before the child binds it; the child then fails at start-up, naming the address.
pub fn free_loopback_address() -> anyhow::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
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
}

/// The started fleet's addresses, as written to `fleet.json`.
pub struct Addresses {
    pub scheduler: String,
    pub gateway: String,
    pub mcp_url: String,
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
    } = *plan;
    let addr_file = |name: &str| run_dir.join(format!("{name}.addr"));
    let mut scrape = Vec::new();
    // Each spawn's span, open until the server listens: the server's start-up continues it.
    let mut spec = |name: &str, server_type: &'static str, program: &str, args: Vec<String>| {
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
        args.extend([
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--addr-file".into(),
            addr_file(name).display().to_string(),
        ]);
        let child = ChildSpec {
            name: name.into(),
            server_type,
            program: binary(bin_dir, program)?,
            args,
            env,
        };
        Ok::<_, anyhow::Error>((child, phase))
    };
    let (child, spawning) = spec("scheduler", "scheduler", "nomad-scheduler", vec![])?;
    let scheduler_index = sup.spawn(child)?;
    let scheduler = sup
        .wait_for_file(scheduler_index, &addr_file("scheduler"), timeout)
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
        let (child, spawning) = spec(&name, "device-worker", "nomad-device-worker", args)?;
        let index = sup.spawn(child)?;
        let address = sup.wait_for_file(index, &addr_file(&name), timeout).await?;
        spawning.end();
        addresses.push((index, address));
    }
    let mcp_addr_file = run_dir.join("gateway-mcp.addr");
    let (child, spawning) = spec(
        "gateway",
        "gateway",
        "nomad-gateway",
        vec![
            "--scheduler".into(),
            scheduler.clone(),
            "--mcp-listen".into(),
            "127.0.0.1:0".into(),
            "--mcp-addr-file".into(),
            mcp_addr_file.display().to_string(),
        ],
    )?;
    let gateway_index = sup.spawn(child)?;
    let gateway = sup
        .wait_for_file(gateway_index, &addr_file("gateway"), timeout)
        .await?;
    spawning.end();
    let mcp = sup
        .wait_for_file(gateway_index, &mcp_addr_file, timeout)
        .await?;
    addresses.push((gateway_index, gateway.clone()));
    wait_ready(sup, &addresses, &scheduler, workers, timeout, startup).await?;
    Ok(Addresses {
        scheduler,
        gateway,
        mcp_url: format!("http://{mcp}/mcp"),
        prometheus: scrape,
    })
}
