//! MCP Tasks end to end: a fleet started with `nomad up` on a config of its own, called by a
//! real client of the extension (fastmcp-tasks) and by the official MCP client, which does not
//! declare it. Code mode's sandboxed runs and the fleet's tools both become tasks; a task's
//! handle comes at once and its result equals the inline call's; a cancel stops the work (the
//! scheduler's queue empties); sixteen tasks at once all answer; a full store refuses by name;
//! another credential finds nothing; a gateway killed with SIGKILL and started again finds its
//! tasks, failed or completed; a finished task expires after its TTL.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::{TEST_TOKEN, rpc_channel};
use nomad_integration_tests::model_host::host_env;
use nomad_integration_tests::peers::{TasksClient, mcp_client};
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{start_fleet, up_command};
use nomad_integration_tests::{assert_says, read_jsonl, wait_until};
use nomad_proto::v1::scheduler_client::SchedulerClient;
use serde_json::{Value, json};

/// A second credential: one of `auth.client_tokens_file`'s.
const CLIENT_TOKEN: &str = "client-token-bbbbbbbbbbbbbbbb";
/// The store's bounds in the config below.
const MAX_TASKS: usize = 24;
const TTL_SECONDS: u64 = 20;

fn config(dir: &Path) -> PathBuf {
    std::fs::write(
        dir.join("helpers.py"),
        "import time\n\n\ndef slow(seconds: float) -> float:\n    \"\"\"Sleeps `seconds`, then \
         returns twice them.\"\"\"\n    time.sleep(seconds)\n    return 2 * seconds\n",
    )
    .unwrap();
    std::fs::write(dir.join("clients"), format!("# tenants\n{CLIENT_TOKEN}\n")).unwrap();
    let path = dir.join("nomad.yml");
    std::fs::write(
        &path,
        format!(
            "tools:\n  - helpers.slow\nauth:\n  client_tokens_file: {clients}\ngateway:\n  \
             tasks:\n    path: {store}\n    ttl_seconds: {TTL_SECONDS}\n    max_tasks: {MAX_TASKS}\n    \
             link_results_over_bytes: 16384\n\
             sandbox:\n  timeout_seconds: 180\ntool_manager:\n  heartbeat_interval_ms: 200\n\
             telemetry:\n  metric_export_interval_seconds: 0.5\n",
            clients = dir.join("clients").display(),
            store = dir.join("tasks.sqlite").display(),
        ),
    )
    .unwrap();
    path
}

/// The fleet's `fleet.json`, once `nomad up` wrote it.
async fn up(dir: &Path, config: &Path) -> (tokio::process::Child, Value) {
    start_fleet(
        up_command(config, &dir.join("runs"), "tasks")
            .args(["--ready-timeout", "300"])
            .envs(host_env())
            .env("NOMAD_AUTH_TOKEN", TEST_TOKEN)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100"),
        &dir.join("runs/tasks"),
        Some(&dir.join("up.stderr")),
        Duration::from_secs(330),
    )
    .await
}

/// Polls `task_id` until its status is `want` (at most `within`); the last answer.
async fn status_becomes(
    client: &mut TasksClient,
    task_id: &str,
    want: &str,
    within: Duration,
) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let got = client
            .ask(json!({"op": "status", "task_id": task_id}))
            .await;
        if got["status"] == want || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The largest value the gateway exported for metric `name` with `attribute` = `value`.
fn exported(run_dir: &Path, name: &str, attribute: (&str, &str)) -> f64 {
    read_jsonl(&run_dir.join("gateway.jsonl"))
        .iter()
        .filter(|r| r["signal"] == "metric" && r["name"] == name)
        .filter(|r| r["attributes"][attribute.0] == attribute.1)
        .filter_map(|r| r["value"].as_f64())
        .fold(0.0, f64::max)
}

