//! Python models as tools, end to end: the original Nomad's own `TorchModuleTool` base class
//! (`nomad-scifm` and torch from PyPI, on Python 3.12) served from `fmod_models` in its own
//! environment, a duck-typed numpy class from a git tag, plain callables under `tools:`, and an
//! environment that cannot install. Every answer is checked against calling the model directly
//! in its own environment, never against Nomad's own output.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_integration_tests::assert_status;
use nomad_integration_tests::fleet::TEST_TOKEN;
use nomad_integration_tests::model_host::{
    assert_close, described_tools, env_python, host_env, package, reference_toy, run_python,
    toy_entry, toy_weights,
};
use nomad_integration_tests::peers::mcp_client;
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver, Service};
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    CallToolRequest, GetModelCardRequest, ToolInfo, ToolInput, ToolState, tool_input, tool_output,
};
use serde_json::{Value, json};
use tonic::Code;

/// A cold environment with torch and its CUDA libraries takes minutes with pip.
const DESCRIBED_WITHIN: Duration = Duration::from_secs(1200);

fn numpy_requirements() -> Vec<String> {
    vec!["numpy".to_owned(), package("toy-numpy")]
}

/// Every process's environment: [`host_env`], and where the toy model marks its first death.
fn options(dir: &Path, tools_yaml: String) -> FleetOptions {
    FleetOptions {
        env: host_env(),
        ..FleetOptions::serving(tools_yaml)
    }
    .env(
        "TOY_SCIFM_ONCE",
        dir.join("died-once").display().to_string(),
    )
}

const MANAGER: &str = "tool_manager:\n  heartbeat_interval_ms: 200\n";

fn json_input(arguments: &Value) -> ToolInput {
    ToolInput {
        value: Some(tool_input::Value::Json(arguments.to_string())),
        options_json: String::new(),
    }
}

/// The fleet's scheduler and its tools once described, the first one ready to serve.
async fn first_ready(fleet: &Fleet) -> (SchedulerClient<nomad_rpc::Channel>, Vec<ToolInfo>) {
    let mut client = fleet.scheduler_client().await;
    let tools = described_tools(&mut client, DESCRIBED_WITHIN).await;
    assert_eq!(tools[0].state(), ToolState::Ready, "{}", tools[0].error);
    (client, tools)
}

/// Every call of `tool` on `arguments` at once, answered in their order.
async fn call_all(
    fleet: &Fleet,
    tool: &str,
    arguments: &[Value],
) -> Vec<Result<(Value, u32), tonic::Status>> {
    futures::future::join_all(arguments.iter().map(|a| call(fleet, tool, a.clone()))).await
}

/// A call that must succeed: its output.
async fn answer(fleet: &Fleet, tool: &str, arguments: Value) -> Value {
    call(fleet, tool, arguments).await.unwrap().0
}

async fn call(fleet: &Fleet, tool: &str, arguments: Value) -> Result<(Value, u32), tonic::Status> {
    let mut client = fleet.scheduler_client().await;
    let reply = client
        .call_tool(CallToolRequest {
            tool: tool.into(),
            input: Some(json_input(&arguments)),
        })
        .await?
        .into_inner();
    match reply.output.and_then(|o| o.value) {
        Some(tool_output::Value::Json(text)) => {
            Ok((serde_json::from_str(&text).unwrap(), reply.batch_size))
        }
        other => panic!("{tool}: not a JSON output: {other:?}"),
    }
}

