//! The sandbox's start-up and run latency, side by side in one run, samples interleaved:
//! a bare `python3 -I -c pass`, the same under `bwrap` with every namespace, and the gateway's
//! `ExecuteCode` (the operation behind the MCP tool `execute_mcp_code`) of `RESULT = 6 * 7` and of
//! code that calls the `embed` tool once, warm (a runner from the pool) and cold (`warm: 0`),
//! each with runs forked from the fork server and with a new interpreter per run
//! (`fork_server: false`), next to the `embed` tool called directly through the gateway; then
//! trivial code back to back, and the same at concurrency 8.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-sandbox-bench
//! [--samples 40] [--python /usr/bin/python3] [--baseline-gateway PATH]` (needs `bwrap`:
//! Debian's `bubblewrap`). With `--baseline-gateway`, every gateway row is measured a second
//! time, interleaved, with that binary (another build's gateway, "before").

use std::time::{Duration, Instant};

use nomad_integration_tests::sandbox_gateway::run_code;
use nomad_integration_tests::{Fleet, FleetOptions, Service, check_args};
use nomad_integration_tests::{arg, fleet::models_dir};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::{GatewayCallToolRequest, GatewayStatusRequest};
use tonic::transport::Channel;

const TRIVIAL: &str = "RESULT = 6 * 7";
const EMBED: &str =
    "from mcp_tools.nomad import embed\nRESULT = len(embed('A sentence to embed.')['output'])";

/// A fleet with the `embed` tool and a gateway whose pool keeps `warm` runners, forked from the
/// fork server or each a new interpreter.
async fn fleet(warm: usize, fork_server: bool, gateway: Option<&str>) -> Fleet {
    Fleet::start(
        FleetOptions {
            gateway_binary: gateway.map(Into::into),
            tools_yaml: Some(format!(
                "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: 8}}\n\
                 tool_manager:\n  heartbeat_interval_ms: 200\n  max_batch_delay_ms: 0\n",
                models_dir().join("all-minilm-l6-v2").display()
            )),
            config_yaml: format!(
                "sandbox:\n  warm: {warm}\n  max_concurrent: 16\n  fork_server: {fork_server}\n"
            ),
            ..Default::default()
        }
        .service_env(Service::Gateway, "RUST_LOG", "warn"),
    )
    .await
}

async fn execute(client: &mut GatewayClient<Channel>, code: &str) -> Duration {
    let started = Instant::now();
    let reply = run_code(client, code).await;
    assert!(reply.error.is_empty(), "{}", reply.error);
    started.elapsed()
}

async fn embed_directly(client: &mut GatewayClient<Channel>) -> Duration {
    let started = Instant::now();
    client
        .call_tool(GatewayCallToolRequest {
            server: "nomad".into(),
            tool: "embed".into(),
            arguments_json: r#"{"text": "A sentence to embed."}"#.into(),
        })
        .await
        .unwrap();
    started.elapsed()
}

fn command(program: &str, args: &[&str]) -> Duration {
    let started = Instant::now();
    let status = std::process::Command::new(program)
        .args(args)
        .env_clear()
        .status()
        .unwrap();
    assert!(status.success(), "{program} {args:?}");
    started.elapsed()
}

