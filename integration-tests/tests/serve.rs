//! `nomad serve CONFIG` (the original Nomad's command): every tool of a config as an MCP tool of
//! its own, with `get_model_card`, over Streamable HTTP and stdio, called with the official MCP
//! Python client. Calls go through the scheduler's queues: concurrent calls on one session are
//! batched, a cancelled call leaves the queue, and answers equal calling the model directly.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::{TEST_TOKEN, make_mlp, rpc_channel};
use nomad_integration_tests::model_host::{
    assert_close, host_env, reference_toy, toy_entry, toy_weights,
};
use nomad_integration_tests::peers::{TasksClient, mcp_client, mcp_client_stdio};
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{binary, clean, start_fleet};
use nomad_integration_tests::{assert_says, read_jsonl};
use nomad_proto::v1::scheduler_client::SchedulerClient;
use serde_json::{Value, json};

/// A config of three kinds of tool: a built-in `mlp`, the original's TorchModuleTool, and a
/// plain callable beside the config file.
fn config(dir: &Path) -> PathBuf {
    let mlp = make_mlp(dir, "6,16,4", 7);
    std::fs::write(
        dir.join("helpers.py"),
        "def double(x: float) -> float:\n    \"\"\"Doubles x.\"\"\"\n    return 2 * x\n",
    )
    .unwrap();
    let weights = toy_weights(dir);
    let path = dir.join("nomad.yml");
    std::fs::write(
        &path,
        format!(
            "fmod_models:\n{}tools:\n  - {{name: mlp, kind: mlp, source: {}, batch_size: 8}}\n  \
             - helpers.double\ntool_manager:\n  heartbeat_interval_ms: 200\n\
             telemetry:\n  metric_export_interval_seconds: 0.5\n",
            toy_entry(&weights, ""),
            mlp.display()
        ),
    )
    .unwrap();
    path
}

/// `nomad serve CONFIG -t http` running in `dir`; its run directory once the fleet is ready.
async fn serve_http(dir: &Path, config: &Path, port: u16) -> (tokio::process::Child, PathBuf) {
    let run_dir = dir.join("runs/serve-http");
    let (child, _) = start_fleet(
        clean("nomad")
            .arg("serve")
            .arg(config)
            .args(["-t", "http", "--port", &port.to_string(), "--runs-dir"])
            .arg(dir.join("runs"))
            .envs(host_env())
            .env("NOMAD_AUTH_TOKEN", TEST_TOKEN)
            .env("NOMAD_OTEL_RUN_ID", "serve-http")
            .env("OTEL_BSP_SCHEDULE_DELAY", "100"),
        &run_dir,
        Some(&dir.join("serve.stderr")),
        Duration::from_secs(600),
    )
    .await;
    (child, run_dir)
}

