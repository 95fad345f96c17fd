//! `nomad slurm-job`: the body of the job `nomad submit` writes. It runs on the job's first node
//! and starts each part of the fleet as an `srun --overlap` step (collector, scheduler, gateway,
//! the device workers on every node), drives the rollouts itself, then stops the steps in
//! reverse order with SIGTERM, the collector last.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use nomad_config::{ConfigFile, Env, ProcessEnv};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_rpc::{Service, StartOptions};
use nomad_telemetry::{ServerType, TelemetryBlock};
use serde_json::json;

use super::cli;
use crate::rollouts::{self, Runner};
use crate::supervisor::{ChildSpec, Exit, Supervisor};
use crate::up::env::Layered;
use crate::up::run_dir::addr_file;
use crate::{run_id, tasks};

#[derive(clap::Args)]
pub struct JobArgs {
    /// The run directory `nomad submit` prepared (nomad.yaml, tasks.jsonl, token).
    #[arg(long)]
    pub run_dir: PathBuf,
    /// Where the service binaries are.
    #[arg(long)]
    pub bin_dir: PathBuf,
    /// Device workers per node use one GPU each; 0: one CPU worker per node.
    #[arg(long, default_value_t = 0)]
    pub gpus_per_node: u32,
    /// The fleet's config (default: nomad.yaml in the run directory).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    #[arg(long, default_value = "embed")]
    pub embed_tool: String,
    /// Seconds the fleet may take to start (model loading on every node included).
    #[arg(long, default_value_t = 300.0)]
    pub ready_timeout: f64,
}

/// What the driver did, in `driver.json` for `nomad submit --wait` and `nomad status`.
fn write_outcome(run_dir: &Path, outcome: &serde_json::Value) -> anyhow::Result<()> {
    let path = run_dir.join("driver.json");
    let partial = run_dir.join("driver.json.partial");
    std::fs::write(&partial, format!("{outcome:#}\n"))
        .and_then(|()| std::fs::rename(&partial, &path))
        .with_context(|| format!("writing {}", path.display()))
}

/// `0.0.0.0:PORT` from an address file, as `host:PORT` other nodes can dial.
fn reachable(bound: &str, host: &str) -> anyhow::Result<String> {
    let addr: std::net::SocketAddr = bound
        .parse()
        .with_context(|| format!("address file holds {bound:?}"))?;
    Ok(format!("{host}:{}", addr.port()))
}

/// One `srun` step: `tasks` copies of `program` on `node`, each with one GPU when `gpus`.
struct Step<'a> {
    name: &'a str,
    node: &'a str,
    server_type: &'static str,
    tasks: u32,
    gpus: bool,
    program: &'a str,
    args: Vec<String>,
}

/// The steps started so far, by name: the node each runs on.
struct Steps {
    job: String,
    bin_dir: PathBuf,
    env: Vec<(String, String)>,
    nodes: HashMap<String, String>,
}

impl Steps {
    fn spawn(&mut self, sup: &mut Supervisor, step: Step<'_>) -> anyhow::Result<usize> {
        let Step {
            name,
            node,
            server_type,
            tasks,
            gpus,
            program,
            args,
        } = step;
        let program = self.bin_dir.join(program);
        anyhow::ensure!(
            program.is_file(),
            "{} is missing on {node}",
            program.display()
        );
        let mut srun: Vec<String> = vec![
            "--overlap".into(),
            "--nodes=1".into(),
            format!("--ntasks={tasks}"),
            format!("--nodelist={node}"),
            format!("--job-name={name}"),
        ];
        if gpus {
            srun.push("--gpus-per-task=1".into());
        }
        srun.push(program.display().to_string());
        srun.extend(args);
        println!("nomad: step {name} on {node}: srun {}", srun.join(" "));
        self.nodes.insert(name.to_owned(), node.to_owned());
        sup.spawn(ChildSpec {
            stdio: false,
            name: name.into(),
            server_type,
            program: "srun".into(),
            args: srun,
            env: self.env.clone(),
            ready_files: vec![],
            // A worker step registers with the scheduler wherever it listens: it can be started
            // again within the job. The others listen where the rest of the job found them.
            restart: server_type == "device-worker",
        })
    }

