//! Rollouts at scale through the gateway: N callers, each running sandboxed code that waits
//! 0.5 s (as agent code waits on a model) and then calls the `embed` tool once, back to back for
//! a fixed time. Three gateways side by side, each with its own fleet: admission by memory with
//! runs forked from the fork server (the default), the same with a new interpreter per run
//! (`fork_server: false`), and a fixed cap of 4 runs at once (the former default on 2 cores). Reports
//! rollouts/s against the ideal (N / 0.5 s), latency, errors, and the peak memory of the
//! gateway and of all its runs together (PSS, read from /proc).
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-rollout-bench
//! [--callers 1,16,64,256] [--seconds 15] [--baseline-gateway PATH]`. With
//! `--baseline-gateway`, the default and the interpreter-per-run rows are measured a second time
//! with that binary (another build's gateway, "before"), row after row.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nomad_integration_tests::{Fleet, FleetOptions, Service, arg, check_args, fleet::models_dir};
use nomad_proto::v1::ExecuteCodeRequest;
use nomad_proto::v1::gateway_client::GatewayClient;

const WAIT_THEN_EMBED: &str = "\
import asyncio
from mcp_tools.nomad import embed
await asyncio.sleep(0.5)
RESULT = len(embed('A sentence to embed.')['output'])
";

async fn fleet(sandbox_yaml: &str, gateway: Option<&str>) -> Fleet {
    Fleet::start(
        FleetOptions {
            gateway_binary: gateway.map(Into::into),
            tools_yaml: Some(format!(
                "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: 32}}\n\
                 tool_manager:\n  heartbeat_interval_ms: 200\n",
                models_dir().join("all-minilm-l6-v2").display()
            )),
            config_yaml: format!("sandbox:\n  timeout_seconds: 60\n{sandbox_yaml}"),
            ..Default::default()
        }
        .service_env(Service::Gateway, "RUST_LOG", "warn"),
    )
    .await
}

/// The gateway's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    nomad_telemetry::process::rss_bytes(Some(pid)).unwrap_or(0)
}

/// The PSS of every process under the gateway (its runs), in bytes.
fn runs_pss(gateway: u32) -> u64 {
    let all = nomad_telemetry::process::tree_memory(gateway).map_or(0, |m| m.held);
    let own = nomad_telemetry::process::process_memory(gateway)
        .map_or(0, |(rss, pss)| pss.unwrap_or(rss));
    all.saturating_sub(own)
}

struct Row {
    rate: f64,
    p50: f64,
    p99: f64,
    done: usize,
    errors: u64,
    first_error: String,
    gateway_peak: u64,
    runs_peak: u64,
}

async fn measure(fleet: &Fleet, callers: usize, seconds: f64) -> Row {
    let gateway_pid = fleet.pid(Service::Gateway);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(String::new()));
    let started = Instant::now();
    let window = Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for _ in 0..callers {
        let addr = format!("http://{}", fleet.gateway_addr);
        let (errors, first_error) = (errors.clone(), first_error.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = GatewayClient::connect(addr).await.unwrap();
            let mut latencies = Vec::new();
            while started.elapsed() < window {
                let t = Instant::now();
                let reply = client
                    .execute_code(ExecuteCodeRequest {
                        code: WAIT_THEN_EMBED.into(),
                        env: Default::default(),
                    })
                    .await;
                let error = match reply {
                    Ok(r) if r.get_ref().error.is_empty() => None,
                    Ok(r) => Some(r.into_inner().error),
                    Err(status) => Some(status.message().to_owned()),
                };
                match error {
                    None => latencies.push(t.elapsed()),
                    Some(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        let mut first = first_error.lock().unwrap();
                        if first.is_empty() {
                            *first = e.lines().next().unwrap_or_default().to_owned();
                        }
                    }
                }
            }
            latencies
        }));
    }
    let sampler = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut gateway, mut runs) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                gateway = gateway.max(rss(gateway_pid));
                runs = runs.max(
                    tokio::task::spawn_blocking(move || runs_pss(gateway_pid))
                        .await
                        .unwrap(),
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (gateway, runs)
        })
    };
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (gateway_peak, runs_peak) = sampler.await.unwrap();
    all.sort();
    let at = |q: f64| {
        all.get(((all.len().max(1) - 1) as f64 * q).round() as usize)
            .map_or(0.0, Duration::as_secs_f64)
    };
    Row {
        rate: all.len() as f64 / elapsed,
        p50: at(0.5),
        p99: at(0.99),
        done: all.len(),
        errors: errors.load(Ordering::Relaxed),
        first_error: first_error.lock().unwrap().clone(),
        gateway_peak,
        runs_peak,
    }
}

const USAGE: &str = "\
Usage: nomad-rollout-bench [--callers 1,16,64,256] [--seconds 15] [--baseline-gateway PATH]
N callers each running code that waits 0.5 s then calls embed, back to back, through a gateway
admitting by memory with forked runs (the default), one starting an interpreter per run, and
one capped at 4 runs at once; --baseline-gateway adds the first two with another build's gateway.";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    check_args(
        USAGE,
        &["--callers", "--seconds", "--baseline-gateway"],
        &[],
    );
    let callers: Vec<usize> = arg("--callers", "1,16,64,256")
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("--callers: numbers, comma-separated")
        })
        .collect();
    let seconds: f64 = arg("--seconds", "15").parse().expect("--seconds: a number");
    let baseline = arg("--baseline-gateway", "");
    let mut fleets = vec![
        (
            "by memory, forked (default)".to_owned(),
            fleet("", None).await,
        ),
        (
            "by memory, an interpreter per run".to_owned(),
            fleet("  fork_server: false\n", None).await,
        ),
        (
            "4 at once, an interpreter per run".to_owned(),
            fleet("  max_concurrent: 4\n  fork_server: false\n", None).await,
        ),
    ];
    if !baseline.is_empty() {
        let before = Some(baseline.as_str());
        fleets.push((
            "by memory, forked (default; before)".to_owned(),
            fleet("", before).await,
        ));
        fleets.push((
            "by memory, an interpreter per run (before)".to_owned(),
            fleet("  fork_server: false\n", before).await,
        ));
    }
    for (_, fleet) in &fleets {
        // Load the model and touch every path once.
        measure(fleet, 2, 2.0).await;
    }
    println!(
        "\n| admission | callers | rollouts/s | ideal | of ideal | p50 | p99 | done | errors | \
         gateway peak RSS | runs' peak PSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    for &n in &callers {
        for (name, fleet) in &fleets {
            let row = measure(fleet, n, seconds).await;
            let ideal = n as f64 / 0.5;
            println!(
                "| {name} | {n} | {:.1} | {ideal:.0} | {:.0} % | {:.2} s | {:.2} s | {} | {} | \
                 {} MiB | {} MiB |",
                row.rate,
                100.0 * row.rate / ideal,
                row.p50,
                row.p99,
                row.done,
                row.errors,
                row.gateway_peak >> 20,
                row.runs_peak >> 20,
            );
            if !row.first_error.is_empty() {
                notes.push(format!("{name}, {n} callers: {}", row.first_error));
            }
        }
    }
    for note in notes {
        println!("\nfirst error: {note}");
    }
}
