//! A Nomad fleet of real processes on loopback: scheduler, one device worker, gateway; and the
//! head run against it. Each process's stdout and stderr go to files in a temp directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_proto::v1::ListWorkersRequest;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::process::{binary, clean, clean_at, listening, send_signal, wait_for_file};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    Head,
    Gateway,
    Scheduler,
    DeviceWorker,
}

impl Service {
    pub fn binary(self) -> &'static str {
        match self {
            Service::Head => "nomad",
            Service::Gateway => "nomad-gateway",
            Service::Scheduler => "nomad-scheduler",
            Service::DeviceWorker => "nomad-device-worker",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Service::Head => "head",
            Service::Gateway => "gateway",
            Service::Scheduler => "scheduler",
            Service::DeviceWorker => "device-worker",
        }
    }
}

/// The token of fleets started with `FleetOptions::auth` (and sent by [`rpc_channel`]).
pub const TEST_TOKEN: &str = "nomad-test-token-0123456789abcdef";

/// A channel that carries [`TEST_TOKEN`] (a server without a token ignores it), as every Nomad
/// client dials.
/// Awaits `calls` while reading the scheduler's snapshot every 250 ms; returns their output and
/// the largest mean batch size of `tool` seen. The snapshot covers the last 10 s only, and a
/// loaded machine can take longer than that from the batches to the end of `calls`.
pub async fn batched_while<T>(
    scheduler: &mut SchedulerClient<nomad_rpc::Channel>,
    tool: &str,
    calls: impl std::future::Future<Output = T>,
) -> (T, f64) {
    tokio::pin!(calls);
    let mut biggest = 0.0f64;
    loop {
        tokio::select! {
            output = &mut calls => return (output, biggest),
            () = tokio::time::sleep(Duration::from_millis(250)) => {
                let snapshot = scheduler
                    .snapshot(nomad_proto::v1::SchedulerSnapshotRequest {})
                    .await
                    .expect("the scheduler's snapshot")
                    .into_inner();
                let seen = snapshot.tools.iter().find(|t| t.name == tool);
                biggest = biggest.max(seen.map_or(0.0, |t| t.recent_batch_size));
            }
        }
    }
}

pub fn rpc_channel(addr: &str) -> nomad_rpc::Channel {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let _ = nomad_rpc::auth::install(nomad_rpc::auth::Auth {
            token: Some(TEST_TOKEN.into()),
            ..Default::default()
        });
    });
    nomad_rpc::channel(addr).expect("a valid address")
}