    /// SIGTERM to a step's tasks (`scancel --signal`): srun itself would cancel the step.
    fn terminate(&self, name: &str, srun_pid: u32) {
        let step = cli::steps(&self.job)
            .ok()
            .and_then(|steps| steps.into_iter().find(|(_, n, _)| n == name));
        match step {
            Some((id, _, _)) => {
                let _ = cli::run("scancel", &["--quiet", "--signal=TERM", &id]);
            }
            // Not (or no longer) in the queue: srun is all there is to stop.
            None => unsafe {
                // SAFETY: kill has no memory preconditions; the pid is our unreaped child.
                libc::kill(srun_pid as libc::pid_t, libc::SIGTERM);
            },
        }
    }

    fn report(&self, sup: &Supervisor, exit: &Exit) -> String {
        let node = self.nodes.get(&exit.name).map_or("?", String::as_str);
        format!("step on node {node}: {}", sup.report(exit))
    }
}

/// The name other nodes dial this one by: its host name, when that resolves; else loopback
/// (only right when every node is this machine, as on a test cluster), said in the output.
fn hostname() -> String {
    use std::net::ToSocketAddrs as _;
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    if !name.is_empty()
        && (name.as_str(), 0)
            .to_socket_addrs()
            .is_ok_and(|mut a| a.next().is_some())
    {
        return name;
    }
    println!("nomad: host name {name:?} does not resolve; the steps dial 127.0.0.1");
    "127.0.0.1".into()
}

pub async fn job(args: JobArgs) -> anyhow::Result<bool> {
    let env = ProcessEnv;
    let job_id = env
        .non_empty("SLURM_JOB_ID")
        .context("nomad slurm-job runs inside a Slurm job; start one with nomad submit")?;
    let nodes = cli::hostnames(
        &env.non_empty("SLURM_JOB_NODELIST")
            .context("SLURM_JOB_NODELIST is not set")?,
    )?;
    let first = env
        .non_empty("SLURMD_NODENAME")
        .or_else(|| nodes.first().cloned())
        .context("the job has no nodes")?;
    let ready_timeout =
        nomad_config::seconds("--ready-timeout", args.ready_timeout).map_err(anyhow::Error::msg)?;
    let run_dir = std::path::absolute(&args.run_dir)?;
    let config = match &args.config {
        Some(path) => path.clone(),
        None => run_dir.join("nomad.yaml"),
    };
    let file = ConfigFile::load(Some(&config))?;
    let restarts = file
        .section::<crate::supervisor::RestartPolicy>("supervise")?
        .checked()
        .map_err(anyhow::Error::msg)?;
    nomad_rpc::tls::configure_from(&file, false)?;
    nomad_rpc::auth::install(nomad_rpc::auth::Auth::resolve(&file, &env)?)?;
    let tasks_text = std::fs::read_to_string(run_dir.join("tasks.jsonl"))
        .context("reading the run's tasks.jsonl")?;
    let template = std::fs::read_to_string(run_dir.join("template.py")).ok();
    let tasks = tasks::parse(&tasks_text, "tasks.jsonl", template.as_deref())
        .map_err(anyhow::Error::msg)?;
    let host = hostname();

    let mut step_env = vec![("NOMAD_OTEL_RUN_ID".to_owned(), job_id.clone())];
    if env.non_empty("RUST_LOG").is_none() {
        step_env.push((
            "RUST_LOG".into(),
            nomad_telemetry::DEFAULT_LOG_FILTER.into(),
        ));
    }
    let mut steps = Steps {
        job: job_id.clone(),
        bin_dir: args.bin_dir.clone(),
        env: step_env,
        nodes: HashMap::new(),
    };
    let mut sup = Supervisor::new(&run_dir, restarts);
    let layout = Layout {
        run_dir: &run_dir,
        config: &config,
        nodes: &nodes,
        first: &first,
        host: &host,
        gpus_per_node: args.gpus_per_node,
        timeout: ready_timeout,
    };
    let started = start(&mut sup, &mut steps, &layout).await;
    let (gateway, endpoint) = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nomad: the fleet did not start: {e:#}");
            write_outcome(
                &run_dir,
                &json!({"status": "failed", "exit_code": 2, "error": format!("{e:#}")}),
            )?;
            stop(&mut sup, &steps).await;
            return Ok(false);
        }
    };

    // The driver's own telemetry goes to the collector too, unless the user named an endpoint.
    let block: TelemetryBlock = file.section("telemetry")?;
    let mut defaults: Vec<(String, String)> = endpoint
        .iter()
        .map(|e| ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), e.clone()))
        .collect();
    if endpoint.is_some()
        && let Some(headers) = collector_headers()
    {
        defaults.push(("NOMAD_OTEL_OTLP_HEADERS".to_owned(), headers));
    }
    let mut settings = nomad_telemetry::config::resolve(
        &block,
        &Layered {
            user: &env,
            defaults: &defaults,
        },
    )?;
    let run_id = run_id::assign(&mut settings, &env)?;
    let telemetry = Service::with_settings(
        ServerType::Head,
        None,
        file,
        settings,
        StartOptions {
            serves: false,
            ..Default::default()
        },
    )?;

    let out = run_dir.join("results.jsonl");
    let runner = Runner::new(
        GatewayClient::new(nomad_rpc::channel(&gateway)?),
        run_id.clone(),
        args.concurrency,
        args.embed_tool.clone(),
    );
    eprintln!(
        "nomad: run {run_id}: {} on {} node{} (concurrency {})",
        crate::up::count(tasks.len(), "task"),
        nodes.len(),
        if nodes.len() == 1 { "" } else { "s" },
        args.concurrency
    );
    let workers = nodes.len();
    let mut results = Vec::new();
    // A stop ends what runs as cancelled, with why, and every task still gets its line.
    let (stopper, run_stop) = rollouts::Stop::new();
    let (ran, stopped) = {
        let run = rollouts::run_to_file(&runner, tasks, &out, false, &mut results, &run_stop);
        tokio::pin!(run);
        tokio::select! {
            ran = &mut run => (ran, None),
            exit = fatal_exit(&mut sup, &steps, workers) => {
                eprintln!("nomad: {exit}");
                stopper.stop(format!("the job's fleet stopped before this rollout finished: {exit}"));
                (run.await, Some(json!({"status": "failed", "exit_code": 1, "error": exit})))
            }
            () = nomad_rpc::shutdown_signal() => {
                eprintln!("nomad: job cancelled or out of time; stopping the steps");
                stopper.stop("the job was cancelled or ran out of time before this rollout finished");
                (run.await, Some(json!({"status": "cancelled", "exit_code": 1})))
            }
        }
    };
    let outcome = match (ran, stopped) {
        (Err(e), _) => json!({"status": "failed", "exit_code": 2, "error": format!("{e:#}")}),
        (Ok(()), Some(stopped)) => {
            crate::up::summarize(&results, &out);
            stopped
        }
        (Ok(()), None) => {
            let failed = results.iter().filter(|r| r.status != "ok").count();
            crate::up::summarize(&results, &out);
            json!({"status": if failed == 0 { "ok" } else { "failed" }, "exit_code": i32::from(failed > 0),
                   "rollouts": results.len(), "failed": failed, "results": out})
        }
    };
    write_outcome(&run_dir, &outcome)?;
    // The driver's spans are done: flush them while the collector still runs.
    telemetry.stop().await;
    stop(&mut sup, &steps).await;
    eprintln!(
        "nomad: run {run_id} done; traces: nomad traces {run_id} --from {}",
        run_dir.display()
    );
    Ok(outcome["exit_code"] == 0)
}

