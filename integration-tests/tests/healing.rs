//! A fleet that heals: `nomad up` starts again what dies, the run goes on, nothing in flight is
//! dropped silently. Faults as they come in production: a SIGKILL (what an OOM killer, a driver
//! fault or a crashing model does) to the device worker, then the scheduler, then the gateway,
//! in the middle of a run; `nomad serve`'s worker killed; a worker that cannot start again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::{TEST_TOKEN, make_mlp};
use nomad_integration_tests::peers::mcp_client;
use nomad_integration_tests::process::{binary, clean, spawn_piped, start_fleet, up_command};
use nomad_integration_tests::process::{exited, send_signal};
use nomad_integration_tests::spans::{check_rollout_traces, from_console};
use nomad_integration_tests::{Fleet, read_jsonl};
use serde_json::{Value, json};

/// A small `mlp` model in `dir` and a config serving it, with quick heartbeats (a restarted
/// scheduler is found again within a few of them) and `extra` appended.
fn mlp_config(dir: &Path, extra: &str) -> PathBuf {
    make_mlp(dir, "6,4", 0);
    let config = dir.join("nomad.yaml");
    std::fs::write(
        &config,
        format!(
            "tools:\n  - {{name: mlp, kind: mlp, source: {}, batch_size: 16}}\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n{extra}",
            dir.join("mlp").display()
        ),
    )
    .unwrap();
    config
}

/// The servers of a run (`servers.json`), by name: (pid, restarts).
fn servers(run_dir: &Path) -> BTreeMap<String, (Option<u64>, u64)> {
    let text = std::fs::read_to_string(run_dir.join("servers.json")).unwrap_or_default();
    let Ok(json) = serde_json::from_str::<Value>(&text) else {
        return BTreeMap::new();
    };
    json["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                (s["pid"].as_u64(), s["restarts"].as_u64().unwrap()),
            )
        })
        .collect()
}

fn kill(pid: u64) {
    send_signal(pid, libc::SIGKILL);
}