/// The default models (`scripts/fetch-models`): `NOMAD_MODELS_DIR`, else the workspace's
/// `models/`.
pub fn models_dir() -> PathBuf {
    let dir = std::env::var_os("NOMAD_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
    assert!(
        dir.join("all-minilm-l6-v2").is_dir() && dir.join("smollm2-135m-instruct").is_dir(),
        "the default models are missing from {}: run scripts/fetch-models first",
        dir.display()
    );
    dir.canonicalize().unwrap()
}

/// A clean command for `service` with `env` on top.
fn command(service: Service, env: &[(String, String)]) -> Command {
    let mut cmd = clean(service.binary());
    cmd.envs(env.iter().cloned());
    cmd
}

/// A small MLP model (`nomad-device-worker make-mlp --layers LAYERS --seed SEED`) in
/// `dir/mlp`; its path.
pub fn make_mlp(dir: &Path, layers: &str, seed: u64) -> PathBuf {
    let out = dir.join("mlp");
    crate::process::succeeded_blocking(
        std::process::Command::new(binary("nomad-device-worker"))
            .args([
                "make-mlp",
                "--layers",
                layers,
                "--seed",
                &seed.to_string(),
                "--out",
            ])
            .arg(&out),
    );
    out
}

/// `nomad up` with the default models, running in the background under `run_id` with its runs
/// in `dir/runs`, as a newcomer starts it (no `RUST_LOG`: the fleet's own default); returns it
/// and its `fleet.json` once that is written (at most 150 s).
pub async fn nomad_up(dir: &Path, run_id: &str) -> (tokio::process::Child, PathBuf) {
    let run_dir = dir.join("runs").join(run_id);
    let (up, _) = crate::process::start_fleet(
        clean("nomad")
            .env_remove("RUST_LOG")
            .args(["up", "--ready-timeout", "120", "--runs-dir"])
            .arg(dir.join("runs"))
            .arg("--models-dir")
            .arg(models_dir())
            .env("NOMAD_OTEL_RUN_ID", run_id),
        &run_dir,
        Some(&dir.join("up.stderr")),
        Duration::from_secs(150),
    )
    .await;
    (up, run_dir.join("fleet.json"))
}

#[derive(Debug, Default, Clone)]
pub struct FleetOptions {
    /// Environment for every process, the head included.
    pub env: Vec<(String, String)>,
    /// Extra environment per process (applied after `env`).
    pub service_env: HashMap<Service, Vec<(String, String)>>,
    /// YAML appended to the generated config file (e.g. a `telemetry:` block).
    pub config_yaml: String,
    /// Replaces the default `tools:` and `tool_manager:` sections (an `mlp` tool).
    pub tools_yaml: Option<String>,
    /// Run this many simulated workers (`--backend sim`, `sim:` from `config_yaml`) instead of
    /// one candle worker.
    pub sim_workers: usize,
    /// Candle workers to run when `sim_workers` is 0 (0 means one).
    pub candle_workers: usize,
    /// Every service requires [`TEST_TOKEN`] (an `auth:` block in the config).
    pub auth: bool,
    /// Extra arguments for every device worker (e.g. `--memory-budget-bytes N`).
    pub worker_args: Vec<String>,
    /// The fleet's directory (its config file, logs and addresses); default: a new temp dir.
    pub dir: Option<PathBuf>,
    /// Another build's gateway binary, run instead of this build's (a bench's baseline).
    pub gateway_binary: Option<PathBuf>,
}

impl FleetOptions {
    /// A fleet serving `tools_yaml` (its `tools:` and `tool_manager:` blocks) on real workers.
    pub fn serving(tools_yaml: impl Into<String>) -> Self {
        FleetOptions {
            tools_yaml: Some(tools_yaml.into()),
            ..Default::default()
        }
    }

    /// A fleet of `workers` simulated device workers serving `tools_yaml`, with `config_yaml`
    /// appended (a `sim:` block shapes the workers).
    pub fn simulated(workers: usize, tools_yaml: &str, config_yaml: &str) -> Self {
        FleetOptions {
            sim_workers: workers,
            config_yaml: config_yaml.to_owned(),
            ..FleetOptions::serving(tools_yaml)
        }
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.push((key.to_owned(), value.into()));
        self
    }

    /// Every process exports its telemetry over OTLP to `receiver`.
    pub fn exporting_to(self, receiver: &crate::OtlpReceiver) -> Self {
        self.env("NOMAD_OTEL_ENABLED", "true")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.clone())
    }

    /// The fleet's files (its config among them) go in `dir`, which must not hold another
    /// fleet's.
    pub fn in_dir(mut self, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        self.dir = Some(dir.to_owned());
        self
    }

    pub fn service_env(mut self, service: Service, key: &str, value: impl Into<String>) -> Self {
        self.service_env
            .entry(service)
            .or_default()
            .push((key.to_owned(), value.into()));
        self
    }

    fn env_for(&self, service: Service) -> Vec<(String, String)> {
        let mut env = self.env.clone();
        env.extend(self.service_env.get(&service).cloned().unwrap_or_default());
        env
    }
}

pub struct HeadRun {
    pub success: bool,
    pub code: Option<i32>,
    pub results: Vec<Value>,
    pub stdout: String,
    pub stderr: String,
}

