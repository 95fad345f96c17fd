//! `nomad up` as a user runs it: the supervisor starts the real fleet, `nomad run` drives
//! rollouts through it, `nomad traces` reads them back (from the run directory, and from a
//! Jaeger api_v3 query double over gRPC), and SIGTERM stops everything.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::{make_mlp, mlp_tasks, models_dir};
use nomad_integration_tests::jaeger::JaegerQuery;
use nomad_integration_tests::process::{clean, spawn_piped, start_fleet, up_command};
use nomad_integration_tests::process::{exited, send_signal};
use nomad_integration_tests::spans::{check_rollout_traces, from_console};
use nomad_integration_tests::unique_run_id;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver, read_jsonl, wait_until};
use nomad_integration_tests::{assert_says, strings_of};
use serde_json::Value;

fn write_tasks(path: &Path, tasks: &[Value]) {
    let text: String = tasks.iter().map(|t| format!("{t}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// Console records of `signal` in every `*.jsonl` file of `dir`.
fn records(dir: &Path, file: &str, signal: &str) -> Vec<Value> {
    read_jsonl(&dir.join(file))
        .into_iter()
        .filter(|r| r["signal"] == signal)
        .collect()
}

/// A small `mlp` model in `dir` and a TOML config serving it as the one tool.
fn mlp_config(dir: &Path) -> PathBuf {
    make_mlp(dir, "6,4", 0);
    let config = dir.join("nomad.toml");
    std::fs::write(
        &config,
        format!(
            "[[tools]]\nname = \"mlp\"\nkind = \"mlp\"\nsource = \"{}\"\n",
            dir.join("mlp").display()
        ),
    )
    .unwrap();
    config
}

/// The results file of the fleet whose `fleet.json` is at `fleet`.
fn run_results(fleet: &Path) -> PathBuf {
    fleet.parent().unwrap().join("results.jsonl")
}

fn alive(pid: u64) -> bool {
    // Reaped or never ours: gone. A zombie awaiting its reaper has no threads left to run.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// What `code` prints, run by the Python that has the client installed; it must succeed.
async fn python_ok(code: &str) -> String {
    let out = tokio::process::Command::new(nomad_integration_tests::peers::python_sdk())
        .arg("-c")
        .arg(code)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `nomad traces` output as JSON, with its exit status.
async fn nomad_traces(args: &[&str]) -> (bool, Value, String) {
    let out = clean("nomad")
        .arg("traces")
        .args(args)
        .arg("--json")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.success(), json, stderr)
}

fn trace_ids(rollouts: &Value) -> BTreeSet<String> {
    rollouts
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| r["trace_id"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn result_trace_ids(results: &[Value]) -> BTreeSet<String> {
    results
        .iter()
        .map(|r| r["trace_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomad_up_serves_fifty_rollouts_profiles_memory_and_stops_on_sigterm() {
    let dir = Fleet::new_dir();
    make_mlp(&dir, "6,16,4", 3);
    let config = dir.join("nomad.yaml");
    // `metrics_enabled: false` is overruled by the user's NOMAD_OTEL_METRICS_ENABLED=true:
    // children that see metrics on prove the user's variable beat the handed-down block.
    std::fs::write(
        &config,
        format!(
            "tools:\n  - {{name: mlp, kind: mlp, source: {}, batch_size: 8}}\n\
             tool_manager: {{heartbeat_interval_ms: 200}}\n\
             telemetry:\n  enabled: true\n  exporter: console\n  metrics_enabled: false\n\
             \x20 metric_export_interval_seconds: 0.5\n\
             \x20 memory_profiling: {{enabled: true, interval_seconds: 0.2}}\n",
            dir.join("mlp").display()
        ),
    )
    .unwrap();
    let run_id = unique_run_id("it-up");
    let runs = dir.join("runs");
    let run_dir = runs.join(&run_id);
    let up_err = dir.join("up.stderr");
    let (mut up, fleet) = start_fleet(
        up_command(&config, &runs, &run_id)
            .args(["--workers", "1", "--ready-timeout", "60"])
            .env("NOMAD_OTEL_METRICS_ENABLED", "true"),
        &run_dir,
        Some(&up_err),
        Duration::from_secs(90),
    )
    .await;
    let servers: Vec<(String, u64)> = fleet["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                s["pid"].as_u64().unwrap(),
            )
        })
        .collect();
    let names: BTreeSet<&str> = servers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["scheduler", "device-worker-0", "gateway"])
    );
    assert!(servers.iter().all(|(_, pid)| alive(*pid)));

    // The fleet has its own token, in a file only this user may read.
    let token = fleet["token"].as_str().expect("fleet.json holds the token");
    assert_eq!(token.len(), 64, "{token}");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(run_dir.join("fleet.json"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "fleet.json mode {mode:o}");
    // The run directory (its logs hold what callers sent) is this user's alone.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&run_dir).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o700, "run directory mode {mode:o}");
    // Code mode over MCP (the official client, with the token): without a workspace root,
    // `execute_mcp_script` is not offered, since every call of it would fail.
    let offered = nomad_integration_tests::peers::mcp_tool_names(
        fleet["gateway_mcp"].as_str().unwrap(),
        Some(token),
    )
    .await;
    assert_eq!(
        offered,
        BTreeSet::from(["search_code_tools".into(), "execute_mcp_code".into()])
    );
    let tasks = mlp_tasks(50);
    let tasks_path = dir.join("tasks.jsonl");
    write_tasks(&tasks_path, &tasks[..1]);
    let stranger = clean("nomad")
        .arg("run")
        .arg("--tasks")
        .arg(&tasks_path)
        .args([
            "--out",
            "-",
            "--gateway",
            fleet["gateway"].as_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    let refused = String::from_utf8_lossy(&stranger.stdout);
    assert!(
        !stranger.status.success(),
        "a run without the token got through"
    );
    assert!(refused.contains("requires its bearer token"), "{refused}");

    // The rollout driver, as a user runs it against the fleet (its gateway, token, run id and
    // telemetry from fleet.json, nothing set in its environment): its spans land in the run
    // directory beside the fleet's.
    let results_path = dir.join("results.jsonl");
    write_tasks(&tasks_path, &tasks);
    let driver = clean("nomad")
        .arg("run")
        .arg("--tasks")
        .arg(&tasks_path)
        .arg("--out")
        .arg(&results_path)
        .arg("--fleet")
        .arg(run_dir.join("fleet.json"))
        .args(["--concurrency", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let driver_pid = driver.id().unwrap();
    let driver = driver.wait_with_output().await.unwrap();
    assert!(
        driver.status.success(),
        "nomad run failed:\n{}",
        String::from_utf8_lossy(&driver.stderr)
    );
    let results = read_jsonl(&results_path);
    assert_eq!(results.len(), 50);
    assert!(results.iter().all(|r| r["status"] == "ok"), "{results:?}");
    assert_eq!(
        result_trace_ids(&results).len(),
        50,
        "50 distinct trace ids"
    );

    // Memory samples reach the head's metrics while the fleet runs.
    wait_until(
        "no nomad.servers.active export while running",
        Duration::from_secs(20),
        || {
            records(&run_dir, "head.jsonl", "metric")
                .iter()
                .any(|m| m["name"] == "nomad.servers.active" && m["value"] == 1)
        },
    )
    .await;

    // SIGTERM: the fleet stops in order, flushed, and nothing is left running.
    send_signal(up.id().unwrap(), libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(60), up.wait())
        .await
        .expect("nomad up stops within 60 s of SIGTERM")
        .unwrap();
    let up_log = std::fs::read_to_string(&up_err).unwrap_or_default();
    assert!(status.success(), "nomad up exited {status}:\n{up_log}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while servers.iter().any(|(_, pid)| alive(*pid)) {
        assert!(
            Instant::now() < deadline,
            "children outlived nomad up: {servers:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!up_log.contains(" exited ("), "a server failed:\n{up_log}");

    // Every rollout is one whole trace across the four services, from the run directory.
    let driver_file = format!("run-{driver_pid}.jsonl");
    let mut console = String::new();
    for file in [
        driver_file.as_str(),
        "scheduler.jsonl",
        "device-worker-0.jsonl",
        "gateway.jsonl",
    ] {
        console.push_str(&std::fs::read_to_string(run_dir.join(file)).unwrap());
    }
    check_rollout_traces(&from_console(&console), &results, &run_id);

    // The start-up is one trace: the head's phases, and each server's own start-up under the
    // head's span that spawned it.
    console.push_str(&std::fs::read_to_string(run_dir.join("head.jsonl")).unwrap());
    let spans = from_console(&console);
    let startup: Vec<_> = spans
        .iter()
        .filter(|s| {
            s.name.starts_with("nomad.startup") || s.name.starts_with("nomad.server.startup")
        })
        .collect();
    let roots: Vec<_> = startup
        .iter()
        .filter(|s| s.name == "nomad.startup")
        .collect();
    assert_eq!(roots.len(), 1, "{startup:#?}");
    let root = roots[0];
    assert_eq!(root.attr("nomad.run.id"), Some(run_id.as_str()));
    assert!(
        startup.iter().all(|s| s.trace_id == root.trace_id),
        "{startup:#?}"
    );
    for phase in ["config", "telemetry"] {
        assert!(
            startup
                .iter()
                .any(|s| s.name == format!("nomad.startup.{phase}"))
        );
    }
    for (server, service) in [
        ("scheduler", "nomad/scheduler"),
        ("device-worker-0", "nomad/device-worker"),
        ("gateway", "nomad/gateway"),
    ] {
        let named = |name: &str| {
            startup
                .iter()
                .find(|s| s.name == name && s.attr("nomad.server.name") == Some(server))
                .unwrap_or_else(|| panic!("no {name} for {server}: {startup:#?}"))
        };
        let spawn = named("nomad.startup.spawn");
        named("nomad.startup.ready");
        let own = startup
            .iter()
            .find(|s| s.name == "nomad.server.startup" && s.service_name == service)
            .unwrap_or_else(|| panic!("{server} traced no start-up"));
        assert_eq!(own.parent_span_id.as_deref(), Some(spawn.span_id.as_str()));
        assert!(
            startup
                .iter()
                .any(|s| s.name == "nomad.server.startup.listen"
                    && s.parent_span_id.as_deref() == Some(own.span_id.as_str())),
            "{server} traced no listen phase"
        );
    }

    // Env precedence: the children exported metrics although the block turned them off.
    for server in ["scheduler", "device-worker-0", "gateway"] {
        let metrics = records(&run_dir, &format!("{server}.jsonl"), "metric");
        assert!(!metrics.is_empty(), "{server} exported no metrics");
        assert!(
            metrics
                .iter()
                .all(|m| m["resource"]["nomad.run.id"] == run_id.as_str()),
            "{server} reports another run id"
        );
    }

    // Memory metrics per child: names, units, PSS within RSS.
    let head_metrics = records(&run_dir, "head.jsonl", "metric");
    let latest = |name: &str, server: &str, memory_type: Option<&str>| -> Value {
        head_metrics
            .iter()
            .rfind(|m| {
                m["name"] == name
                    && m["attributes"]["server"] == server
                    && memory_type.is_none_or(|t| m["attributes"]["memory.type"] == t)
            })
            .unwrap_or_else(|| panic!("no {name} for {server} ({memory_type:?})"))
            .clone()
    };
    for (server, _) in &servers {
        let rss = latest("nomad.server.memory.usage", server, Some("rss"));
        let pss = latest("nomad.server.memory.usage", server, Some("pss"));
        assert_eq!(rss["unit"], "By");
        assert_eq!(pss["unit"], "By");
        let (rss, pss) = (
            rss["value"].as_f64().unwrap(),
            pss["value"].as_f64().unwrap(),
        );
        assert!(rss > 1e6, "{server} RSS {rss}");
        assert!(
            (0.0..=rss).contains(&pss),
            "{server}: PSS {pss} outside 0..=RSS {rss}"
        );
        let peak = latest("nomad.server.memory.sampled_peak", server, Some("rss"));
        assert!(peak["value"].as_f64().unwrap() >= rss);
        let processes = latest("nomad.server.processes", server, None);
        assert_eq!(processes["unit"], "{process}");
        assert!(processes["value"].as_f64().unwrap() >= 1.0);
    }
    let host = |name: &str| {
        head_metrics
            .iter()
            .rfind(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .clone()
    };
    let total = host("nomad.host.memory.total");
    assert_eq!(total["unit"], "By");
    assert!(
        host("nomad.host.memory.usage")["value"].as_f64().unwrap()
            <= total["value"].as_f64().unwrap()
    );

    // `nomad traces` finds exactly the run's 50 rollouts in the run directory.
    let (ok, rollouts, stderr) =
        nomad_traces(&[&run_id, "--from", run_dir.to_str().unwrap()]).await;
    assert!(ok, "{stderr}");
    assert_eq!(trace_ids(&rollouts), result_trace_ids(&results));
    let first = &rollouts[0];
    let services: BTreeSet<&str> = strings_of(&first["spans"], "service").into_iter().collect();
    assert_eq!(services.len(), 4, "{services:?}");
    let (ok, _, stderr) = nomad_traces(&["no-such-run", "--from", run_dir.to_str().unwrap()]).await;
    assert!(!ok && stderr.contains("no rollouts"), "{stderr}");
    // From the directory that holds runs/: `latest` is this run, and an unknown run is refused
    // naming it.
    for (run, found) in [("latest", true), ("no-such-run", false)] {
        let out = clean("nomad")
            .args(["traces", run, "--json"])
            .current_dir(&dir)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), found, "{run}: {stderr}");
        if found {
            let rollouts: Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(trace_ids(&rollouts), result_trace_ids(&results));
        } else {
            assert!(
                stderr.contains("no run \"no-such-run\"") && stderr.contains(&run_id),
                "{stderr}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomad_traces_finds_the_runs_rollouts_through_jaegers_query_api() {
    let receiver = Arc::new(OtlpReceiver::grpc().await);
    let options = FleetOptions::default().exporting_to(&receiver);
    let mut fleet = Fleet::start(options).await;
    let run = fleet.run_head(&mlp_tasks(50), 8).await;
    assert!(run.success, "{}", run.stderr);
    // Another run's rollouts in the same backend must not show up.
    let other = fleet.run_head(&mlp_tasks(3), 3).await;
    assert!(other.success);
    fleet.terminate().await;
    let jaeger = JaegerQuery::start(receiver.clone()).await;
    let url = jaeger.addr.to_string();

    let (ok, rollouts, stderr) = nomad_traces(&[&run.run_id(), "--jaeger", &url]).await;
    assert!(ok, "{stderr}");
    assert_eq!(trace_ids(&rollouts), result_trace_ids(&run.results));
    assert!(
        rollouts
            .as_array()
            .unwrap()
            .iter()
            .all(|r| { r["spans"].as_array().unwrap().len() > 3 && r["status"] != "error" })
    );

    // The search depth reaches Jaeger.
    let (_, few, _) = nomad_traces(&[&run.run_id(), "--jaeger", &url, "--search-depth", "7"]).await;
    assert_eq!(few.as_array().unwrap().len(), 7);

    // A Jaeger that is not there is a clear error, not an empty answer.
    let dead: PathBuf = PathBuf::from("127.0.0.1:1");
    let (ok, _, stderr) = nomad_traces(&[&run.run_id(), "--jaeger", dead.to_str().unwrap()]).await;
    assert!(!ok && stderr.contains("Jaeger at 127.0.0.1:1"), "{stderr}");
}

/// README's first command: the default fleet on the real models runs the bundled tasks, prints
/// a summary and the traces, and stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomad_up_demo_runs_the_bundled_tasks_on_the_default_models() {
    let dir = Fleet::new_dir();
    let out = clean("nomad")
        .current_dir(&dir)
        .args(["up", "--demo"])
        .arg("--models-dir")
        .arg(models_dir())
        .env("NOMAD_OTEL_RUN_ID", "demo-run")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let run_dir = dir.join("runs/demo-run");
    let results = read_jsonl(&run_dir.join("results.jsonl"));
    assert_eq!(results.len(), 20);
    assert!(results.iter().all(|r| r["status"] == "ok"), "{results:?}");
    // Search and the embedding norm are deterministic: they pass. The chat answers are scored
    // by similarity, whatever the small model says.
    for r in &results {
        let id = r["task_id"].as_str().unwrap();
        if !id.starts_with("answer-") {
            assert_eq!(r["passed"], true, "{r}");
        }
        assert!(r["reward"].as_f64().is_some(), "{r}");
    }
    assert!(stdout.contains("20 rollouts: 20 ok, 0 failed"), "{stdout}");
    assert!(stdout.contains("20 rollouts, slowest first"), "{stdout}");
    assert!(
        stdout.contains("nomad.device.execute"),
        "a waterfall is printed: {stdout}"
    );
    // The bundled agent calls both tools from the sandbox.
    let tools: BTreeSet<String> =
        from_console(&std::fs::read_to_string(run_dir.join("scheduler.jsonl")).unwrap())
            .iter()
            .filter(|s| s.name == "nomad.tool.request")
            .filter_map(|s| s.attr("tool").map(str::to_owned))
            .collect();
    assert_eq!(tools, BTreeSet::from(["embed".into(), "generate".into()]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `supervise.restart: false`, a server that dies is reported with its exit status and log,
/// and takes the fleet down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_reported_and_the_fleet_stops_without_restarts() {
    let dir = Fleet::new_dir();
    let config = mlp_config(&dir);
    // Restarts off: a server's exit ends the fleet (healing.rs covers them on).
    let mut toml = std::fs::read_to_string(&config).unwrap();
    toml.push_str("\n[supervise]\nrestart = false\n");
    std::fs::write(&config, toml).unwrap();
    let runs = dir.join("runs");
    let (up, fleet) = start_fleet(
        up_command(&config, &runs, "dies").args(["--workers", "2"]),
        &runs.join("dies"),
        None,
        Duration::from_secs(60),
    )
    .await;
    let pid_of = |name: &str| {
        fleet["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap()["pid"]
            .as_u64()
            .unwrap()
    };
    let victim = pid_of("device-worker-1");
    send_signal(victim, libc::SIGKILL);
    let out = exited(
        up,
        Duration::from_secs(60),
        "nomad up stops after a server dies",
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("device-worker-1 exited (signal: 9"),
        "the death is reported with its status:\n{stderr}"
    );
    assert!(
        stderr.contains("device-worker-1.log:\n  | "),
        "with the tail of its log:\n{stderr}"
    );
    for name in ["scheduler", "device-worker-0", "gateway"] {
        assert!(!alive(pid_of(name)), "{name} outlived the fleet");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// README's five-minute tour: its Python snippet (the official MCP client, the token from
/// fleet.json) runs as written against a live default fleet and prints the embedding's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_tour_snippet_runs_against_a_live_default_fleet() {
    let dir = Fleet::new_dir();
    let (mut up, fleet) = nomad_integration_tests::fleet::nomad_up(&dir, "readme-tour").await;
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let snippet = readme
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README has a Python snippet");
    assert!(snippet.contains("runs/<run id>/fleet.json"), "{snippet}");
    let snippet = snippet.replace("runs/<run id>/fleet.json", fleet.to_str().unwrap());
    let stdout = python_ok(&snippet).await;
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["[384]", "[384]"]);

    // The default CPU worker serves both tools at once: an embedding asked for while a long
    // generation decodes is answered long before the generation ends (one tool at a time, it
    // waited for the whole generation).
    let both = format!(
        "import json, threading, time\n\
         from nomad_client import Fleet\n\
         fleet = Fleet.from_file({fleet:?})\n\
         took = {{}}\n\
         def generate():\n\
         \x20   t = time.monotonic()\n\
         \x20   fleet.call('generate', text='Count from 1 to 500, separated by commas.', max_tokens=480)\n\
         \x20   took['generate'] = time.monotonic() - t\n\
         worker = threading.Thread(target=generate)\n\
         worker.start()\n\
         time.sleep(1.0)\n\
         t = time.monotonic()\n\
         fleet.call('embed', text='hello')\n\
         took['embed'] = time.monotonic() - t\n\
         worker.join()\n\
         print(json.dumps(took))\n",
        fleet = fleet.to_str().unwrap()
    );
    let stdout = python_ok(&both).await;
    let took: Value = serde_json::from_str(stdout.trim()).unwrap();
    let (generate, embed) = (
        took["generate"].as_f64().unwrap(),
        took["embed"].as_f64().unwrap(),
    );
    // The embedding is asked for 1 s into the generation: had it waited, it would take the
    // rest of the generation.
    assert!(
        generate > 2.0,
        "the generation was too short to tell: {took}"
    );
    assert!(
        embed < (generate - 1.0) / 3.0,
        "the embedding waited for the generation: {took}"
    );

    // README's next block, each line as written, from the directory that holds runs/ (with a
    // tasks.jsonl of two code tasks; `nomad top` gets --once, as there is no terminal here).
    let block = readme
        .split("```sh\n")
        .find(|b| b.starts_with("nomad run --tasks"))
        .and_then(|b| b.split("```").next())
        .expect("README has the block that drives and looks at rollouts");
    let task = |id: &str| serde_json::json!({"id": id, "code": "from mcp_tools.nomad import embed\nRESULT = embed('hello')['shape']", "expected": [384]});
    write_tasks(&dir.join("tasks.jsonl"), &[task("a"), task("b")]);
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let command = line
            .split(" #")
            .next()
            .unwrap()
            .replace("runs/<run id>/fleet.json", fleet.to_str().unwrap());
        let mut words: Vec<String> = command.split_whitespace().map(String::from).collect();
        assert_eq!(words[0], "nomad", "{line}");
        if words[1] == "top" {
            words.push("--once".into());
        }
        let out = clean("nomad")
            .args(&words[1..])
            .current_dir(&dir)
            .output()
            .await
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{line}:\n{stdout}\n{stderr}");
        match words[1].as_str() {
            "run" => {
                // Progress says what it counts, and a rate only once there is one to show.
                assert!(stderr.contains("2/2 done, 0 failed"), "{line}:\n{stderr}");
                assert!(!stderr.contains("rate after"), "{line}:\n{stderr}");
                // The results go with the fleet's run, not into the current directory.
                assert!(!dir.join("results.jsonl").exists(), "{line}");
                let results: Vec<Value> = std::fs::read_to_string(run_results(&fleet))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| serde_json::from_str(l).ok())
                    .collect();
                assert!(
                    results.len() == 2 && results.iter().all(|r| r["passed"] == true),
                    "{line}:\n{stdout}\n{stderr}"
                );
            }
            "traces" => assert_eq!(
                stdout.lines().filter(|l| l.starts_with("rollout ")).count(),
                2,
                "{line}:\n{stdout}"
            ),
            "report" => {
                // Its summary counts the rollouts `nomad run` wrote.
                let page = std::fs::read_to_string(dir.join(stdout.trim()))
                    .unwrap_or_else(|e| panic!("{line}: {stdout}: {e}"));
                assert!(
                    page.contains("<th>rollouts</th><td>2 (2 ok, 0 failed)</td>"),
                    "{line}: {}",
                    &page[..page.len().min(4000)]
                );
                assert!(page.contains("2 of 2 passed"), "{line}");
            }
            _ => {}
        }
    }
    send_signal(up.id().unwrap(), libc::SIGTERM);
    assert!(up.wait().await.unwrap().success());
    // The client's MCP sessions left no protocol bookkeeping in the gateway's log (the MCP
    // library's INFO lines, one of them a dump of the client's request).
    let log = std::fs::read_to_string(fleet.parent().unwrap().join("gateway.log")).unwrap();
    for noise in [
        "Service initialized as server",
        "serve finished",
        "client initialized",
    ] {
        assert!(
            !log.contains(noise),
            "{noise:?} in the gateway's log:\n{log}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C during `nomad up --tasks`: one "interrupted" line, every task with its result line (the
/// ones cut short or never started as `cancelled`, saying why) summed up with their report, the
/// fleet stopped, and exit 130 as shells report SIGINT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_the_run_with_130_and_every_task_gets_its_line() {
    let dir = Fleet::new_dir();
    let config = mlp_config(&dir);
    // Three quick rollouts first, then ones that outlast the test.
    let mut tasks: Vec<Value> = (0..3)
        .map(|i| serde_json::json!({"id": format!("quick-{i}"), "code": "RESULT = 1", "expected": 1}))
        .collect();
    tasks.extend((0..8).map(|i| {
        serde_json::json!({"id": format!("slow-{i}"), "code": "import time\ntime.sleep(25)\nRESULT = 1"})
    }));
    let tasks_path = dir.join("tasks.jsonl");
    write_tasks(&tasks_path, &tasks);
    let runs = dir.join("runs");
    let up = spawn_piped(
        up_command(&config, &runs, "interrupted")
            .arg("--tasks")
            .arg(&tasks_path)
            .args(["--concurrency", "3", "--ready-timeout", "120"]),
    );
    let results = runs.join("interrupted/results.jsonl");
    wait_until(
        "the quick rollouts did not finish",
        Duration::from_secs(150),
        || read_jsonl(&results).len() >= 3,
    )
    .await;
    send_signal(up.id().unwrap(), libc::SIGINT);
    let out = exited(up, Duration::from_secs(60), "nomad up stops on Ctrl-C").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert_eq!(
        stderr.matches("stopping the fleet").count(),
        1,
        "said once:\n{stderr}"
    );
    assert!(
        stderr.contains("nomad up: interrupted; stopping the fleet"),
        "{stderr}"
    );
    assert!(
        stderr.contains("8 of 11 rollouts cancelled: the run was interrupted"),
        "{stderr}"
    );
    assert!(
        stdout.contains("11 rollouts: 3 ok, 0 failed, 8 cancelled; 3 of 3 verified passed"),
        "the rollouts are summed up:\n{stdout}"
    );
    // Every task has its one line: the three that finished, and the eight the stop cut short
    // (three running, five not started) as cancelled, saying why.
    let lines = read_jsonl(&results);
    let mut ids: Vec<&str> = lines
        .iter()
        .map(|l| l["task_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut expected: Vec<String> = tasks
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_owned())
        .collect();
    expected.sort();
    assert_eq!(ids, expected, "one result line per task");
    for line in &lines {
        let id = line["task_id"].as_str().unwrap();
        if id.starts_with("slow-") {
            assert_eq!(line["status"], "cancelled", "{line}");
            assert_says(line, "error", "the run was interrupted");
        } else {
            assert_eq!(line["status"], "ok", "{line}");
        }
    }
    assert!(stdout.contains("Report: "), "{stdout}");
    assert!(runs.join("interrupted/report.html").is_file());
    assert_eq!(
        std::fs::read_to_string(runs.join("interrupted/config.toml")).unwrap(),
        std::fs::read_to_string(&config).unwrap(),
        "the run directory keeps the config it ran on"
    );
    // The rollouts cut short say so in their traces; the finished ones are ok.
    let spans = from_console(
        &std::fs::read_to_string(runs.join("interrupted/head.jsonl")).unwrap_or_default(),
    );
    let rollouts: Vec<_> = spans.iter().filter(|s| s.name == "nomad.rollout").collect();
    assert_eq!(
        rollouts.len(),
        11,
        "every task's rollout has its root span: {rollouts:?}"
    );
    let status_of = |prefix: &str| -> BTreeSet<(String, String)> {
        rollouts
            .iter()
            .filter(|s| {
                s.attr("nomad.task.id")
                    .is_some_and(|id| id.starts_with(prefix))
            })
            .map(|s| {
                (
                    s.status.clone(),
                    s.attr("error.type").unwrap_or("").to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(
        status_of("quick-"),
        BTreeSet::from([("ok".to_owned(), String::new())])
    );
    assert_eq!(
        status_of("slow-"),
        BTreeSet::from([("error".to_owned(), "cancelled".to_owned())]),
        "the interrupted rollouts: {rollouts:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A newcomer's mistakes, each named before anything starts: `nomad run` with no gateway at its
/// address, and a typo inside a tool entry of `nomad up --config` (no run directory is left
/// behind for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomers_mistakes_are_named_before_anything_starts() {
    let dir = Fleet::new_dir();
    write_tasks(
        &dir.join("tasks.jsonl"),
        &[serde_json::json!({"id": "a", "code": "RESULT = 1"})],
    );
    let nobody = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let started = Instant::now();
    let out = clean("nomad")
        .args(["run", "--tasks", "tasks.jsonl", "--gateway", &nobody])
        .current_dir(&dir)
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains(&format!("no gateway at {nobody}")) && said.contains("--fleet"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{said}");
    assert!(!dir.join("results.jsonl").exists());

    let config = mlp_config(&dir);
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}batch_sise = 8\n")).unwrap();
    let runs = dir.join("runs");
    let up = || {
        let mut command = clean("nomad");
        command.arg("up").arg("--config").arg(&config);
        command.arg("--runs-dir").arg(&runs);
        async move { command.output().await }
    };
    let out = up().await.unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("batch_sise"), "{said}");
    assert!(
        !runs.exists() || std::fs::read_dir(&runs).unwrap().next().is_none(),
        "a run directory was left for a config that cannot start: {said}"
    );

    // A fleet none of whose tools can serve is not ready (strict or not), and a path of the
    // user's own that is not there is not sent to the default models' script.
    std::fs::write(
        &config,
        "[[tools]]\nname = \"mlp\"\nkind = \"mlp\"\nsource = \"/nowhere/my-mlp\"\n",
    )
    .unwrap();
    let out = up().await.unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("none of the 1 tools can serve"), "{said}");
    assert!(
        said.contains("/nowhere/my-mlp") && said.contains("check the path"),
        "{said}"
    );
    assert!(!said.contains("is ready"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}
