//! Scheduler benchmarks over real processes on loopback:
//! - dispatch throughput of one scheduler with 1, 4, 16, 64 simulated workers of zero latency;
//! - added latency per hop (client -> scheduler -> worker -> back, no-op model), p50/p99, next to
//!   a direct worker call and an in-process call measured in the same run.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-bench`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    CallToolRequest, ExecuteBatchRequest, ToolInput, ToolOutput, tool_input, tool_output,
};
use tonic::transport::Channel;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_owned())
}

fn input(i: u64) -> ToolInput {
    ToolInput {
        value: Some(tool_input::Value::Text(format!("r{i}"))),
        options_json: String::new(),
    }
}

fn tools(batch_size: u32, max_devices: usize) -> String {
    format!(
        "tools:\n  - {{name: t, kind: mlp, source: sim, batch_size: {batch_size}, \
         max_devices: {max_devices}, max_pending: 1000000}}\n\
         tool_manager:\n  max_batch_delay_ms: 0\n  heartbeat_interval_ms: 1000\n"
    )
}

async fn fleet(workers: usize, batch_size: u32) -> Fleet {
    Fleet::start(FleetOptions {
        sim_workers: workers,
        tools_yaml: Some(tools(batch_size, workers)),
        config_yaml: "sim:\n  base_latency_ms: 0\n".into(),
        ..Default::default()
    })
    .await
}

async fn channels(addr: &str, n: usize) -> Vec<SchedulerClient<Channel>> {
    let mut clients = Vec::new();
    for _ in 0..n {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        clients.push(SchedulerClient::new(channel));
    }
    clients
}

/// Requests completed per second over `seconds`, and the mean batch size that served them.
async fn throughput(workers: usize, concurrency: usize, seconds: f64) -> (f64, f64) {
    let mut fleet = fleet(workers, 64).await;
    let clients = channels(&fleet.scheduler_addr, 8).await;
    let stop = Arc::new(AtomicBool::new(false));
    let counting = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let batch_sum = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let mut client = clients[c % clients.len()].clone();
        let (stop, counting, done, batch_sum) = (
            stop.clone(),
            counting.clone(),
            done.clone(),
            batch_sum.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let reply = client
                    .call_tool(CallToolRequest {
                        tool: "t".into(),
                        input: Some(input(i)),
                    })
                    .await
                    .expect("call failed")
                    .into_inner();
                i += 1;
                if counting.load(Ordering::Relaxed) {
                    done.fetch_add(1, Ordering::Relaxed);
                    batch_sum.fetch_add(u64::from(reply.batch_size), Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await; // warm-up: loads, connections
    counting.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    counting.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    fleet.terminate().await;
    let n = done.load(Ordering::Relaxed) as f64;
    (
        n / elapsed,
        batch_sum.load(Ordering::Relaxed) as f64 / n.max(1.0),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

/// The same work as the sim worker's per-request echo, called in-process through an await.
#[inline(never)]
async fn echo_in_process(input: ToolInput) -> ToolOutput {
    let value = match input.value {
        Some(tool_input::Value::Text(t)) => tool_output::Value::Text(t),
        _ => unreachable!(),
    };
    ToolOutput { value: Some(value) }
}

async fn latency(samples: usize) -> Vec<(String, Duration, Duration)> {
    let mut fleet = fleet(1, 1).await;
    let mut scheduler = channels(&fleet.scheduler_addr, 1).await.remove(0);
    let worker_addr = std::fs::read_to_string(fleet.dir.join("device-worker.addr")).unwrap();
    let mut worker = DeviceWorkerClient::connect(format!("http://{}", worker_addr.trim()))
        .await
        .unwrap();
    // Warm-up: the first call loads and places the tool.
    for i in 0..200 {
        scheduler
            .call_tool(CallToolRequest {
                tool: "t".into(),
                input: Some(input(i)),
            })
            .await
            .unwrap();
    }
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        Channel::from_shared(format!("http://{}", worker_addr.trim()))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let (mut in_process, mut bare, mut direct, mut via) = (vec![], vec![], vec![], vec![]);
    // Interleaved so drift on a shared machine hits all of them alike.
    for i in 0..samples as u64 {
        let t = Instant::now();
        std::hint::black_box(echo_in_process(input(i)).await);
        in_process.push(t.elapsed());

        let t = Instant::now();
        health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap();
        bare.push(t.elapsed());

        let t = Instant::now();
        worker
            .execute_batch(ExecuteBatchRequest {
                tool: "t".into(),
                inputs: vec![input(i)],
                traces: vec![],
            })
            .await
            .unwrap();
        direct.push(t.elapsed());

        let t = Instant::now();
        scheduler
            .call_tool(CallToolRequest {
                tool: "t".into(),
                input: Some(input(i)),
            })
            .await
            .unwrap();
        via.push(t.elapsed());
    }
    fleet.terminate().await;
    let (ip50, ip99) = summary(in_process);
    let (b50, b99) = summary(bare);
    let (d50, d99) = summary(direct);
    let (v50, v99) = summary(via);
    vec![
        ("in-process call (no hop)".into(), ip50, ip99),
        (
            "bare gRPC round trip to the worker (health check)".into(),
            b50,
            b99,
        ),
        ("client -> worker (1 hop)".into(), d50, d99),
        ("client -> scheduler -> worker (2 hops)".into(), v50, v99),
        (
            "per hop, through the scheduler ((2 hops - in-process) / 2)".into(),
            (v50.saturating_sub(ip50)) / 2,
            (v99.saturating_sub(ip99)) / 2,
        ),
    ]
}

fn main() {
    let seconds: f64 = arg("--seconds", "5").parse().expect("--seconds");
    let concurrency: usize = arg("--concurrency", "256").parse().expect("--concurrency");
    let samples: usize = arg("--samples", "5000").parse().expect("--samples");
    let workers: Vec<usize> = arg("--workers", "1,4,16,64")
        .split(',')
        .map(|w| w.parse().expect("--workers"))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!("## Dispatch throughput ({concurrency} concurrent callers over 8 connections, {seconds} s each)\n");
        println!("| sim workers | requests/s | mean batch size |\n|---|---|---|");
        for w in workers {
            let (rate, batch) = throughput(w, concurrency, seconds).await;
            println!("| {w} | {rate:.0} | {batch:.1} |");
        }
        println!("\n## Latency, one request at a time ({samples} samples each, interleaved)\n");
        println!("| path | p50 | p99 |\n|---|---|---|");
        for (path, p50, p99) in latency(samples).await {
            println!("| {path} | {:.1} µs | {:.1} µs |", p50.as_secs_f64() * 1e6, p99.as_secs_f64() * 1e6);
        }
    });
}