impl HeadRun {
    /// The run id the head reported (same on every result).
    pub fn run_id(&self) -> String {
        self.results[0]["run_id"].as_str().unwrap().to_owned()
    }

    /// Outputs by task id, for comparing runs.
    pub fn outputs(&self) -> std::collections::BTreeMap<String, Value> {
        self.results
            .iter()
            .map(|r| {
                (
                    r["task_id"].as_str().unwrap().to_owned(),
                    r["output"].clone(),
                )
            })
            .collect()
    }
}

pub struct Fleet {
    pub dir: PathBuf,
    pub model_dir: PathBuf,
    pub config_path: PathBuf,
    pub scheduler_addr: String,
    pub gateway_addr: String,
    options: FleetOptions,
    children: Vec<(Service, Child)>,
}

impl Fleet {
    pub fn new_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nomad-it-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Starts scheduler, one CPU worker and gateway; returns once the worker is registered.
    pub async fn start(options: FleetOptions) -> Fleet {
        let dir = options.dir.clone().unwrap_or_else(Self::new_dir);
        let model_dir = make_mlp(&dir, "6,16,4", 42);
        let config_path = dir.join("nomad.yaml");
        let tools = options.tools_yaml.clone().unwrap_or_else(|| {
            format!(
                "tools:\n  - name: mlp\n    kind: mlp\n    source: {}\n    batch_size: 4\n\
                 tool_manager:\n  heartbeat_interval_ms: 200\n",
                model_dir.display()
            )
        });
        let auth = if options.auth {
            format!("auth: {{token: {TEST_TOKEN}}}\n")
        } else {
            String::new()
        };
        // `nomad head` keeps its runs' results in the fleet's directory.
        let head = format!("head:\n  runs_dir: {}\n", dir.join("runs").display());
        std::fs::write(
            &config_path,
            format!("{tools}{auth}{head}{}", options.config_yaml),
        )
        .unwrap();
        let mut fleet = Fleet {
            dir,
            model_dir,
            config_path,
            scheduler_addr: String::new(),
            gateway_addr: String::new(),
            options,
            children: Vec::new(),
        };
        fleet.scheduler_addr = fleet.spawn(Service::Scheduler, &[]).await;
        let scheduler = fleet.scheduler_addr.clone();
        let workers = match fleet.options.sim_workers {
            0 => fleet.options.candle_workers.max(1),
            n => n,
        };
        // Candle workers run on NOMAD_TEST_DEVICE when it is set (scripts/gpu-check.sh).
        let test_device = std::env::var("NOMAD_TEST_DEVICE").ok();
        let worker_args = fleet.options.worker_args.clone();
        for i in 0..workers {
            let id = format!("worker-{i}");
            let mut args = vec![
                "--scheduler",
                scheduler.as_str(),
                "--worker-id",
                id.as_str(),
            ];
            if fleet.options.sim_workers > 0 {
                args.extend(["--backend", "sim"]);
            } else if let Some(device) = test_device.as_deref() {
                args.extend(["--device", device]);
            }
            args.extend(worker_args.iter().map(String::as_str));
            fleet.spawn(Service::DeviceWorker, &args).await;
        }
        let mcp_addr_file = fleet.dir.join("gateway-mcp.addr");
        let mcp_addr_file = mcp_addr_file.to_str().expect("utf-8 temp path").to_owned();
        fleet.gateway_addr = fleet
            .spawn(
                Service::Gateway,
                &[
                    "--scheduler",
                    &scheduler,
                    "--mcp-listen",
                    "127.0.0.1:0",
                    "--mcp-addr-file",
                    &mcp_addr_file,
                ],
            )
            .await;
        // The MCP endpoint binds after the gRPC one; tests use both.
        let log = fleet
            .dir
            .join(format!("{}.stderr", Service::Gateway.name()));
        let (_, gateway) = fleet
            .children
            .last_mut()
            .expect("the gateway was just spawned");
        wait_for_file(
            Path::new(&mcp_addr_file),
            gateway,
            "nomad-gateway's MCP endpoint",
            &log,
        )
        .await;
        fleet.wait_for_workers(workers).await;
        fleet
    }