fn toy_inputs(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let x = i as f64;
            json!({"values": [0.1 * x, 1.0 - 0.05 * x, -0.3 + 0.02 * x, 0.5], "steps": 1 + i % 4})
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_originals_torch_module_tool_answers_through_code_mode_as_calling_it_directly() {
    let dir = Fleet::new_dir();
    let weights = toy_weights(&dir);
    let yaml = format!(
        "fmod_models:\n{}sandbox:\n  max_concurrent: 16\n{MANAGER}",
        toy_entry(&weights, "")
    );
    let mut fleet = Fleet::start(options(&dir, yaml).in_dir(&dir)).await;
    let (mut client, tools) = first_ready(&fleet).await;
    let tool = &tools[0];
    assert_eq!(
        (tool.name.as_str(), tool.kind.as_str()),
        ("ToySurrogate", "python")
    );
    // Its description, schema and batch size are the class's own.
    assert!(tool.description.starts_with("A tiny surrogate"), "{tool:?}");
    assert_eq!(tool.batch_size, 8);
    let schema: Value = serde_json::from_str(&tool.input_schema_json).unwrap();
    assert_eq!(schema["properties"]["values"]["maxItems"], 4);
    assert!(tool.output_schema_json.contains("\"norm\""));

    // search_code_tools shows it with its own description and its schema as the signature.
    let url = fleet.gateway_mcp_url();
    let found = mcp_client(
        &url,
        "auto",
        None,
        &json!([{"tool": "search_code_tools", "arguments": {"query": "tiny surrogate tanh"}}]),
    )
    .await;
    let text = found[0]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("ToySurrogate(") && text.contains("values: list[float]"),
        "{text}"
    );
    assert!(text.contains("A tiny surrogate"), "{text}");

    // 32 calls at once through code mode, with the official MCP client.
    let inputs = toy_inputs(32);
    let calls: Vec<Value> = inputs
        .iter()
        .map(|a| {
            json!({"tool": "execute_mcp_code", "arguments": {"code": format!(
                "from mcp_tools.nomad import ToySurrogate\nRESULT = ToySurrogate(**{a})"
            )}})
        })
        .collect();
    let calls = json!({"concurrent": true, "calls": calls});
    let (replies, biggest_batches) = nomad_integration_tests::fleet::batched_while(
        &mut client,
        "ToySurrogate",
        mcp_client(&url, "auto", None, &calls),
    )
    .await;
    let expected = reference_toy(&weights, &inputs);
    assert_eq!(replies.len(), 32);
    for (i, (reply, want)) in replies.iter().zip(&expected).enumerate() {
        assert_eq!(reply["is_error"], false, "call {i}: {reply}");
        assert_close(&reply["structured"]["result"], want, &format!("call {i}"));
    }
    // The concurrent calls were batched.
    assert!(
        biggest_batches > 1.0,
        "batches of at most {biggest_batches} on average while the calls ran"
    );

    // The original's get_model_card, from sandboxed code.
    let card = mcp_client(
        &url,
        "auto",
        None,
        &json!([{"tool": "execute_mcp_code", "arguments": {"code":
            "from mcp_tools.nomad import get_model_card\nRESULT = get_model_card(tool_name='ToySurrogate')"}}]),
    )
    .await;
    assert_eq!(
        card[0]["structured"]["result"],
        "# Toy surrogate\n\nA fixed tanh layer over four features.\n",
        "{}",
        card[0]
    );
    fleet.terminate().await;
}

