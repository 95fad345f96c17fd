//! The docker compose stack, as `docker compose up` runs it, with the OTLP test receiver in
//! the Collector's and Jaeger's place (deploy/compose/test.yml). Needs Docker and the images
//! scripts/compose-test builds, so it is ignored unless run from there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant, SystemTime};

use nomad_integration_tests::finished_run;
use nomad_integration_tests::fleet::{TEST_TOKEN, models_dir, rpc_channel};
use nomad_integration_tests::process::{binary, succeeded_blocking};
use nomad_integration_tests::spans::{SpanRecord, check_rollout_traces, from_otlp};
use nomad_proto::jaeger::query_service_client::QueryServiceClient;
use nomad_proto::jaeger::{FindTracesRequest, TraceQueryParameters};
use nomad_proto::v1::head_client::HeadClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{ListWorkersRequest, StartRunRequest};
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;
use prost::Message as _;
use serde_json::{Value, json};

const PROJECT: &str = "nomad-compose-test";

struct Stack {
    root: PathBuf,
    /// `docker compose` (v2) or `docker-compose` (v1).
    program: Vec<String>,
    image: String,
}

impl Stack {
    fn new() -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .canonicalize()
            .unwrap();
        let v2 = std::process::Command::new("docker")
            .args(["compose", "version"])
            .output()
            .is_ok_and(|o| o.status.success());
        let program = if v2 {
            vec!["docker".into(), "compose".into()]
        } else {
            vec!["docker-compose".into()]
        };
        let image = std::env::var("NOMAD_IMAGE").unwrap_or_else(|_| "nomad:compose-test".into());
        Self {
            root,
            program,
            image,
        }
    }

    fn compose(&self, args: &[&str]) -> Output {
        std::process::Command::new(&self.program[0])
            .args(&self.program[1..])
            .current_dir(&self.root)
            .args([
                "-p",
                PROJECT,
                "-f",
                "docker-compose.yml",
                "-f",
                "deploy/compose/test.yml",
            ])
            .args(args)
            .env("NOMAD_IMAGE", &self.image)
            .env("NOMAD_AUTH_TOKEN", TEST_TOKEN)
            .env("NOMAD_TEST_MODELS_DIR", models_dir())
            .env("COMPOSE_PROFILES", "cpu")
            .output()
            .unwrap()
    }

    fn must(&self, args: &[&str]) -> String {
        let out = self.compose(args);
        assert!(
            out.status.success(),
            "compose {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn logs(&self) -> String {
        let out = self.compose(&["logs", "--no-color", "--tail", "40"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("compose logs:\n{}", self.logs());
        }
        let _ = self.compose(&["down", "-v", "--remove-orphans", "--timeout", "20"]);
    }
}

async fn head() -> HeadClient<nomad_rpc::Channel> {
    HeadClient::new(rpc_channel("127.0.0.1:7000"))
}

/// Runs `tasks` through the head container; `during` sees the run's progress while it runs.
async fn run(
    tasks: &[Value],
    concurrency: u32,
    mut during: impl FnMut(u32),
) -> (String, Vec<Value>) {
    let mut head = head().await;
    let run_id = head
        .start_run(StartRunRequest {
            tasks_json: tasks.iter().map(Value::to_string).collect(),
            concurrency,
        })
        .await
        .unwrap()
        .into_inner()
        .run_id;
    let within = (Duration::from_secs(300), Duration::from_millis(100));
    let run = finished_run(&mut head, &run_id, within, |state| {
        during(state.succeeded + state.failed)
    })
    .await;
    let results = run
        .results_json
        .iter()
        .map(|r| serde_json::from_str(r).unwrap())
        .collect();
    (run_id, results)
}

/// The run's spans from the receiver's Jaeger api_v3 query service.
async fn find_spans(run_id: &str) -> Vec<SpanRecord> {
    let mut client = QueryServiceClient::connect("http://127.0.0.1:16685")
        .await
        .unwrap();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    let request = FindTracesRequest {
        query: Some(TraceQueryParameters {
            attributes: [("nomad.run.id".to_owned(), run_id.to_owned())].into(),
            start_time_min: Some(prost_types::Timestamp {
                seconds: now.as_secs() as i64 - 3600,
                nanos: 0,
            }),
            start_time_max: Some(prost_types::Timestamp {
                seconds: now.as_secs() as i64 + 60,
                nanos: 0,
            }),
            search_depth: 10_000,
            ..Default::default()
        }),
    };
    let mut stream = client.find_traces(request).await.unwrap().into_inner();
    let mut spans = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        let decoded: Vec<ResourceSpans> = chunk
            .resource_spans
            .iter()
            .map(|b| ResourceSpans::decode(b.as_slice()).unwrap())
            .collect();
        spans.extend(from_otlp(&decoded));
    }
    spans
}