/// `bwrap` with every namespace around the interpreter: the system directories read-only, its
/// own /proc, a minimal /dev and a tmpfs /tmp.
fn bwrap_args(python: &str) -> Vec<String> {
    let mut args: Vec<String> = [
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    .map(String::from)
    .into();
    for dir in ["/bin", "/lib", "/lib64", "/sbin"] {
        let path = std::path::Path::new(dir);
        match std::fs::read_link(path) {
            Ok(target) => {
                args.extend(["--symlink".into(), target.display().to_string(), dir.into()])
            }
            Err(_) if path.is_dir() => args.extend(["--ro-bind".into(), dir.into(), dir.into()]),
            Err(_) => {}
        }
    }
    args.extend(
        [
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", python, "-I", "-c", "pass",
        ]
        .map(String::from),
    );
    args
}

fn quantile(samples: &mut [Duration], q: f64) -> f64 {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
    samples[i].as_secs_f64() * 1000.0
}

fn row(name: &str, samples: &mut [Duration]) {
    println!(
        "| {name} | {:.1} ms | {:.1} ms |",
        quantile(samples, 0.5),
        quantile(samples, 0.99)
    );
}

const USAGE: &str = "\
Usage: nomad-sandbox-bench [--samples N] [--python PATH] [--baseline-gateway PATH]
The sandbox's start-up and run latency: bare python, under bwrap, and the gateway's ExecuteCode\nwarm and cold, then at concurrency 8 (defaults: 40 samples, /usr/bin/python3; needs bwrap).\n--baseline-gateway measures every gateway row again with another build's gateway binary.";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    check_args(USAGE, &["--samples", "--python", "--baseline-gateway"], &[]);
    let samples: usize = arg("--samples", "40").parse().unwrap();
    let python = arg("--python", "/usr/bin/python3");
    let baseline = arg("--baseline-gateway", "");
    let mut gateways = vec![(None, "")];
    if !baseline.is_empty() {
        gateways.push((Some(baseline.as_str()), " (before)"));
    }
    let mut kinds = Vec::new();
    let mut fleets = Vec::new();
    for (binary, suffix) in &gateways {
        for (warm, fork_server, kind) in [
            (2, true, "forked, warm"),
            (0, true, "forked, cold"),
            (2, false, "new interpreter, warm"),
            (0, false, "new interpreter, cold"),
        ] {
            kinds.push(format!("{kind}{suffix}"));
            fleets.push(fleet(warm, fork_server, *binary).await);
        }
    }
    let mut clients = Vec::new();
    for f in &fleets {
        clients.push(f.gateway_client().await);
    }
    let bwrap = bwrap_args(&python);
    let bwrap: Vec<&str> = bwrap.iter().map(String::as_str).collect();
    // Warm-up: load the model, fill the pool, touch every path once.
    for _ in 0..3 {
        for c in &mut clients {
            execute(c, EMBED).await;
        }
        embed_directly(&mut clients[0]).await;
    }
    let pause = Duration::from_millis(150); // lets the pool refill between warm samples
    let mut names = vec![
        "bare `python3 -I -c pass`".to_owned(),
        "`bwrap` (every namespace) + `python3 -I -c pass`".to_owned(),
        "`embed` tool called directly through the gateway".to_owned(),
    ];
    names.extend(kinds.iter().map(|k| format!("`RESULT = 6 * 7`, {k}")));
    names.extend(
        kinds
            .iter()
            .map(|k| format!("code calling `embed` once, {k}")),
    );
    let mut results: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    for _ in 0..samples {
        results[0].push(command(&python, &["-I", "-c", "pass"]));
        results[1].push(command("bwrap", &bwrap));
        results[2].push(embed_directly(&mut clients[0]).await);
        tokio::time::sleep(pause).await;
        for (i, c) in clients.iter_mut().enumerate() {
            results[3 + i].push(execute(c, TRIVIAL).await);
        }
        tokio::time::sleep(pause).await;
        let embed_rows = 3 + kinds.len();
        for (i, c) in clients.iter_mut().enumerate() {
            results[embed_rows + i].push(execute(c, EMBED).await);
        }
    }
    println!("\nConcurrency 1, {samples} samples of each, interleaved, with gaps:\n");
    println!("| path | p50 | p99 |\n|---|---|---|");
    for (name, samples) in names.iter().zip(&mut results) {
        row(name, samples);
    }
    // Back to back: each call as soon as the last one ends (a pool cannot refill in time).
    println!("\nConcurrency 1, {samples} calls back to back:\n");
    println!("| path | p50 | p99 |\n|---|---|---|");
    let mut bare: Vec<Duration> = (0..samples)
        .map(|_| command(&python, &["-I", "-c", "pass"]))
        .collect();
    row("bare `python3 -I -c pass`", &mut bare);
    for (kind, c) in kinds.iter().zip(clients.iter_mut()) {
        let mut back_to_back = Vec::new();
        for _ in 0..samples {
            back_to_back.push(execute(c, TRIVIAL).await);
        }
        row(&format!("`RESULT = 6 * 7`, {kind}"), &mut back_to_back);
    }

    // Concurrency 8: eight callers, each with its own connection, for `samples` calls each.
    println!("\nConcurrency 8 ({samples} calls per caller):\n");
    println!("| path | runs/s | p50 | p99 | warm starts |\n|---|---|---|---|---|");
    let runs = [TRIVIAL, EMBED].into_iter().flat_map(|code| {
        let label = if code == TRIVIAL {
            "`RESULT = 6 * 7`"
        } else {
            "code calling `embed` once"
        };
        kinds
            .iter()
            .zip(&fleets)
            .map(move |(kind, fleet)| (format!("{label}, {kind}"), fleet, code))
    });
    for (name, fleet, code) in runs {
        let mut status_client = fleet.gateway_client().await;
        let before = status_client
            .status(GatewayStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let mut c = fleet.gateway_client().await;
            tasks.push(tokio::spawn(async move {
                let mut mine = Vec::new();
                for _ in 0..samples {
                    mine.push(execute(&mut c, code).await);
                }
                mine
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        let elapsed = started.elapsed().as_secs_f64();
        let after = status_client
            .status(GatewayStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        let runs = all.len();
        println!(
            "| {name} | {:.1} | {:.1} ms | {:.1} ms | {} of {runs} |",
            runs as f64 / elapsed,
            quantile(&mut all, 0.5),
            quantile(&mut all, 0.99),
            after.warm_starts - before.warm_starts
        );
    }
}