    /// The gateway's MCP endpoint (`http://ADDR/mcp`).
    pub fn gateway_mcp_url(&self) -> String {
        let addr = std::fs::read_to_string(self.dir.join("gateway-mcp.addr")).unwrap();
        format!("http://{}/mcp", addr.trim())
    }

    /// A plain client for the scheduler's API.
    pub async fn scheduler_client(&self) -> SchedulerClient<nomad_rpc::Channel> {
        SchedulerClient::new(rpc_channel(&self.scheduler_addr))
    }

    /// A client of this fleet's gateway.
    pub async fn gateway_client(&self) -> GatewayClient<tonic::transport::Channel> {
        GatewayClient::connect(format!("http://{}", self.gateway_addr))
            .await
            .unwrap()
    }

    /// The process id of the first running `service`.
    pub fn pid(&self, service: Service) -> u32 {
        self.children
            .iter()
            .find(|(s, _)| *s == service)
            .and_then(|(_, c)| c.id())
            .expect("the service is running")
    }

    /// Each running process of the fleet: `(service, pid)`.
    pub fn pids(&self) -> Vec<(Service, u32)> {
        self.children
            .iter()
            .filter_map(|(s, c)| c.id().map(|pid| (*s, pid)))
            .collect()
    }

    /// SIGKILLs the `index`th device worker (no flush, no goodbye).
    pub fn kill_worker(&mut self, index: usize) {
        let (_, child) = self
            .children
            .iter_mut()
            .filter(|(s, _)| *s == Service::DeviceWorker)
            .nth(index)
            .expect("no such worker");
        child.start_kill().unwrap();
    }

    /// Removes exited children so `terminate` only signals live ones.
    pub async fn reap_killed(&mut self) {
        let mut live = Vec::new();
        for (service, mut child) in self.children.drain(..) {
            if child.try_wait().unwrap().is_none() {
                live.push((service, child));
            } else {
                let _ = child.wait().await;
            }
        }
        self.children = live;
    }

    fn log(&self, service: Service, stream: &str) -> PathBuf {
        self.dir.join(format!("{}.{stream}", service.name()))
    }

    /// Starts the head's gRPC server (`nomad head`) against this fleet's gateway.
    pub async fn start_head_server(&mut self) -> String {
        let gateway = self.gateway_addr.clone();
        self.spawn(Service::Head, &["--gateway", &gateway]).await
    }

    /// Starts `service` and returns its bound address.
    async fn spawn(&mut self, service: Service, args: &[&str]) -> String {
        // The n-th process of a kind gets its own files: worker, worker-1, ...
        let n = self.children.iter().filter(|(s, _)| *s == service).count();
        let stem = if n == 0 {
            service.name().to_owned()
        } else {
            format!("{}-{n}", service.name())
        };
        let program = match (service, &self.options.gateway_binary) {
            (Service::Gateway, Some(other)) => other.clone(),
            _ => binary(service.binary()),
        };
        let mut cmd = clean_at(&program);
        cmd.envs(self.options.env_for(service));
        if service == Service::Head {
            cmd.arg("head");
        }
        cmd.arg("--config").arg(&self.config_path).args(args);
        let (child, addr) = listening(cmd, "127.0.0.1:0", &self.dir, &stem, true).await;
        self.children.push((service, child));
        addr
    }

    /// Kills the scheduler outright (SIGKILL) and waits for it to be gone.
    pub async fn kill_scheduler(&mut self) {
        let index = self
            .children
            .iter()
            .position(|(s, _)| *s == Service::Scheduler)
            .expect("a scheduler is running");
        let (_, mut child) = self.children.remove(index);
        child.start_kill().unwrap();
        let _ = child.wait().await;
    }