fn embed_tasks(prefix: &str, count: usize) -> Vec<Value> {
    (0..count)
        .map(|i| {
            json!({"id": format!("{prefix}-{i}"), "tool": "embed",
                   "arguments": {"text": format!("sentence number {i} about {prefix}")}})
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker and the images scripts/compose-test builds; run it with scripts/compose-test"]
async fn the_compose_stack_serves_rollouts_as_whole_traces_and_survives_a_stopped_worker() {
    let stack = Stack::new();
    let _ = stack.compose(&["down", "-v", "--remove-orphans"]);
    stack.must(&["up", "-d", "--no-build", "--scale", "device-worker-cpu=2"]);

    // Ready: the head answers its health check and both workers registered.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let healthy = std::process::Command::new(binary("nomad"))
            .args(["health", "127.0.0.1:7000"])
            .output()
            .is_ok_and(|o| o.status.success());
        if healthy {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stack did not become healthy"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Every call needs the fleet's token; without it, UNAUTHENTICATED.
    let stranger = SchedulerClient::connect("http://127.0.0.1:7002")
        .await
        .unwrap()
        .list_workers(ListWorkersRequest {})
        .await
        .unwrap_err();
    assert_eq!(stranger.code(), tonic::Code::Unauthenticated);
    let mut scheduler = SchedulerClient::new(rpc_channel("127.0.0.1:7002"));
    let workers = |s: &mut SchedulerClient<nomad_rpc::Channel>| {
        let mut s = s.clone();
        async move {
            s.list_workers(ListWorkersRequest {})
                .await
                .unwrap()
                .into_inner()
                .workers
                .len()
        }
    };
    while workers(&mut scheduler).await < 2 {
        assert!(Instant::now() < deadline, "two workers did not register");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The MCP endpoint answers agents in other containers, who reach it as gateway:7010; a Host
    // it does not know (DNS rebinding) is refused.
    for (host, expected) in [
        ("gateway:7010", "HTTP/1.1 200"),
        ("attacker.example", "HTTP/1.1 403"),
    ] {
        let response = mcp_initialize("127.0.0.1:7010", host).await;
        assert!(response.starts_with(expected), "Host {host}: {response}");
    }

    // Rollouts through the containers, tool calls and sandboxed code alike: each is one trace
    // with spans of all four services, each service in its own container.
    let mut tasks = embed_tasks("trace", 30);
    for i in 0..10 {
        tasks.push(json!({"id": format!("code-{i}"), "code": format!(
            "from mcp_tools.nomad import embed\nRESULT = len(embed('code task {i}')['output'])"),
            "expected": 384}));
    }
    let (run_id, results) = run(&tasks, 8, |_| {}).await;
    assert_eq!(results.len(), 40);
    assert!(
        results
            .iter()
            .all(|r| r["status"] == "ok" && r["reward"] != 0.0),
        "{results:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let spans = loop {
        // Spans reach the receiver on each service's export schedule.
        let spans = find_spans(&run_id).await;
        let complete = results.iter().all(|r| {
            let services: BTreeSet<&str> = spans
                .iter()
                .filter(|s| r["trace_id"] == s.trace_id.as_str())
                .map(|s| s.service_name.as_str())
                .collect();
            services.len() == 4
        });
        if complete || Instant::now() > deadline {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    check_rollout_traces(&spans, &results, &run_id);
    for r in &results {
        let mut hosts: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for s in spans
            .iter()
            .filter(|s| r["trace_id"] == s.trace_id.as_str())
        {
            hosts
                .entry(s.service_name.as_str())
                .or_default()
                .insert(s.resource["host.name"].as_str());
        }
        let all: BTreeSet<&str> = hosts.values().flatten().copied().collect();
        assert_eq!(all.len(), 4, "four services in four containers: {hosts:?}");
    }
    // The README's query, from the host.
    let out = succeeded_blocking(std::process::Command::new(binary("nomad")).args([
        "traces",
        &run_id,
        "--jaeger",
        "127.0.0.1:16685",
        "--json",
    ]));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 40);

    // One worker container stops mid-run: every request is still answered.
    let ids = stack.must(&["ps", "-q", "device-worker-cpu"]);
    let ids: Vec<&str> = ids.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    let victim = ids[1].trim().to_owned();
    let mut stopped = false;
    let (stop_run, results) = run(&embed_tasks("stop", 300), 16, |done| {
        if !stopped && done >= 30 {
            stopped = true;
            succeeded_blocking(
                std::process::Command::new("docker").args(["stop", "--time", "10", &victim]),
            );
        }
    })
    .await;
    assert!(stopped, "the run ended before a worker could be stopped");
    assert_eq!(results.len(), 300);
    let failed: Vec<&Value> = results.iter().filter(|r| r["status"] != "ok").collect();
    assert!(
        failed.is_empty(),
        "requests lost to the stopped worker: {failed:?}"
    );
    // The stopped worker had its share of the run before it went.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let served = find_spans(&stop_run)
            .await
            .iter()
            .filter(|s| s.name == "nomad.device.execute")
            .filter(|s| victim.starts_with(s.resource["host.name"].as_str()))
            .count();
        if served > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stopped worker served none of the run: the test stopped an idle worker"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A worker that went silent is dropped after three heartbeat intervals (3 s here).
    let deadline = Instant::now() + Duration::from_secs(15);
    while workers(&mut scheduler).await != 1 {
        assert!(
            Instant::now() < deadline,
            "the stopped worker is still registered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An MCP `initialize` POST with `Host: host` and the fleet's token; the response head.
async fn mcp_initialize(addr: &str, host: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut response))
        .await
        .map_or(0, |r| r.unwrap_or(0));
    String::from_utf8_lossy(&response[..n]).into_owned()
}