/// Waits until `name` runs again after its `restarts`-th restart; how long that took.
async fn restarted(run_dir: &Path, name: &str, restarts: u64, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if let Some((Some(_), n)) = servers(run_dir).get(name)
            && *n >= restarts
        {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "{name} was not started again within {within:?}: {:?}",
            servers(run_dir)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every span in the run directory's console files.
fn spans_of(run_dir: &Path) -> Vec<nomad_integration_tests::SpanRecord> {
    std::fs::read_dir(run_dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl") && !p.ends_with("results.jsonl"))
        .flat_map(|p| from_console(&std::fs::read_to_string(p).unwrap_or_default()))
        .collect()
}

/// 3,000 rollouts at concurrency 64 (sandboxed code that calls the tool, and direct tool calls,
/// each verified), with the device worker, then the scheduler, then the gateway SIGKILLed
/// mid-run: each comes back; every task has one result; failures are at most the rollouts in
/// flight at each fault and name it; every verified rollout that ran passed; the rollouts after
/// the last restart have whole traces; the restarts are in `servers.json`, the metrics and the
/// report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_goes_on_through_a_worker_a_scheduler_and_a_gateway_killed() {
    let dir = Fleet::new_dir();
    let config = mlp_config(&dir, "");
    let total = 3000;
    let concurrency = 64;
    let tasks: Vec<Value> = (0..total)
        .map(|i| {
            let input: Vec<f32> = (0..6)
                .map(|k| ((i * 7 + k) % 11) as f32 / 10.0 - 0.5)
                .collect();
            if i % 2 == 0 {
                json!({"id": format!("code-{i}"), "expected": [4], "code": format!(
                    "import time\nfrom mcp_tools.nomad import mlp\ntime.sleep(0.05)\n\
                     RESULT = mlp(input={input:?})['shape']")})
            } else {
                json!({"id": format!("tool-{i}"), "tool": "mlp", "arguments": {"input": input}})
            }
        })
        .collect();
    let tasks_path = dir.join("tasks.jsonl");
    std::fs::write(
        &tasks_path,
        tasks.iter().map(|t| format!("{t}\n")).collect::<String>(),
    )
    .unwrap();
    let runs = dir.join("runs");
    let up = spawn_piped(
        up_command(&config, &runs, "healing")
            .arg("--tasks")
            .arg(&tasks_path)
            .args([
                "--concurrency",
                &concurrency.to_string(),
                "--ready-timeout",
                "120",
            ]),
    );
    let run_dir = runs.join("healing");
    let results_path = run_dir.join("results.jsonl");
    let mut healed = Vec::new();
    for (name, after) in [
        ("device-worker-0", 400),
        ("scheduler", 1200),
        ("gateway", 1900),
    ] {
        let deadline = Instant::now() + Duration::from_secs(300);
        while read_jsonl(&results_path).len() < after {
            assert!(
                Instant::now() < deadline,
                "the run stalled before killing {name}: {} results",
                read_jsonl(&results_path).len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (pid, _) = servers(&run_dir)[name];
        kill(pid.unwrap());
        healed.push((
            name,
            restarted(&run_dir, name, 1, Duration::from_secs(30)).await,
        ));
    }
    let out = tokio::time::timeout(Duration::from_secs(600), up.wait_with_output())
        .await
        .expect("the run ends")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("healed: {healed:?}");

    // Every task has exactly one result.
    let results = read_jsonl(&results_path);
    let ids: BTreeSet<&str> = results
        .iter()
        .map(|r| r["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(results.len(), total, "{stderr}");
    assert_eq!(ids.len(), total, "a task has two results");
    // Failures: at most the rollouts in flight at each fault that can lose them (the worker's
    // in-flight batches are requeued), each naming the fault; none cancelled.
    let failed: Vec<&Value> = results.iter().filter(|r| r["status"] != "ok").collect();
    eprintln!(
        "{} of {total} rollouts failed; first errors: {:?}",
        failed.len(),
        failed
            .iter()
            .take(3)
            .map(|r| &r["error"])
            .collect::<Vec<_>>()
    );
    assert!(
        failed.len() <= 2 * concurrency,
        "{} rollouts failed: {:?}",
        failed.len(),
        failed.iter().take(3).collect::<Vec<_>>()
    );
    for r in &failed {
        assert_eq!(r["status"], "error", "{r}");
        let error = r["error"].as_str().unwrap();
        assert!(
            error.contains("UNAVAILABLE")
                || error.contains("scheduler")
                || error.contains("gateway"),
            "a failure that does not name its fault: {r}"
        );
    }
    // Every rollout that ran and was verified passed.
    for r in results
        .iter()
        .filter(|r| r["status"] == "ok" && !r["passed"].is_null())
    {
        assert_eq!(r["passed"], true, "{r}");
    }
    assert!(
        stdout.contains(&format!(
            "{total} rollouts: {} ok, {} failed",
            total - failed.len(),
            failed.len()
        )),
        "{stdout}"
    );
    // Each fault was healed, and said so.
    let restarts = servers(&run_dir);
    for name in ["device-worker-0", "scheduler", "gateway"] {
        assert_eq!(restarts[name].1, 1, "{name}: {restarts:?}");
        assert!(
            stderr.contains(&format!(
                "{name} exited (signal: 9 (SIGKILL)); starting it again"
            )),
            "{stderr}"
        );
    }
    // The rollouts that finished well after the last restart have whole traces.
    let spans = spans_of(&run_dir);
    let late: Vec<Value> = results[results.len() - 300..]
        .iter()
        .filter(|r| r["status"] == "ok" && r["task_id"].as_str().unwrap().starts_with("code-"))
        .cloned()
        .collect();
    assert!(late.len() > 50, "{} late code rollouts", late.len());
    check_rollout_traces(&spans, &late, "healing");
    // Every result's rollout has its root span, ended with the rollout's status.
    let roots: BTreeMap<&str, &str> = spans
        .iter()
        .filter(|s| s.name == "nomad.rollout")
        .map(|s| (s.trace_id.as_str(), s.status.as_str()))
        .collect();
    for r in &results {
        let status = roots
            .get(r["trace_id"].as_str().unwrap())
            .unwrap_or_else(|| panic!("no root span for {r}"));
        assert_eq!(
            *status,
            if r["status"] == "ok" { "ok" } else { "error" },
            "{r}"
        );
    }
    // The restarts are in the metrics and in the report.
    let counted: BTreeSet<String> = read_jsonl(&run_dir.join("head.jsonl"))
        .into_iter()
        .filter(|m| m["signal"] == "metric" && m["name"] == "nomad.servers.restarts")
        .filter_map(|m| Some(m["attributes"]["nomad.server.name"].as_str()?.to_owned()))
        .collect();
    assert_eq!(
        counted,
        BTreeSet::from(["device-worker-0", "gateway", "scheduler"].map(String::from)),
        "nomad.servers.restarts"
    );
    let report = std::fs::read_to_string(run_dir.join("report.html")).unwrap();
    assert!(
        report.contains("Restarts"),
        "the report has no restarts section"
    );
    for name in ["device-worker-0", "scheduler", "gateway"] {
        assert!(report.contains(name), "the report does not name {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `nomad serve` with its device worker SIGKILLed answers again within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomad_serve_answers_again_after_its_worker_is_killed() {
    let dir = Fleet::new_dir();
    let config = mlp_config(&dir, "");
    let port = nomad_integration_tests::free_port();
    let run_dir = dir.join("runs/serving");
    let (mut serve, _) = start_fleet(
        clean("nomad")
            .arg("serve")
            .arg(&config)
            .args(["-t", "http", "--port", &port.to_string(), "--runs-dir"])
            .arg(dir.join("runs"))
            .env("NOMAD_AUTH_TOKEN", TEST_TOKEN)
            .env("NOMAD_OTEL_RUN_ID", "serving"),
        &run_dir,
        Some(&dir.join("serve.stderr")),
        Duration::from_secs(120),
    )
    .await;
    let url = format!("http://127.0.0.1:{port}/mcp");
    let call = json!([{"tool": "mlp", "arguments": {"input": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}}]);
    let answered =
        |reply: &Value| reply["is_error"] == false && reply["structured"]["shape"] == json!([4]);
    let first = mcp_client(&url, "auto", Some(TEST_TOKEN), &call).await;
    assert!(answered(&first[0]), "{}", first[0]);
    let (pid, _) = servers(&run_dir)["device-worker-0"];
    kill(pid.unwrap());
    let killed = Instant::now();
    loop {
        let reply = mcp_client(&url, "auto", Some(TEST_TOKEN), &call).await;
        if answered(&reply[0]) {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "no answer within 15 s of the worker's death: {}",
            reply[0]
        );
    }
    eprintln!(
        "answered again {:?} after the worker was killed",
        killed.elapsed()
    );
    assert!(serve.try_wait().unwrap().is_none(), "nomad serve stopped");
    assert_eq!(servers(&run_dir)["device-worker-0"].1, 1);
    let _ = serve.start_kill();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker that cannot start again is started at most `supervise.max_restarts` times, then the
/// fleet stops, naming it, why, and its last log lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_stops_the_fleet_naming_the_server() {
    let dir = Fleet::new_dir();
    let config = mlp_config(
        &dir,
        "supervise:\n  backoff_seconds: 0.1\n  max_restarts: 2\n  window_seconds: 60\n",
    );
    // The fleet's binaries as links, so the worker's can be swapped for one that cannot start.
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["nomad-scheduler", "nomad-device-worker", "nomad-gateway"] {
        std::os::unix::fs::symlink(binary(name), bin.join(name)).unwrap();
    }
    let run_dir = dir.join("runs/looping");
    let (up, _) = start_fleet(
        up_command(&config, &dir.join("runs"), "looping")
            .arg("--bin-dir")
            .arg(&bin),
        &run_dir,
        None,
        Duration::from_secs(120),
    )
    .await;
    let worker = bin.join("nomad-device-worker");
    std::fs::remove_file(&worker).unwrap();
    std::fs::write(
        &worker,
        "#!/bin/sh\necho 'the model cannot load: disk gone' >&2\nexit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(&worker, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (pid, _) = servers(&run_dir)["device-worker-0"];
    kill(pid.unwrap());
    let out = exited(up, Duration::from_secs(60), "a crash loop stops the fleet").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("device-worker-0 exited (exit status: 3) after 2 restarts within 60 s")
            && stderr.contains("a crash loop"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the model cannot load: disk gone"),
        "{stderr}"
    );
    assert_eq!(servers(&run_dir)["device-worker-0"].1, 2);
    let _ = std::fs::remove_dir_all(&dir);
}