/// Where the job's parts go.
#[derive(Clone, Copy)]
struct Layout<'a> {
    run_dir: &'a Path,
    config: &'a Path,
    nodes: &'a [String],
    /// The node this runs on: the collector, scheduler and gateway go here too.
    first: &'a str,
    /// This node's host name, which the other nodes dial.
    host: &'a str,
    gpus_per_node: u32,
    timeout: Duration,
}

/// The OTLP headers that carry the job's token to its collector (`None` without a token).
fn collector_headers() -> Option<String> {
    nomad_rpc::auth::installed()
        .token
        .as_deref()
        .map(|token| format!("authorization=Bearer%20{token}"))
}

/// Starts the steps; returns the gateway's address and the collector's endpoint (`None` when
/// the user's own `OTEL_EXPORTER_OTLP_ENDPOINT` is in force).
async fn start(
    sup: &mut Supervisor,
    steps: &mut Steps,
    layout: &Layout<'_>,
) -> anyhow::Result<(String, Option<String>)> {
    let Layout {
        run_dir,
        config,
        nodes,
        first,
        host,
        gpus_per_node,
        timeout,
    } = *layout;
    let path = |p: &Path| p.display().to_string();
    // Where step `index` listens once it has written its address file, as other nodes dial it.
    let listening = async |sup: &mut Supervisor, index: usize, name: &str| {
        let bound = sup
            .wait_for_file(index, &addr_file(run_dir, name), timeout)
            .await?;
        reachable(&bound, host)
    };
    let collector = steps.spawn(
        sup,
        Step {
            name: "collector",
            node: first,
            server_type: "collector",
            tasks: 1,
            gpus: false,
            program: "nomad",
            args: vec![
                "collect".into(),
                "--out".into(),
                path(&run_dir.join("otel")),
                "--listen".into(),
                "0.0.0.0:0".into(),
                "--http-listen".into(),
                "0.0.0.0:0".into(),
                "--addr-file".into(),
                path(&addr_file(run_dir, "collector")),
            ],
        },
    )?;
    let endpoint = format!("http://{}", listening(sup, collector, "collector").await?);
    let user_endpoint = ProcessEnv.non_empty("OTEL_EXPORTER_OTLP_ENDPOINT");
    let endpoint = match user_endpoint {
        Some(e) => {
            println!(
                "nomad: telemetry goes to OTEL_EXPORTER_OTLP_ENDPOINT={e} (yours), not the collector"
            );
            None
        }
        None => {
            steps
                .env
                .push(("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint.clone()));
            // The collector listens beyond loopback, so it asks every export for the job's token.
            if let Some(headers) = collector_headers() {
                steps.env.push(("NOMAD_OTEL_OTLP_HEADERS".into(), headers));
            }
            Some(endpoint)
        }
    };
    let server = |name: &str, extra: Vec<String>| {
        let mut a = vec![
            "--config".into(),
            path(config),
            "--listen".into(),
            "0.0.0.0:0".into(),
            "--addr-file".into(),
            path(&addr_file(run_dir, name)),
        ];
        a.extend(extra);
        a
    };
    let scheduler_index = steps.spawn(
        sup,
        Step {
            name: "scheduler",
            node: first,
            server_type: "scheduler",
            tasks: 1,
            gpus: false,
            program: "nomad-scheduler",
            args: server("scheduler", vec![]),
        },
    )?;
    let scheduler = listening(sup, scheduler_index, "scheduler").await?;
    let gateway_index = steps.spawn(
        sup,
        Step {
            name: "gateway",
            node: first,
            server_type: "gateway",
            tasks: 1,
            gpus: false,
            program: "nomad-gateway",
            args: server(
                "gateway",
                vec![
                    "--scheduler".into(),
                    scheduler.clone(),
                    "--mcp-listen".into(),
                    "0.0.0.0:0".into(),
                ],
            ),
        },
    )?;
    let gateway = listening(sup, gateway_index, "gateway").await?;
    let per_node = gpus_per_node.max(1);
    for node in nodes {
        let mut extra = vec![
            "--config".into(),
            path(config),
            "--listen".into(),
            "0.0.0.0:0".into(),
            "--scheduler".into(),
            scheduler.clone(),
        ];
        if gpus_per_node > 0 {
            // --gpus-per-task=1 leaves each task one visible GPU.
            extra.extend(["--device".into(), "cuda:0".into()]);
        }
        steps.spawn(
            sup,
            Step {
                name: &format!("worker-{node}"),
                node,
                server_type: "device-worker",
                tasks: per_node,
                gpus: gpus_per_node > 0,
                program: "nomad-device-worker",
                args: extra,
            },
        )?;
    }
    let workers = nodes.len() * per_node as usize;
    crate::up::fleet::wait_ready(
        sup,
        &[
            (scheduler_index, scheduler.clone()),
            (gateway_index, gateway.clone()),
        ],
        &scheduler,
        workers,
        timeout,
        &nomad_telemetry::startup::Startup::disabled(),
    )
    .await?;
    println!(
        "nomad: fleet ready: scheduler {scheduler}, gateway {gateway}, {workers} device worker{}",
        if workers == 1 { "" } else { "s" }
    );
    Ok((gateway, endpoint))
}

/// Resolves when a step's death ends the run: the collector, scheduler or gateway, or the last
/// worker step. A worker step lost while another serves is reported, and the run goes on (the
/// scheduler requeues what it was running).
async fn fatal_exit(sup: &mut Supervisor, steps: &Steps, mut workers: usize) -> String {
    loop {
        let exit = sup.next_exit().await;
        let report = steps.report(sup, &exit);
        if exit.name.starts_with("worker-") && workers > 1 {
            workers -= 1;
            eprintln!("nomad: {report}nomad: {workers} worker step(s) left; the run goes on");
            continue;
        }
        return report;
    }
}

async fn stop(sup: &mut Supervisor, steps: &Steps) {
    for exit in sup
        .stop_with(Duration::from_secs(20), |name, pid| {
            steps.terminate(name, pid)
        })
        .await
    {
        if !exit.status.success() {
            eprintln!("nomad: step {} exited ({})", exit.name, exit.status);
        }
    }
}