    /// Starts a scheduler again on the address the first one had.
    pub async fn restart_scheduler(&mut self) {
        let mut cmd = command(
            Service::Scheduler,
            &self.options.env_for(Service::Scheduler),
        );
        cmd.arg("--config").arg(&self.config_path);
        let (child, addr) = listening(
            cmd,
            &self.scheduler_addr,
            &self.dir,
            "scheduler-restarted",
            true,
        )
        .await;
        assert_eq!(addr, self.scheduler_addr);
        self.children.insert(0, (Service::Scheduler, child));
    }

    /// The workers registered with the scheduler now.
    pub async fn workers(&self) -> Vec<nomad_proto::v1::WorkerInfo> {
        self.scheduler_client()
            .await
            .list_workers(ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner()
            .workers
    }

    pub async fn wait_for_workers(&self, count: usize) {
        let what = format!("{count} workers registered");
        let (within, every) = (Duration::from_secs(30), Duration::from_millis(20));
        crate::wait_until_async(&what, within, every, async || {
            self.workers().await.len() >= count
        })
        .await;
    }

    /// Runs `nomad run` over `tasks` (concurrency `concurrency`) and collects its results.
    pub async fn run_head(&self, tasks: &[Value], concurrency: usize) -> HeadRun {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let tasks_path = self.dir.join(format!("tasks-{id}.jsonl"));
        let results_path = self.dir.join(format!("results-{id}.jsonl"));
        let text: String = tasks.iter().map(|t| format!("{t}\n")).collect();
        std::fs::write(&tasks_path, text).unwrap();
        let output = command(Service::Head, &self.options.env_for(Service::Head))
            .arg("run")
            .arg("--config")
            .arg(&self.config_path)
            .arg("--tasks")
            .arg(&tasks_path)
            .arg("--out")
            .arg(&results_path)
            .args(["--gateway", &self.gateway_addr])
            .args(["--concurrency", &concurrency.to_string()])
            .output()
            .await
            .unwrap();
        let results = std::fs::read_to_string(&results_path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        HeadRun {
            success: output.status.success(),
            code: output.status.code(),
            results,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    /// Sends SIGTERM to every service and waits for each to exit; panics if one does not
    /// exit cleanly within 15 s.
    pub async fn terminate(&mut self) {
        for (_, child) in &self.children {
            if let Some(pid) = child.id() {
                send_signal(pid, libc::SIGTERM);
            }
        }
        for (service, child) in &mut self.children {
            let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .unwrap_or_else(|_| {
                    panic!("{} did not exit within 15 s of SIGTERM", service.binary())
                })
                .unwrap();
            assert!(
                status.success(),
                "{} exited with {status} after SIGTERM:\n{}",
                service.binary(),
                std::fs::read_to_string(self.dir.join(format!("{}.stderr", service.name())))
                    .unwrap_or_default()
            );
        }
        self.children.clear();
    }

    /// What `service` wrote to stdout so far.
    pub fn stdout(&self, service: Service) -> String {
        std::fs::read_to_string(self.log(service, "stdout")).unwrap_or_default()
    }

    pub fn stderr(&self, service: Service) -> String {
        std::fs::read_to_string(self.log(service, "stderr")).unwrap_or_default()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.start_kill();
        }
        if std::env::var_os("NOMAD_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `count` MLP tasks with distinct inputs of width 6.
pub fn mlp_tasks(count: usize) -> Vec<Value> {
    (0..count)
        .map(|i| {
            let input: Vec<f32> = (0..6).map(|k| ((i * 7 + k) % 11) as f32 / 10.0 - 0.5).collect();
            serde_json::json!({"id": format!("task-{i}"), "tool": "mlp", "arguments": {"input": input}})
        })
        .collect()
}
