//! `embed` through the scheduler next to the worker's own batch rates, one real candle worker
//! (all-minilm-l6-v2), interleaved per level so drift on a shared machine hits both alike:
//! - the worker alone: `ExecuteBatch` straight to it with batches of 1, 8 and the tool's batch
//!   size (`--batch-size`, 32), one at a time;
//! - through the scheduler: 1, 8 and 2 × batch size callers, one sentence per `CallTool`.
//!
//! Two workloads: uniform 32-token sentences (`scripts/reference/bench_sentences.txt`) and a
//! mix of 90 % short (about 8 tokens) and 10 % long (about 200 tokens) inputs.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-embed-bench
//! [--seconds 5] [--batch-size 32]`; the worker runs on `NOMAD_TEST_DEVICE` when it is set.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nomad_integration_tests::{Fleet, FleetOptions, arg, check_args, count_for, fleet, text_input};
use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{CallToolRequest, ExecuteBatchRequest, ToolInput};
use nomad_rpc::Channel;

fn text(s: &str) -> ToolInput {
    text_input(s, "")
}

/// The two workloads: each a cycle of inputs the callers walk through.
fn workloads() -> Vec<(&'static str, Vec<String>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/reference/bench_sentences.txt"
    );
    let sentences: Vec<String> = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    // About 8 tokens: the first five words. About 200: six 32-token sentences joined.
    let short = |s: &String| s.split_whitespace().take(5).collect::<Vec<_>>().join(" ");
    let long = |i: usize| {
        (0..6)
            .map(|k| sentences[(i + k) % sentences.len()].as_str())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mix = (0..sentences.len().max(100))
        .map(|i| {
            if i % 10 == 9 {
                long(i)
            } else {
                short(&sentences[i % sentences.len()])
            }
        })
        .collect();
    vec![
        ("uniform 32-token sentences", sentences),
        ("mix: 90 % ~8 tokens, 10 % ~200 tokens", mix),
    ]
}

struct Row {
    path: String,
    per_second: f64,
    p50: Duration,
    p99: Duration,
    mean_batch: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Batches of `batch` inputs straight to the worker, one at a time, for `seconds`.
async fn worker_alone(
    worker: &mut DeviceWorkerClient<Channel>,
    inputs: &[String],
    batch: usize,
    seconds: f64,
) -> Row {
    let mut latencies = Vec::new();
    let (mut done, mut i) = (0usize, 0usize);
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < seconds {
        let batch_inputs = (0..batch)
            .map(|k| text(&inputs[(i + k) % inputs.len()]))
            .collect();
        i += batch;
        let t = Instant::now();
        worker
            .execute_batch(ExecuteBatchRequest {
                tool: "embed".into(),
                inputs: batch_inputs,
                traces: vec![],
            })
            .await
            .expect("worker batch failed");
        latencies.push(t.elapsed());
        done += batch;
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    Row {
        path: format!("worker alone, batch {batch}"),
        per_second: done as f64 / elapsed,
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
        mean_batch: batch as f64,
    }
}

/// `concurrency` callers, one sentence per call, for `seconds` after a one-second warm-up.
async fn through_scheduler(
    scheduler: &SchedulerClient<Channel>,
    inputs: Arc<Vec<String>>,
    concurrency: usize,
    seconds: f64,
) -> Row {
    let stop = Arc::new(AtomicBool::new(false));
    let counting = Arc::new(AtomicBool::new(false));
    let batch_sum = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (mut client, inputs) = (scheduler.clone(), inputs.clone());
        let (stop, counting, batch_sum) = (stop.clone(), counting.clone(), batch_sum.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = c * 7;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let reply = client
                    .call_tool(CallToolRequest {
                        tool: "embed".into(),
                        input: Some(text(&inputs[i % inputs.len()])),
                    })
                    .await
                    .expect("call failed")
                    .into_inner();
                i += 1;
                if counting.load(Ordering::Relaxed) {
                    latencies.push(t.elapsed());
                    batch_sum.fetch_add(u64::from(reply.batch_size), Ordering::Relaxed);
                }
            }
            latencies
        }));
    }
    let elapsed = count_for(seconds, &counting, &stop).await;
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    latencies.sort();
    let n = latencies.len() as f64;
    Row {
        path: format!(
            "scheduler, {concurrency} caller{}",
            if concurrency == 1 { "" } else { "s" }
        ),
        per_second: n / elapsed,
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
        mean_batch: batch_sum.load(Ordering::Relaxed) as f64 / n.max(1.0),
    }
}

async fn run(seconds: f64, batch_size: usize) {
    let models = fleet::models_dir();
    let options = FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: {batch_size}, \
             max_pending: 100000}}\n",
            models.join("all-minilm-l6-v2").display()
        )),
        ..Default::default()
    };
    let mut fleet = Fleet::start(options).await;
    let scheduler = SchedulerClient::new(fleet::rpc_channel(&fleet.scheduler_addr));
    let worker_addr = std::fs::read_to_string(fleet.dir.join("device-worker.addr")).unwrap();
    let mut worker = DeviceWorkerClient::new(fleet::rpc_channel(worker_addr.trim()));
    // The first call loads and places the model; the worker then serves direct batches too.
    scheduler
        .clone()
        .call_tool(CallToolRequest {
            tool: "embed".into(),
            input: Some(text("warm up")),
        })
        .await
        .expect("the first embed call failed");

    let device = std::env::var("NOMAD_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    println!(
        "Interleaved per level, {seconds} s each, one worker on {device}, `batch_size: \
         {batch_size}`.\n"
    );
    for (workload, inputs) in workloads() {
        let inputs = Arc::new(inputs);
        println!("### {workload}\n");
        println!("| path | inputs/s | p50 | p99 | mean batch |\n|---|---|---|---|---|");
        let mut rows = Vec::new();
        for (batch, callers) in [(1, 1), (8, 8), (batch_size, 2 * batch_size)] {
            rows.push(worker_alone(&mut worker, &inputs, batch, seconds).await);
            rows.push(through_scheduler(&scheduler, inputs.clone(), callers, seconds).await);
        }
        for r in &rows {
            println!(
                "| {} | {:.1} | {:.1} ms | {:.1} ms | {:.1} |",
                r.path,
                r.per_second,
                r.p50.as_secs_f64() * 1e3,
                r.p99.as_secs_f64() * 1e3,
                r.mean_batch
            );
        }
        let (alone1, via1) = (&rows[0], &rows[1]);
        let (alone_full, via_full) = (&rows[4], &rows[5]);
        println!(
            "\nconcurrency 1: p50 {:+.2} ms over the worker's batch of 1; concurrency {}: {:.1} % \
             of the worker's batch-{batch_size} rate, p99 / p50 = {:.2}\n",
            (via1.p50.as_secs_f64() - alone1.p50.as_secs_f64()) * 1e3,
            2 * batch_size,
            100.0 * via_full.per_second / alone_full.per_second,
            via_full.p99.as_secs_f64() / via_full.p50.as_secs_f64()
        );
    }
    fleet.terminate().await;
}

const USAGE: &str = "\
Usage: nomad-embed-bench [--seconds S] [--batch-size N]
`embed` through the scheduler beside the worker's own batch rates (defaults: 5 s, batch 32).";

fn main() {
    check_args(USAGE, &["--seconds", "--batch-size"], &[]);
    let seconds: f64 = arg("--seconds", "5").parse().expect("--seconds");
    let batch_size: usize = arg("--batch-size", "32").parse().expect("--batch-size");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(seconds, batch_size));
}
