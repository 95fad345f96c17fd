//! Scheduler benchmarks over real processes on loopback:
//! - dispatch throughput of one scheduler with 1, 4, 16, 64 simulated workers of zero latency;
//! - added latency per hop (client -> scheduler -> worker -> back, no-op model), p50/p99, next to
//!   a direct worker call and an in-process call measured in the same run.
//!
//! - with `--soak MINUTES`: mixed traffic through the gateway; every service's RSS must stay
//!   within 10 % after warm-up (exit 1 otherwise);
//! - with `--collector-outage run`: throughput with OTLP export to a healthy receiver, a refused
//!   port and a black hole, interleaved.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-bench`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nomad_integration_tests::{
    Fleet, FleetOptions, arg, check_args, count_for, text_call, text_input,
};
use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{ExecuteBatchRequest, ToolInput, ToolOutput, tool_input, tool_output};
use tonic::transport::Channel;

fn input(i: u64) -> ToolInput {
    text_input(format!("r{i}"), "")
}

fn tools(batch_size: u32, max_devices: usize) -> String {
    format!(
        "tools:\n  - {{name: t, kind: mlp, source: sim, batch_size: {batch_size}, \
         max_devices: {max_devices}, max_pending: 1000000}}\n\
         tool_manager:\n  max_batch_delay_ms: 0\n  heartbeat_interval_ms: 1000\n"
    )
}

async fn fleet(workers: usize, batch_size: u32) -> Fleet {
    fleet_with(workers, batch_size, &[]).await
}

async fn fleet_with(workers: usize, batch_size: u32, env: &[(&str, String)]) -> Fleet {
    let mut options = FleetOptions {
        sim_workers: workers,
        tools_yaml: Some(tools(batch_size, workers)),
        config_yaml: "sim:\n  base_latency_ms: 0\n".into(),
        ..Default::default()
    };
    for (k, v) in env {
        options = options.env(k, v.clone());
    }
    Fleet::start(options).await
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
    let fleet = fleet(workers, 64).await;
    let (rate, batch, _) = measure(fleet, concurrency, seconds).await;
    (rate, batch)
}

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    nomad_telemetry::process::rss_bytes(Some(pid)).unwrap_or(0)
}

/// Throughput with telemetry on (every span group) and OTLP going to a healthy receiver, to a
/// port that refuses connections, and to one that accepts and never answers; interleaved
/// rounds. Also the scheduler's RSS at the end of each, and its log lines about export.
async fn collector_outage(concurrency: usize, seconds: f64, rounds: usize) {
    use nomad_integration_tests::OtlpReceiver;
    let receiver = OtlpReceiver::grpc().await;
    let refusing = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }; // dropped: nothing listens there now
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket); // accepted, never read, never answered
        }
    });
    let backends = [
        ("healthy receiver", receiver.endpoint.clone()),
        ("refused (nothing listening)", format!("http://{refusing}")),
        (
            "black hole (accepts, never answers)",
            format!("http://{hole_addr}"),
        ),
    ];
    let mut results: Vec<(Vec<f64>, Vec<u64>, Vec<usize>)> = vec![Default::default(); 3];
    for _ in 0..rounds {
        for (i, (_, endpoint)) in backends.iter().enumerate() {
            let env = [
                ("NOMAD_OTEL_ENABLED", "true".to_owned()),
                ("NOMAD_OTEL_SPAN_GROUPS", "all".to_owned()),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.clone()),
                ("OTEL_METRIC_EXPORT_INTERVAL", "1000".to_owned()),
            ];
            let fleet = fleet_with(1, 64, &env).await;
            let (rate, _, (rss, export_lines)) = measure(fleet, concurrency, seconds).await;
            results[i].0.push(rate);
            results[i].1.push(rss);
            results[i].2.push(export_lines);
        }
    }
    let healthy = results[0].0.iter().sum::<f64>() / rounds as f64;
    println!(
        "| OTLP endpoint | requests/s (mean of {rounds}) | vs healthy | scheduler RSS at end | scheduler log lines about export |"
    );
    println!("|---|---|---|---|---|");
    for ((name, _), (rates, rss, lines)) in backends.iter().zip(&results) {
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        println!(
            "| {name} | {mean:.0} | {:.3} | {:.0} MiB | {} |",
            mean / healthy,
            *rss.iter().max().unwrap() as f64 / (1 << 20) as f64,
            lines.iter().max().unwrap()
        );
    }
}