/// The pids of the model hosts a worker's log says it started.
fn host_pids(log: &str) -> Vec<u32> {
    log.lines()
        .filter(|l| l.contains("model host"))
        .filter_map(|l| l.split("pid=").nth(1))
        .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_models_faults_are_contained_and_named() {
    let dir = Fleet::new_dir();
    let weights = toy_weights(&dir);
    let receiver = OtlpReceiver::grpc().await;
    let yaml = format!("fmod_models:\n{}{MANAGER}", toy_entry(&weights, ""));
    let options = options(&dir, yaml)
        .in_dir(&dir)
        .exporting_to(&receiver)
        .env("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.2");
    let mut fleet = Fleet::start(options).await;
    let (mut client, _) = first_ready(&fleet).await;

    // Eight calls arrive while the model loads, so the first batch is 8, over the 4 this model
    // fits: out of memory, halved, and every call answered.
    let oom_inputs: Vec<Value> = (0..8)
        .map(|i| json!({"values": [77.0, i as f64, 0.0, 0.0]}))
        .collect();
    let answers = call_all(&fleet, "ToySurrogate", &oom_inputs).await;
    let expected = reference_toy(&weights, &oom_inputs);
    for (i, (answer, want)) in answers.into_iter().zip(&expected).enumerate() {
        let (output, batch) = answer.unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_close(&output, want, &format!("call {i}"));
        assert!(batch <= 4, "call {i} ran in a batch of {batch}");
    }
    let mut reductions = 0.0;
    for _ in 0..50 {
        reductions = receiver
            .latest_metrics()
            .iter()
            .filter(|m| m.name == "nomad.tool.batch.oom_reductions")
            .filter(|m| m.attributes.get("tool").map(String::as_str) == Some("ToySurrogate"))
            .map(|m| m.value)
            .sum();
        if reductions > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(reductions >= 1.0, "no out-of-memory reduction was counted");

    // An input that raises fails alone, with the model's message; its batch-mates are answered.
    let mixed = [
        json!({"values": [-99.0, 0.0, 0.0, 0.0]}),
        json!({"values": [1.0, 2.0, 3.0, 4.0]}),
        json!({"values": [0.5, 0.5, 0.5, 0.5], "steps": 3}),
    ];
    let answers = call_all(&fleet, "ToySurrogate", &mixed).await;
    let failed = answers[0].as_ref().unwrap_err();
    assert_status(
        failed,
        Code::Internal,
        "ValueError: the value -99 is out of this model's domain",
    );
    let expected = reference_toy(&weights, &mixed[1..]);
    for (answer, want) in answers[1..].iter().zip(&expected) {
        assert_close(&answer.as_ref().unwrap().0, want, "a batch-mate");
    }

    // Arguments the model's schema refuses are named; a text input is not arguments at all.
    let bad = call(&fleet, "ToySurrogate", json!({"values": [1.0]}))
        .await
        .unwrap_err();
    assert_status(
        &bad,
        Code::InvalidArgument,
        "values: List should have at least 4 items",
    );
    let text = client
        .call_tool(text_call("ToySurrogate", "hello", ""))
        .await
        .unwrap_err();
    assert_eq!(text.code(), Code::InvalidArgument);
    assert!(
        text.message().contains(
            "\"ToySurrogate\": a Python model takes a JSON object of arguments (`json`), as its \
             input schema describes, got text"
        ),
        "{text:?}"
    );

    // A host that dies under a batch is started again and the batch answered.
    let once = json!({"values": [-66.0, 1.0, 1.0, 1.0]});
    let (output, _) = call(&fleet, "ToySurrogate", once.clone())
        .await
        .expect("answered by the host started again");
    assert_close(
        &output,
        &reference_toy(&weights, &[once])[0],
        "after a death",
    );
    assert!(dir.join("died-once").exists(), "the first host did not die");
    // One that dies every time fails its call, naming how the host ended, twice.
    let dies = call(
        &fleet,
        "ToySurrogate",
        json!({"values": [-77.0, 0.0, 0.0, 0.0]}),
    )
    .await
    .unwrap_err();
    assert_status(
        &dies,
        Code::Internal,
        "the model host exited (exit code 3) under this batch, and again (exit code 3)",
    );
    // And the tool serves on, from a fresh host.
    let after = json!({"values": [0.25, 0.5, 0.75, 1.0], "steps": 2});
    let (output, _) = call(&fleet, "ToySurrogate", after.clone()).await.unwrap();
    assert_close(
        &output,
        &reference_toy(&weights, &[after])[0],
        "after repeated deaths",
    );

    // What the model printed went to the worker's log, not into the protocol.
    let log = fleet.stderr(Service::DeviceWorker);
    assert!(log.contains("toy_scifm: a batch of"), "{log}");
    let card = client
        .get_model_card(GetModelCardRequest {
            tool: "ToySurrogate".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(card.text.starts_with("# Toy surrogate"), "{card:?}");

    // Stopping the worker stops its hosts (each sees its socket close).
    let pids = host_pids(&log);
    assert!(pids.len() >= 3, "hosts started: {pids:?}\n{log}");
    fleet.terminate().await;
    let running = |pid: &u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pids.iter().any(running) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left: Vec<&u32> = pids.iter().filter(|p| running(p)).collect();
    assert!(
        left.is_empty(),
        "model hosts {left:?} outlived their worker"
    );
}

/// Spans the model makes with OpenTelemetry land in the caller's trace: the model's environment
/// has the SDK and an OTLP/HTTP exporter, the fleet exports to a receiver over OTLP/HTTP, and a
/// call carrying a `traceparent` finds the model's `toy_scifm.forward` span in that trace, under
/// the worker's `nomad.device.execute`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_a_python_model_makes_join_the_callers_trace() {
    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let dir = Fleet::new_dir();
    let weights = toy_weights(&dir);
    let mut requirements = nomad_integration_tests::model_host::scifm_requirements();
    requirements.extend([
        "opentelemetry-sdk".to_owned(),
        "opentelemetry-exporter-otlp-proto-http".to_owned(),
    ]);
    let yaml = format!(
        "fmod_models:\n  - model_class: toy_scifm.ToySurrogate\n    name_or_path: {}\n    env: {}\n{MANAGER}",
        weights.display(),
        json!(requirements)
    );
    let receiver = OtlpReceiver::http().await;
    let options = options(&dir, yaml)
        .in_dir(&dir)
        .env("NOMAD_OTEL_ENABLED", "true")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.clone())
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let mut fleet = Fleet::start(options).await;
    let (mut client, _) = first_ready(&fleet).await;
    let mut request = tonic::Request::new(CallToolRequest {
        tool: "ToySurrogate".into(),
        input: Some(json_input(&json!({"values": [0.1, 0.2, 0.3, 0.4]}))),
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-00f067aa0ba902b7-01")
            .parse()
            .unwrap(),
    );
    client.call_tool(request).await.unwrap();
    // The model's span and its parent come from two processes, each exporting on its own
    // schedule: wait for both.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (forward, parent) = loop {
        let spans = receiver.spans();
        let forward = spans.iter().find(|s| s.name == "toy_scifm.forward");
        let parent = forward.and_then(|f| {
            spans
                .iter()
                .find(|s| Some(&s.span_id) == f.parent_span_id.as_ref())
        });
        if let (Some(f), Some(p)) = (forward, parent) {
            break (f.clone(), p.clone());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the model's span ({}) or its parent did not arrive: {:?}",
            forward.is_some(),
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(forward.trace_id, TRACE_ID);
    assert_eq!(forward.attr("toy_scifm.batch"), Some("1"));
    assert!(
        forward.service_name.ends_with("/host/ToySurrogate"),
        "{}",
        forward.service_name
    );
    assert_eq!(parent.name, "nomad.device.execute");
    assert_eq!(parent.trace_id, TRACE_ID);
    fleet.terminate().await;
}

/// On a GPU: inputs that each take 40 GiB of device memory, eight at once, make a real
/// `torch.OutOfMemoryError` (an H200 has 141 GB); the scheduler halves the batch until it fits,
/// and every call is answered. `scripts/gpu-check.sh` runs it with `NOMAD_TEST_DEVICE=cuda:0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh --device cuda:0 runs it"]
async fn a_real_cuda_out_of_memory_in_a_python_model_halves_the_batch() {
    let device = std::env::var("NOMAD_TEST_DEVICE").unwrap_or_default();
    assert!(
        device.starts_with("cuda:"),
        "set NOMAD_TEST_DEVICE=cuda:N (got {device:?}): a CPU has no device memory to run out of"
    );
    let dir = Fleet::new_dir();
    let weights = toy_weights(&dir);
    let yaml = format!("fmod_models:\n{}{MANAGER}", toy_entry(&weights, ""));
    let mut fleet = Fleet::start(options(&dir, yaml).in_dir(&dir)).await;
    first_ready(&fleet).await;
    let inputs: Vec<Value> = (0..8)
        .map(|i| json!({"values": [88.0, i as f64, 0.0, 1.0]}))
        .collect();
    let answers = call_all(&fleet, "ToySurrogate", &inputs).await;
    let expected = reference_toy(&weights, &inputs);
    let mut sizes = Vec::new();
    for (i, (answer, want)) in answers.into_iter().zip(&expected).enumerate() {
        let (output, batch) = answer.unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_close(&output, want, &format!("call {i}"));
        sizes.push(batch);
    }
    // The first batch held all eight (they arrived while the model loaded): only halving after
    // real out-of-memory errors brings it under 160 GiB.
    assert!(sizes.iter().all(|b| *b <= 3), "batch sizes {sizes:?}");
    eprintln!("batch sizes on {device}: {sizes:?}");
    fleet.terminate().await;
}

/// A git repository holding the numpy model's window under `weights/`, tagged `v1`, with a
/// different window committed after the tag.
fn window_repository(dir: &Path, window: &[f64]) -> PathBuf {
    let repo = dir.join("spectrum-repo");
    std::fs::create_dir_all(repo.join("weights")).unwrap();
    let git = |args: &[&str]| {
        let status = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.org"])
            .args(args)
            .current_dir(&repo)
            .output()
            .unwrap();
        assert!(status.status.success(), "git {args:?}: {status:?}");
    };
    let write = |w: &[f64]| {
        let text: Vec<String> = w.iter().map(|v| v.to_string()).collect();
        std::fs::write(repo.join("weights/window.txt"), text.join("\n")).unwrap();
    };
    git(&["init", "--quiet"]);
    write(window);
    git(&["add", "."]);
    git(&["commit", "--quiet", "-m", "window v1"]);
    git(&["tag", "v1"]);
    write(&[1.0; 8]);
    git(&["commit", "--quiet", "-am", "a flat window after v1"]);
    repo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_numpy_model_from_a_git_tag_and_plain_callables_serve_beside_a_broken_environment() {
    let dir = Fleet::new_dir();
    let window = [0.0, 0.2, 0.6, 1.0, 1.0, 0.6, 0.2, 0.0];
    let repo = window_repository(&dir, &window);
    let weights = toy_weights(&dir);
    // A module beside the config file, imported without any environment of its own.
    let fleet_dir = |name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("my_tools.py"),
            "def greet(name: str, punctuation: str = '!') -> str:\n    \
             \"\"\"Greets someone.\"\"\"\n    return f'Hello, {name}{punctuation}'\n\n\
             def holding(needle: str) -> list:\n    \
             \"\"\"Names of the variables whose value holds needle.\"\"\"\n    \
             import os\n    return sorted(k for k, v in os.environ.items() if needle in v)\n",
        )
        .unwrap();
        d
    };
    let numpy = json!(numpy_requirements());
    let yaml = format!(
        "fmod_models:\n\
         \x20 - model_class: toy_numpy.Spectrum\n\
         \x20   name_or_path: git+file://{repo}@v1#weights\n\
         \x20   tool_name: spectrum\n\
         \x20   env: {numpy}\n\
         \x20 - model_class: toy_scifm.ToySurrogate\n\
         \x20   name_or_path: {weights}\n\
         \x20   tool_name: broken\n\
         \x20   env: [\"nomad-test-no-such-package==0.0.1\"]\n\
         tools:\n\
         \x20 - tool: toy_numpy.dot\n\
         \x20   name: dot\n\
         \x20   env: {numpy}\n\
         \x20 - my_tools.greet\n\
         \x20 - my_tools.holding\n{MANAGER}",
        repo = repo.display(),
        weights = weights.display(),
    );
    // The config file lives in the fleet's directory, beside my_tools.py. The fleet has a
    // token, which the worker's environment carries in two variables besides its own (as a
    // Slurm job's collector headers do): none reaches the model's.
    let with_token = |options: FleetOptions| FleetOptions {
        auth: true,
        ..options
            .env(
                "NOMAD_OTEL_OTLP_HEADERS",
                format!("authorization=Bearer%20{TEST_TOKEN}"),
            )
            .env("MY_TOOL_SETTING", format!("key={TEST_TOKEN}"))
            .env("MY_TOOL_MARKER", "marker-4711")
    };
    let mut fleet =
        Fleet::start(with_token(options(&dir, yaml.clone())).in_dir(&fleet_dir("first"))).await;
    let mut client = fleet.scheduler_client().await;
    let tools = described_tools(&mut client, DESCRIBED_WITHIN).await;
    let state = |name: &str| {
        let t = tools.iter().find(|t| t.name == name).unwrap();
        (t.state(), t.error.clone())
    };
    for name in ["spectrum", "dot", "greet"] {
        assert_eq!(state(name).0, ToolState::Ready, "{name}: {}", state(name).1);
    }
    let (broken, why) = state("broken");
    assert_eq!(broken, ToolState::Failed);
    assert!(
        why.contains("installing the environment (nomad-test-no-such-package==0.0.1)")
            && why.contains("full log:"),
        "{why}"
    );
    let refused = call(&fleet, "broken", json!({"values": [1, 2, 3, 4]}))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::FailedPrecondition,
        "nomad-test-no-such-package",
    );
    // Through the gateway, the tool that cannot serve is named as such, never as unknown: as a
    // direct MCP tool (a failed call with its code) and as an import in sandboxed code.
    let tools_url = fleet.gateway_mcp_url().replace("/mcp", "/tools");
    let replies = mcp_client(
        &tools_url,
        "auto",
        Some(TEST_TOKEN),
        &json!([
            {"tool": "broken", "arguments": {"values": [1, 2, 3, 4]}},
            {"tool": "execute_mcp_code", "arguments": {"code": "x = 1"}},
        ]),
    )
    .await;
    assert_eq!(replies[0]["is_error"], true, "{}", replies[0]);
    assert_eq!(
        replies[0]["meta"]["nomad/error_code"], "FAILED_PRECONDITION",
        "{}",
        replies[0]
    );
    assert!(
        replies[0]["text"].as_str().is_some_and(
            |t| t.contains("broken cannot serve") && t.contains("nomad-test-no-such-package")
        ),
        "{}",
        replies[0]
    );
    // A name /tools does not have is MCP's invalid params, its code NOT_FOUND in the error's data.
    assert!(
        replies[1]["exception"]
            .as_str()
            .is_some_and(|e| e.contains("has no tool") && e.contains("execute_mcp_code")),
        "{}",
        replies[1]
    );
    let imported = mcp_client(
        &fleet.gateway_mcp_url(),
        "auto",
        Some(TEST_TOKEN),
        &json!([{"tool": "execute_mcp_code", "arguments": {"code":
            "from mcp_tools import ToolError\n\
             try:\n    from mcp_tools.nomad import broken\n\
             except ToolError as e:\n    RESULT = [e.code, str(e)]"}}]),
    )
    .await;
    let result = &imported[0]["structured"]["result"];
    assert_eq!(result[0], "FAILED_PRECONDITION", "{}", imported[0]);
    assert!(
        result[1]
            .as_str()
            .is_some_and(|m| m.contains("nomad-test-no-such-package")),
        "{}",
        imported[0]
    );

    // The numpy model at the tag (not the window committed after it), against numpy itself.
    let signals: Vec<Value> = (0..6)
        .map(|i| json!({"signal": (0..8).map(|k| ((i * 3 + k) % 5) as f64 - 2.0).collect::<Vec<_>>()}))
        .collect();
    let answers = call_all(&fleet, "spectrum", &signals).await;
    const SPECTRUM: &str = "import json, sys\nimport numpy as np\n\
        window = np.array(json.loads(sys.argv[1]))\n\
        signals = json.loads(sys.stdin.read())\n\
        print(json.dumps([{'power': (np.abs(np.fft.rfft(np.array(s['signal']) * window)) ** 2).tolist()} for s in signals]))\n";
    let window_arg = PathBuf::from(json!(window).to_string());
    let expected = run_python(
        &env_python(&numpy_requirements()),
        SPECTRUM,
        &[&window_arg],
        &signals,
    );
    for (i, (answer, want)) in answers.into_iter().zip(&expected).enumerate() {
        let (output, _) = answer.unwrap_or_else(|e| panic!("signal {i}: {e}"));
        assert_close(&output, want, &format!("signal {i}"));
    }
    let short = call(&fleet, "spectrum", json!({"signal": [1.0, 2.0]}))
        .await
        .unwrap_err();
    // Its JSON Schema's bounds are checked by the host before the model sees the item (this
    // environment has no pydantic): the schema's own words, not the model's.
    assert_status(
        &short,
        Code::InvalidArgument,
        "signal: at least 8 items, got 2",
    );
    let extra = call(
        &fleet,
        "spectrum",
        json!({"signal": vec![0.0; 8], "gain": 2}),
    )
    .await
    .unwrap_err();
    assert_status(
        &extra,
        Code::InvalidArgument,
        "gain: Extra inputs are not permitted",
    );

    // Plain callables: one from the model's environment, one beside the config file.
    assert_eq!(
        answer(&fleet, "dot", json!({"a": [1, 2, 3], "b": [4, 5, 6]})).await,
        json!(32.0)
    );
    let lengths = call(&fleet, "dot", json!({"a": [1], "b": [1, 2]}))
        .await
        .unwrap_err();
    assert!(
        lengths
            .message()
            .contains("ValueError: lengths differ: 1 and 2"),
        "{lengths:?}"
    );
    assert_eq!(
        answer(&fleet, "greet", json!({"name": "Ada"})).await,
        json!("Hello, Ada!")
    );
    assert_eq!(
        answer(&fleet, "holding", json!({"needle": TEST_TOKEN})).await,
        json!([]),
        "the fleet's token reached the model's environment"
    );
    assert_eq!(
        answer(&fleet, "holding", json!({"needle": "marker-4711"})).await,
        json!(["MY_TOOL_MARKER"]),
        "the worker's other variables reach the model"
    );
    let missing = call(&fleet, "greet", json!({})).await.unwrap_err();
    assert_status(&missing, Code::InvalidArgument, "name");
    // A callable has no model directory, so no model card.
    let card = client
        .get_model_card(GetModelCardRequest { tool: "dot".into() })
        .await
        .unwrap_err();
    assert!(card.message().contains("has no model card"), "{card:?}");
    fleet.terminate().await;

    // A second start reuses the environment the first built.
    let mut again = Fleet::start(options(&dir, yaml).in_dir(&fleet_dir("second"))).await;
    let mut client = again.scheduler_client().await;
    let tools = described_tools(&mut client, DESCRIBED_WITHIN).await;
    assert!(
        tools
            .iter()
            .any(|t| t.name == "spectrum" && t.state() == ToolState::Ready)
    );
    let log = again.stderr(Service::DeviceWorker);
    assert!(log.contains("model environment reused"), "{log}");
    assert!(
        !log.lines()
            .any(|l| l.contains("building the model environment") && l.contains("numpy")),
        "{log}"
    );
    again.terminate().await;
    drop((fleet, again));
    let _ = std::fs::remove_dir_all(&dir);
}