/// The newest value the gateway exported for metric `name`.
fn latest(run_dir: &Path, name: &str) -> f64 {
    read_jsonl(&run_dir.join("gateway.jsonl"))
        .iter()
        .rev()
        .filter(|r| r["signal"] == "metric" && r["name"] == name)
        .find_map(|r| r["value"].as_f64())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_calls_are_tasks_a_client_polls_cancels_and_finds_again_after_a_crash() {
    let dir = nomad_integration_tests::Fleet::new_dir();
    let config = config(&dir);
    let (mut fleet_process, fleet) = up(&dir, &config).await;
    let run_dir = PathBuf::from(fleet["run_dir"].as_str().unwrap());
    let code_url = fleet["gateway_mcp"].as_str().unwrap().to_owned();
    let tools_url = fleet["tools_mcp"].as_str().unwrap().to_owned();
    let mut scheduler = SchedulerClient::new(rpc_channel(fleet["scheduler"].as_str().unwrap()));

    // A sandboxed run of a minute, inline (the official client declares no extension) and as a
    // task, side by side.
    let long_code = "import time\ntime.sleep(60)\nRESULT = {'answer': 6 * 7}";
    let inline = {
        let url = code_url.clone();
        let calls = json!([{"tool": "execute_mcp_code", "arguments": {"code": long_code},
                            "timeout": 140}]);
        tokio::spawn(async move { mcp_client(&url, "auto", Some(TEST_TOKEN), &calls).await })
    };
    let mut code = TasksClient::start(&code_url, TEST_TOKEN);
    let long = code
        .ask(json!({"op": "start", "tool": "execute_mcp_code", "arguments": {"code": long_code}}))
        .await;
    assert_eq!(long["status"], "working", "{long}");
    assert!(
        long["seconds"].as_f64().unwrap() < 1.0,
        "the handle of a minute-long run took {}s",
        long["seconds"]
    );
    assert_eq!(long["handle"]["resultType"], "task");
    assert_eq!(long["handle"]["ttlMs"], TTL_SECONDS * 1000);

    // Sixteen tasks of the fleet's tool at once, each with its own answer.
    let mut tools = TasksClient::start(&tools_url, TEST_TOKEN);
    let mut started = Vec::new();
    for i in 0..16 {
        let seconds = 0.01 * i as f64;
        let task = tools
            .ask(json!({"op": "start", "tool": "slow", "arguments": {"seconds": seconds}}))
            .await;
        assert_eq!(task["status"], "working", "task {i}: {task}");
        started.push((task, seconds));
    }
    for (i, (task, seconds)) in started.iter().enumerate() {
        let result = tools
            .ask(json!({"op": "result", "task_id": task["task_id"], "timeout": 120}))
            .await;
        assert_eq!(result["is_error"], false, "task {i}: {result}");
        let got = result["structured"]["result"].as_f64().unwrap();
        assert!((got - 2.0 * seconds).abs() < 1e-9, "task {i}: {result}");
    }

    // Another credential finds none of them, and cannot cancel them.
    let mut other = TasksClient::start(&tools_url, CLIENT_TOKEN);
    let first = &started[0].0;
    other
        .ask(json!({"op": "adopt", "handle": first["handle"], "tool": "slow"}))
        .await;
    let refused = other
        .ask(json!({"op": "status", "task_id": first["task_id"]}))
        .await;
    let why = refused["exception"].as_str().unwrap_or_default();
    assert!(
        why.contains("-32602") && why.contains("another credential"),
        "{refused}"
    );
    let refused = other
        .ask(json!({"op": "cancel", "task_id": first["task_id"]}))
        .await;
    assert!(refused["exception"].is_string(), "{refused}");
    let mine = tools
        .ask(json!({"op": "status", "task_id": first["task_id"]}))
        .await;
    assert_eq!(mine["status"], "completed", "{mine}");
    // The other credential's own tasks work as anyone's.
    let theirs = other
        .ask(json!({"op": "start", "tool": "slow", "arguments": {"seconds": 0.05}}))
        .await;
    let result = other
        .ask(json!({"op": "result", "task_id": theirs["task_id"]}))
        .await;
    assert_eq!(result["structured"]["result"], 0.1, "{result}");

    // Working tasks fill the store: the next one is refused by name. (The minute-long run is
    // one of them; finished tasks are evicted to make room.)
    let mut waiting = Vec::new();
    let refusal = loop {
        let task = tools
            .ask(json!({"op": "start", "tool": "slow", "arguments": {"seconds": 20}}))
            .await;
        if task["exception"].is_string() {
            break task;
        }
        waiting.push(task["task_id"].as_str().unwrap().to_owned());
        assert!(
            waiting.len() <= MAX_TASKS,
            "no refusal after {} tasks",
            waiting.len()
        );
    };
    // The minute-long run holds the last place, unless it has ended by now.
    assert!(
        waiting.len() >= MAX_TASKS - 1,
        "{} then {refusal}",
        waiting.len()
    );
    let why = refusal["exception"].as_str().unwrap();
    assert!(
        why.contains(&format!("gateway.tasks.max_tasks is {MAX_TASKS}")),
        "{refusal}"
    );

    // A cancel is seen at once, and every cancelled request leaves the scheduler's queue.
    let last = waiting.last().unwrap().clone();
    let began = Instant::now();
    let acknowledged = tools.ask(json!({"op": "cancel", "task_id": last})).await;
    assert_eq!(acknowledged["acknowledged"], true, "{acknowledged}");
    let cancelled = status_becomes(&mut tools, &last, "cancelled", Duration::from_secs(2)).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "{:?}",
        began.elapsed()
    );
    for task_id in &waiting {
        tools.ask(json!({"op": "cancel", "task_id": task_id})).await;
    }
    let queue_length = |snapshot: &nomad_proto::v1::SchedulerSnapshot| {
        snapshot
            .tools
            .iter()
            .find(|t| t.name == "slow")
            .map_or(0, |t| t.queue_length)
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut queued = u32::MAX;
    while Instant::now() < deadline {
        let snapshot = scheduler
            .snapshot(nomad_proto::v1::SchedulerSnapshotRequest {})
            .await
            .unwrap()
            .into_inner();
        queued = queue_length(&snapshot);
        if queued == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(queued, 0, "cancelled tasks are still queued");

    // The minute-long run's result equals the inline call's.
    let task_result = code
        .ask(json!({"op": "result", "task_id": long["task_id"], "timeout": 140}))
        .await;
    let inline = inline.await.unwrap();
    assert_eq!(inline[0]["is_error"], false, "{}", inline[0]);
    assert_eq!(task_result["is_error"], false, "{task_result}");
    for field in ["result", "status", "returncode", "stdout", "error"] {
        assert_eq!(
            task_result["structured"][field], inline[0]["structured"][field],
            "{field}: task {task_result} inline {}",
            inline[0]
        );
    }
    assert_eq!(task_result["structured"]["result"], json!({"answer": 42}));

    // A task is part of its caller's trace: its span under the call's context, the sandboxed
    // run's beneath it.
    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traced = code
        .ask(json!({"op": "start", "tool": "execute_mcp_code",
                    "arguments": {"code": "RESULT = 1"},
                    "meta": {"traceparent": format!("00-{TRACE_ID}-00f067aa0ba902b7-01")}}))
        .await;
    code.ask(json!({"op": "result", "task_id": traced["task_id"]}))
        .await;

    // A cancelled sandboxed run is killed: the gateway's count of running runs falls to zero.
    let runs = code
        .ask(json!({"op": "start", "tool": "execute_mcp_code",
                    "arguments": {"code": "import time\ntime.sleep(120)"}}))
        .await;
    let running = || latest(&run_dir, "nomad.gateway.sandbox.runs.active");
    let deadline = Instant::now() + Duration::from_secs(10);
    while running() < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(running(), 1.0, "the run never showed as running");
    code.ask(json!({"op": "cancel", "task_id": runs["task_id"]}))
        .await;
    let deadline = Instant::now() + Duration::from_secs(3);
    while running() > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(running(), 0.0, "a cancelled run is still running");

    // A large result comes as a link, read with resources/read by its owner only.
    let large = code
        .ask(json!({"op": "start", "tool": "execute_mcp_code",
                    "arguments": {"code": "RESULT = 'x' * 50000"}}))
        .await;
    let links = code
        .ask(json!({"op": "links", "task_id": large["task_id"]}))
        .await;
    let link = &links["links"][0];
    assert_eq!(link["mime_type"], "application/json", "{links}");
    let uri = link["uri"].as_str().unwrap();
    let read = code.ask(json!({"op": "read", "uri": uri})).await;
    let read: Value = serde_json::from_str(read["text"].as_str().unwrap()).unwrap();
    assert_eq!(read["result"].as_str().unwrap().len(), 50_000);
    assert_eq!(read["status"], "ok");
    assert_eq!(
        link["size"].as_u64().unwrap(),
        read.to_string().len() as u64
    );
    // (Resource not found: -32602 from the 2026-07-28 revision on, -32002 before.)
    let refused = other.ask(json!({"op": "read", "uri": uri})).await;
    assert_says(&refused, "exception", "no result at nomad://results/");

    // The task's span and the sandboxed run's are in the caller's trace (exported before the
    // gateway is killed below).
    let spans = |name: &str| {
        read_jsonl(&run_dir.join("gateway.jsonl"))
            .into_iter()
            .filter(|r| r["signal"] == "span" && r["trace_id"] == TRACE_ID && r["name"] == name)
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while spans("nomad.gateway.task") == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(spans("nomad.gateway.task"), 1);
    let task_span = read_jsonl(&run_dir.join("gateway.jsonl"))
        .into_iter()
        .find(|r| r["trace_id"] == TRACE_ID && r["name"] == "nomad.gateway.task")
        .unwrap();
    assert_eq!(
        task_span["parent_span_id"], "00f067aa0ba902b7",
        "{task_span}"
    );
    assert_eq!(task_span["attributes"]["nomad.task.status"], "completed");
    assert!(spans("nomad.gateway.execute_mcp_code") >= 1);

    // The gateway killed outright and started again by the fleet: the task that was working is
    // failed, saying why; the one that had completed is still there.
    let done = code
        .ask(
            json!({"op": "start", "tool": "execute_mcp_code", "arguments": {"code": "RESULT = 7"}}),
        )
        .await;
    let result = code
        .ask(json!({"op": "result", "task_id": done["task_id"]}))
        .await;
    assert_eq!(result["structured"]["result"], 7, "{result}");
    let cut = code
        .ask(json!({"op": "start", "tool": "execute_mcp_code",
                    "arguments": {"code": "import time\ntime.sleep(120)"}}))
        .await;
    let gateway_pid = fleet["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "gateway")
        .unwrap()["pid"]
        .as_i64()
        .unwrap();
    send_signal(gateway_pid, libc::SIGKILL);
    let mut again = TasksClient::start(&code_url, TEST_TOKEN);
    for task in [&cut, &done] {
        again
            .ask(json!({"op": "adopt", "handle": task["handle"], "tool": "execute_mcp_code"}))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let got = again
            .ask(json!({"op": "status", "task_id": cut["task_id"]}))
            .await;
        if got["status"].is_string() || Instant::now() >= deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let restarted = Instant::now();
    let kept = again
        .ask(json!({"op": "status", "task_id": done["task_id"]}))
        .await;
    assert_eq!(kept["status"], "completed", "{kept}");
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_says(
        &failed,
        "status_message",
        "the gateway stopped while this task was working",
    );

    // Past its TTL a finished task is gone.
    tokio::time::sleep(Duration::from_secs(TTL_SECONDS + 1).saturating_sub(restarted.elapsed()))
        .await;
    let expired = again
        .ask(json!({"op": "status", "task_id": cut["task_id"]}))
        .await;
    assert_says(&expired, "exception", "-32602");

    wait_until(
        "the full store's rejection exported",
        Duration::from_secs(10),
        || exported(&run_dir, "nomad.gateway.tasks.rejected", ("reason", "full")) >= 1.0,
    )
    .await;
    for (name, attribute, at_least) in [
        ("nomad.gateway.tasks.created", ("tool", "slow"), 16.0),
        (
            "nomad.gateway.tasks.finished",
            ("outcome", "cancelled"),
            (MAX_TASKS - 1) as f64,
        ),
        ("nomad.gateway.tasks.removed", ("reason", "evicted"), 1.0),
    ] {
        let seen = exported(&run_dir, name, attribute);
        assert!(
            seen >= at_least,
            "{name} {attribute:?}: {seen} < {at_least}"
        );
    }

    send_signal(fleet_process.id().unwrap(), libc::SIGTERM);
    let _ = tokio::time::timeout(Duration::from_secs(30), fleet_process.wait()).await;
    let _ = std::fs::remove_dir_all(&dir);
}