/// Mixed traffic through the gateway for `minutes`: direct tool calls, sandboxed code calling
/// the tool, and calls abandoned by a short deadline; telemetry on, exported to a receiver that
/// counts and discards. Samples every service's RSS; after the first quarter (warm-up), none may
/// grow more than 10 %. Returns whether all stayed flat.
async fn soak(minutes: f64, concurrency: usize) -> bool {
    use nomad_integration_tests::OtlpReceiver;
    use nomad_proto::v1::gateway_client::GatewayClient;
    use nomad_proto::v1::{ExecuteCodeRequest, GatewayCallToolRequest};
    let receiver = OtlpReceiver::grpc().await;
    receiver.discard();
    let mut options = FleetOptions {
        sim_workers: 2,
        tools_yaml: Some(
            "tools:\n  - {name: t, kind: mlp, source: sim, batch_size: 16, max_devices: 2, \
             max_pending: 100000}\ntool_manager:\n  max_batch_delay_ms: 1\n"
                .into(),
        ),
        config_yaml: "sim:\n  base_latency_ms: 1\n".into(),
        ..Default::default()
    };
    for (k, v) in [
        ("NOMAD_OTEL_ENABLED", "true".to_owned()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.clone()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "5000".to_owned()),
    ] {
        options = options.env(k, v);
    }
    let mut fleet = Fleet::start(options).await;
    // A caller that abandons calls by the thousand must remember more reset streams than h2's
    // default 10: a frame for a forgotten one counts toward h2's per-connection limit of
    // internal resets, and the 1,024th tears the connection down (as Nomad's own channels do).
    let channel = Channel::from_shared(format!("http://{}", fleet.gateway_addr))
        .unwrap()
        .http2_max_concurrent_reset_streams(4096)
        .connect()
        .await
        .unwrap();
    let gateway = GatewayClient::new(channel);
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 4]> = Arc::new(Default::default()); // ok, code, abandoned, failed
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (mut gateway, stop, counts) = (gateway.clone(), stop.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let mut i: u64 = c as u64;
            while !stop.load(Ordering::Relaxed) {
                i += concurrency as u64;
                let outcome = if i.is_multiple_of(50) {
                    gateway
                        .execute_code(ExecuteCodeRequest {
                            code: format!(
                                "from mcp_tools.nomad import t\nRESULT = t(input=[{i}.0, 1.0])"
                            ),
                            ..Default::default()
                        })
                        .await
                        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
                        .and_then(|r| {
                            let r = r.into_inner();
                            if r.error.is_empty() {
                                Ok(1)
                            } else {
                                Err(r.error)
                            }
                        })
                        .unwrap_or_else(|e| {
                            eprintln!("soak: code run failed: {e}");
                            3
                        })
                } else {
                    let mut request = tonic::Request::new(GatewayCallToolRequest {
                        server: "nomad".into(),
                        tool: "t".into(),
                        arguments_json: format!(r#"{{"input": [{i}.0, 1.0]}}"#),
                    });
                    let abandon = i % 10 == 3;
                    if abandon {
                        request.set_timeout(Duration::from_micros(500));
                    }
                    match gateway.call_tool(request).await {
                        Ok(_) => 0,
                        Err(_) if abandon => 2,
                        Err(s) => {
                            eprintln!("soak: call failed: {:?}: {}", s.code(), s.message());
                            3
                        }
                    }
                };
                counts[outcome].fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let total = Duration::from_secs_f64(minutes * 60.0);
    let warmup = total / 4;
    let interval = Duration::from_secs(2).min(total / 20);
    let started = Instant::now();
    let mut samples: Vec<(Duration, Vec<(String, u64)>)> = Vec::new();
    while started.elapsed() < total {
        tokio::time::sleep(interval).await;
        let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
        let row = fleet
            .pids()
            .into_iter()
            .map(|(service, pid)| {
                let n = seen.entry(service.name().to_owned()).or_default();
                *n += 1;
                (format!("{}-{}", service.name(), *n - 1), rss(pid))
            })
            .collect();
        samples.push((started.elapsed(), row));
        let [ok, code, abandoned, failed] = counts.each_ref().map(|c| c.load(Ordering::Relaxed));
        eprintln!(
            "soak {:>4.0} s: {ok} calls, {code} code runs, {abandoned} abandoned, {failed} failed, {} spans exported",
            started.elapsed().as_secs_f64(),
            receiver.span_count()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    fleet.terminate().await;

    let after: Vec<&(Duration, Vec<(String, u64)>)> =
        samples.iter().filter(|(t, _)| *t >= warmup).collect();
    let Some((_, base)) = after.first() else {
        eprintln!("soak too short to sample after warm-up");
        return false;
    };
    let [ok, code, abandoned, failed] = counts.each_ref().map(|c| c.load(Ordering::Relaxed));
    println!(
        "## Soak: {minutes} min, {concurrency} callers through the gateway, 2 sim workers\n\n\
         {ok} tool calls, {code} sandboxed code runs, {abandoned} calls abandoned by deadline, \
         {failed} failed; {} spans exported.\n",
        receiver.span_count()
    );
    println!(
        "| process | RSS after warm-up ({:.0} s) | peak, first half after | peak, second half | last | growth |",
        warmup.as_secs_f64()
    );
    println!("|---|---|---|---|---|---|");
    let mut flat = failed == 0;
    for (i, (name, start)) in base.iter().enumerate() {
        let series: Vec<u64> = after
            .iter()
            .filter_map(|(_, row)| row.get(i).map(|r| r.1))
            .collect();
        // Growth is the second half's peak over the first half's: a leak keeps raising the
        // peak, while an allocator's ups and downs (a sample that happened to fall in a trough
        // right after warm-up) do not.
        let (first, second) = series.split_at(series.len().div_ceil(2));
        let early = first.iter().copied().max().unwrap_or(*start).max(*start);
        let late = second.iter().copied().max().unwrap_or(early);
        let last = *series.last().unwrap();
        let growth = late as f64 / early as f64 - 1.0;
        flat &= growth <= 0.10;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "| {name} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:+.1} % |",
            mib(*start),
            mib(early),
            mib(late),
            mib(last),
            growth * 100.0
        );
    }
    println!(
        "\n{}",
        if flat {
            "Flat: no process's peak grew more than 10 % from the first half after warm-up to \
             the second, no call failed."
        } else {
            "NOT FLAT (or calls failed)."
        }
    );
    flat
}

/// Drives `fleet` at `concurrency` for `seconds`: requests/s, mean batch size, and the
/// scheduler's (RSS, log lines mentioning export) just before it stops.
async fn measure(mut fleet: Fleet, concurrency: usize, seconds: f64) -> (f64, f64, (u64, usize)) {
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
                    .call_tool(text_call("t", format!("r{i}"), ""))
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
    let elapsed = count_for(seconds, &counting, &stop).await;
    for t in tasks {
        t.await.unwrap();
    }
    let scheduler_rss = rss(fleet.pid(nomad_integration_tests::Service::Scheduler));
    fleet.terminate().await;
    let log = fleet.stderr(nomad_integration_tests::Service::Scheduler);
    let export_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.to_lowercase().contains("export") && !l.contains("telemetry export on"))
        .collect();
    if std::env::var_os("NOMAD_BENCH_SHOW_EXPORT_LOG").is_some() {
        for line in &export_lines {
            eprintln!("  {line}");
        }
    }
    let export_lines = export_lines.len();
    let n = done.load(Ordering::Relaxed) as f64;
    (
        n / elapsed,
        batch_sum.load(Ordering::Relaxed) as f64 / n.max(1.0),
        (scheduler_rss, export_lines),
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
            .call_tool(text_call("t", format!("r{i}"), ""))
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
            .call_tool(text_call("t", format!("r{i}"), ""))
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

const USAGE: &str = "\
Usage: nomad-bench [--seconds S] [--concurrency N] [--samples N] [--workers 1,4,16,64]
       nomad-bench --soak MINUTES [--callers N]
       nomad-bench --collector-outage run [--rounds N]
Scheduler dispatch throughput and added latency per hop (defaults: 5 s, 256 callers, 5000
samples); --soak: mixed traffic with every service's RSS checked; --collector-outage: throughput
with OTLP export healthy, refused and black-holed.";

fn main() {
    check_args(
        USAGE,
        &[
            "--seconds",
            "--concurrency",
            "--samples",
            "--workers",
            "--soak",
            "--callers",
            "--collector-outage",
            "--rounds",
        ],
        &[],
    );
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
    if let Some(minutes) = Some(arg("--soak", "")).filter(|m| !m.is_empty()) {
        let minutes: f64 = minutes.parse().expect("--soak MINUTES");
        let callers: usize = arg("--callers", "16").parse().expect("--callers");
        if !rt.block_on(soak(minutes, callers)) {
            std::process::exit(1);
        }
        return;
    }
    if arg("--collector-outage", "") == "run" {
        let rounds: usize = arg("--rounds", "3").parse().expect("--rounds");
        rt.block_on(async {
            println!("## Collector outage ({concurrency} concurrent callers, 1 sim worker, {seconds} s each)\n");
            collector_outage(concurrency, seconds, rounds).await;
        });
        return;
    }
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