fn toy_input(i: usize) -> Value {
    let x = i as f64;
    json!({"values": [0.01 * x, -0.5 + 0.03 * x, 0.25, 1.0 - 0.02 * x], "steps": 1 + i % 3})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tool_is_an_mcp_tool_of_its_own_over_http_batched_and_cancellable() {
    let dir = nomad_integration_tests::Fleet::new_dir();
    let config = config(&dir);
    let port = nomad_integration_tests::free_port();
    let (mut serve, run_dir) = serve_http(&dir, &config, port).await;
    let url = format!("http://127.0.0.1:{port}/mcp");
    let fleet: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("fleet.json")).unwrap())
            .unwrap();
    assert_eq!(fleet["gateway_mcp"], url);

    for mode in ["auto", "legacy"] {
        let listed = mcp_client(&url, mode, Some(TEST_TOKEN), &json!([{"list": true}])).await;
        let tools = listed[0]["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("{listed:?}"));
        let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
        for name in ["ToySurrogate", "mlp", "double", "get_model_card"] {
            assert!(names.contains(&name), "{mode}: {names:?}");
        }
        let toy = tools.iter().find(|t| t["name"] == "ToySurrogate").unwrap();
        assert_eq!(
            toy["input_schema"]["properties"]["values"]["maxItems"], 4,
            "{toy}"
        );
        assert!(
            toy["output_schema"]["properties"]["norm"].is_object(),
            "{toy}"
        );
        assert!(
            toy["description"]
                .as_str()
                .unwrap()
                .starts_with("A tiny surrogate")
        );
        // Clients are told which calls change nothing (so they may retry them): the built-in
        // kinds and the model card; a Python tool's code could do anything, so no claim.
        let pure = json!({"readOnlyHint": true, "idempotentHint": true, "openWorldHint": false});
        for name in ["mlp", "get_model_card"] {
            let tool = tools.iter().find(|t| t["name"] == name).unwrap();
            assert_eq!(tool["annotations"], pure, "{mode}: {tool}");
        }
        assert_eq!(toy["annotations"], Value::Null, "{mode}: {toy}");
        let double = tools.iter().find(|t| t["name"] == "double").unwrap();
        // A float output is wrapped as {"result": ...}, as an MCP output schema must be an object.
        assert_eq!(
            double["output_schema"]["properties"]["result"]["type"], "number",
            "{double}"
        );
    }

    // It speaks as itself, names the one MCP endpoint and where the token is (stderr is a file,
    // not a private terminal, so never the token itself).
    let said = std::fs::read_to_string(dir.join("serve.stderr")).unwrap();
    assert!(
        said.contains("nomad serve: run serve-http is ready"),
        "{said}"
    );
    assert!(!said.contains("nomad up:"), "{said}");
    assert!(said.contains(&format!("MCP (the tools) {url}")), "{said}");
    assert!(!said.contains("tools (MCP)"), "{said}");
    assert!(
        said.contains(&format!(
            "token           in {} as \"token\"",
            run_dir.join("fleet.json").display()
        )),
        "{said}"
    );
    assert!(!said.contains(TEST_TOKEN), "{said}");

    // A built-in kind, a Python model, a callable and the model card, each called by name.
    let calls = json!([
        {"tool": "mlp", "arguments": {"input": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}},
        {"tool": "ToySurrogate", "arguments": toy_input(3)},
        {"tool": "double", "arguments": {"x": 21.5}},
        {"tool": "get_model_card", "arguments": {"tool_name": "ToySurrogate"}},
        {"tool": "ToySurrogate", "arguments": {"values": [1.0]}},
        {"tool": "get_model_card", "arguments": {"tool_name": "nope"}},
    ]);
    let replies = mcp_client(&url, "auto", Some(TEST_TOKEN), &calls).await;
    assert_eq!(replies[0]["is_error"], false, "{}", replies[0]);
    assert_eq!(
        replies[0]["structured"]["shape"],
        json!([4]),
        "{}",
        replies[0]
    );
    assert_eq!(replies[1]["is_error"], false, "{}", replies[1]);
    assert_close(
        &replies[1]["structured"],
        &reference_toy(&dir.join("toy-weights"), &[toy_input(3)])[0],
        "ToySurrogate",
    );
    assert_eq!(
        replies[2]["structured"],
        json!({"result": 43.0}),
        "{}",
        replies[2]
    );
    assert!(
        replies[3]["text"]
            .as_str()
            .unwrap()
            .starts_with("# Toy surrogate"),
        "{}",
        replies[3]
    );
    assert_eq!(replies[4]["is_error"], true);
    assert_eq!(
        replies[4]["meta"]["nomad/error_code"], "INVALID_ARGUMENT",
        "a failed call's code is in its _meta: {}",
        replies[4]
    );
    let bad = replies[4]["text"].as_str().unwrap();
    assert!(
        bad.starts_with("invalid arguments") && bad.contains("values: List should have at least 4"),
        "{bad}"
    );
    assert_eq!(replies[5]["is_error"], true);
    assert_eq!(
        replies[5]["meta"]["nomad/error_code"], "NOT_FOUND",
        "{}",
        replies[5]
    );
    assert_says(&replies[5], "text", "no tool is named \"nope\"");

    // 64 calls at once on one session: every answer the reference's, and batched.
    let inputs: Vec<Value> = (0..64).map(toy_input).collect();
    let calls: Vec<Value> = inputs
        .iter()
        .map(|a| json!({"tool": "ToySurrogate", "arguments": a}))
        .collect();
    let mut scheduler = SchedulerClient::new(rpc_channel(fleet["scheduler"].as_str().unwrap()));
    let calls = json!({"concurrent": true, "calls": calls});
    let (replies, biggest_batches) = nomad_integration_tests::fleet::batched_while(
        &mut scheduler,
        "ToySurrogate",
        mcp_client(&url, "auto", Some(TEST_TOKEN), &calls),
    )
    .await;
    let expected = reference_toy(&dir.join("toy-weights"), &inputs);
    for (i, (reply, want)) in replies.iter().zip(&expected).enumerate() {
        assert_eq!(reply["is_error"], false, "call {i}: {reply}");
        assert_close(&reply["structured"], want, &format!("call {i}"));
    }
    assert!(
        biggest_batches > 1.0,
        "batches of at most {biggest_batches} on average while the calls ran"
    );

    // A call that gives up while it waits behind a slow one leaves the queue.
    let slow = json!({"values": [55.0, 0.0, 0.0, 0.0]});
    let calls = json!({"concurrent": true, "calls": [
        {"tool": "ToySurrogate", "arguments": slow},
        {"tool": "ToySurrogate", "arguments": toy_input(1), "delay": 0.1, "timeout": 0.2},
    ]});
    let replies = mcp_client(&url, "auto", Some(TEST_TOKEN), &calls).await;
    assert_eq!(replies[0]["is_error"], false, "{}", replies[0]);
    assert!(replies[1]["exception"].is_string(), "{}", replies[1]);
    let cancelled = || {
        read_jsonl(&run_dir.join("scheduler.jsonl"))
            .iter()
            .filter(|r| r["signal"] == "metric" && r["name"] == "nomad.tool.request_cancellations")
            .filter(|r| r["attributes"]["tool"] == "ToySurrogate")
            .filter_map(|r| r["value"].as_f64())
            .fold(0.0, f64::max)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while cancelled() < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(cancelled() >= 1.0, "no cancellation was counted");

    // The trace context in `params._meta` is the parent of the call's spans in every service.
    const TRACE_ID: &str = "5bf92f3577b34da6a3ce929d0e0e4736";
    let traced = json!([{"tool": "ToySurrogate", "arguments": toy_input(9),
        "meta": {"traceparent": format!("00-{TRACE_ID}-00f067aa0ba902b7-01")}}]);
    let replies = mcp_client(&url, "auto", Some(TEST_TOKEN), &traced).await;
    assert_eq!(replies[0]["is_error"], false, "{}", replies[0]);
    let in_trace = |file: &str, name: &str| {
        read_jsonl(&run_dir.join(file))
            .iter()
            .any(|r| r["signal"] == "span" && r["trace_id"] == TRACE_ID && r["name"] == name)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(in_trace("gateway.jsonl", "nomad.gateway.upstream_tool")
        && in_trace("scheduler.jsonl", "nomad.tool.request"))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(in_trace("gateway.jsonl", "nomad.gateway.upstream_tool"));
    assert!(in_trace("scheduler.jsonl", "nomad.tool.request"));

    // SIGTERM stops the whole fleet.
    send_signal(serve.id().unwrap(), libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(30), serve.wait())
        .await
        .expect("nomad serve stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_starts_nomad_serve_talks_to_it_over_stdio() {
    let dir = nomad_integration_tests::Fleet::new_dir();
    let config = config(&dir);
    // The SDK hands a stdio server a minimal environment; `env` gives it what it needs.
    let mut command = vec!["env".to_owned()];
    command.extend(host_env().into_iter().map(|(k, v)| format!("{k}={v}")));
    command.extend([
        binary("nomad").display().to_string(),
        "serve".into(),
        config.display().to_string(),
        "--runs-dir".into(),
        dir.join("runs").display().to_string(),
    ]);
    let replies = mcp_client_stdio(
        &command,
        &json!([
            {"list": true},
            {"tool": "ToySurrogate", "arguments": toy_input(5)},
            {"tool": "double", "arguments": {"x": 2.5}},
        ]),
    )
    .await;
    let names: Vec<&str> = replies[0]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("{replies:?}"))
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        names.contains(&"ToySurrogate") && names.contains(&"get_model_card"),
        "{names:?}"
    );
    assert_close(
        &replies[1]["structured"],
        &reference_toy(&dir.join("toy-weights"), &[toy_input(5)])[0],
        "over stdio",
    );
    assert_eq!(replies[2]["structured"], json!({"result": 5.0}));

    // A client of the tasks extension gets a task over stdio too, kept in the run's store.
    let mut tasks = TasksClient::stdio(&command);
    let task = tasks
        .ask(json!({"op": "start", "tool": "double", "arguments": {"x": 4.0}}))
        .await;
    assert_eq!(task["status"], "working", "{task}");
    let result = tasks
        .ask(json!({"op": "result", "task_id": task["task_id"]}))
        .await;
    assert_eq!(result["structured"], json!({"result": 8.0}), "{result}");
    let stores: Vec<_> = std::fs::read_dir(dir.join("runs"))
        .unwrap()
        .filter_map(|run| Some(run.ok()?.path().join("tasks.sqlite")))
        .filter(|store| store.is_file())
        .collect();
    assert!(!stores.is_empty(), "no run directory holds a task store");
    drop(tasks);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A port another program holds is refused before anything starts, once, naming the flag that
/// picks another; exit 2 like every other start-up error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_use_is_named_with_the_flag_to_change_it() {
    let dir = nomad_integration_tests::Fleet::new_dir();
    let config = dir.join("nomad.yml");
    std::fs::write(&config, "tools: []\n").unwrap();
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let out = clean("nomad")
        .arg("serve")
        .arg(&config)
        .args(["-t", "http", "--port", &port, "--runs-dir"])
        .arg(dir.join("runs"))
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let said = format!("port {port} on 127.0.0.1 is in use");
    assert_eq!(stderr.matches(&said).count(), 1, "{stderr}");
    assert!(stderr.contains("choose another with --port"), "{stderr}");
    assert!(!dir.join("runs").exists(), "nothing started: {stderr}");
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
}
