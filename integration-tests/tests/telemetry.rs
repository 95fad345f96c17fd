//! End-to-end: real binaries over loopback gRPC, real OTLP export, a real candle model.

use std::collections::BTreeSet;
use std::time::Duration;

use nomad_integration_tests::fleet::mlp_tasks;
use nomad_integration_tests::process::binary;
use nomad_integration_tests::reference::mlp_forward;
use nomad_integration_tests::spans::{check_batch_links, check_rollout_traces, from_console};
use nomad_integration_tests::{Fleet, FleetOptions, HeadRun, OtlpReceiver, Service, SpanRecord};
use serde::Deserialize as _;
use serde_json::Value;

/// Runs `count` MLP rollouts through `fleet` at once, checks every output against the model,
/// and stops the fleet: the run.
async fn run_checked_then_stop(fleet: &mut Fleet, count: usize) -> HeadRun {
    let tasks = mlp_tasks(count);
    let run = fleet.run_head(&tasks, count).await;
    assert_outputs_match_the_model(fleet, &tasks, &run);
    fleet.terminate().await;
    run
}

/// Every rollout succeeded and returned what an independent forward pass of the model gives.
fn assert_outputs_match_the_model(fleet: &Fleet, tasks: &[Value], run: &HeadRun) {
    assert!(run.success, "nomad run failed: {}", run.stderr);
    assert_eq!(run.results.len(), tasks.len());
    for result in &run.results {
        assert_eq!(result["status"], "ok", "{result}");
        let task = tasks
            .iter()
            .find(|t| t["id"] == result["task_id"])
            .expect("result for a known task");
        let input = Vec::<f32>::deserialize(&task["arguments"]["input"]).unwrap();
        let want = mlp_forward(&fleet.model_dir, &input);
        let got = Vec::<f32>::deserialize(&result["output"]["output"]).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-5,
                "task {}: {got:?} vs {want:?}",
                task["id"]
            );
        }
    }
}

fn otlp(receiver: &OtlpReceiver) -> FleetOptions {
    FleetOptions::default()
        .exporting_to(receiver)
        // Nothing is exported on a timer: only the flush on exit (head) and on SIGTERM
        // (services) can deliver, so arriving spans prove the shutdown flush.
        .env("OTEL_BSP_SCHEDULE_DELAY", "600000")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "600000")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_rollouts_are_twenty_whole_traces_after_sigterm() {
    let receiver = OtlpReceiver::grpc().await;
    let mut fleet = Fleet::start(otlp(&receiver)).await;
    let run = run_checked_then_stop(&mut fleet, 20).await;

    let spans = receiver.spans();
    check_rollout_traces(&spans, &run.results, &run.run_id());
    check_batch_links(&spans);
    let jobs: Vec<&SpanRecord> = spans.iter().filter(|s| s.name == "nomad.job").collect();
    assert_eq!(jobs.len(), 1, "one nomad.job span per run");
    assert_eq!(jobs[0].attr("nomad.run.id"), Some(run.run_id().as_str()));

    let metrics: BTreeSet<(String, String)> = receiver
        .metrics()
        .into_iter()
        .map(|m| (m.service_name, m.name))
        .collect();
    for service in [
        "nomad/head",
        "nomad/gateway",
        "nomad/scheduler",
        "nomad/device-worker",
    ] {
        for name in [
            "process.cpu.time",
            "process.memory.usage",
            "process.thread.count",
            "process.unix.file_descriptor.count",
            "nomad.server.requests.in_flight",
            "nomad.runtime.busy_ratio",
            "nomad.runtime.global_queue.depth",
        ] {
            assert!(
                metrics.contains(&(service.to_owned(), name.to_owned())),
                "{service} exported no {name}"
            );
        }
    }
    for expected in [
        ("nomad/scheduler", "nomad.tool.requests"),
        ("nomad/scheduler", "nomad.tool.batch.duration"),
        ("nomad/gateway", "nomad.gateway.requests"),
        ("nomad/gateway", "nomad.gateway.upstream_tool.calls"),
    ] {
        assert!(
            metrics.contains(&(expected.0.to_owned(), expected.1.to_owned())),
            "metric {expected:?} not received; got {metrics:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_exporter_lines_give_the_same_picture() {
    let options = FleetOptions::default()
        .env("NOMAD_OTEL_EXPORTER", "console")
        .env("NOMAD_OTEL_LOGS_ENABLED", "true");
    let mut fleet = Fleet::start(options).await;
    let run = run_checked_then_stop(&mut fleet, 20).await;

    let mut spans = from_console(&run.stdout);
    for service in [Service::Gateway, Service::Scheduler, Service::DeviceWorker] {
        let stdout = fleet.stdout(service);
        let before = spans.len();
        spans.extend(from_console(&stdout));
        assert!(
            spans.len() > before,
            "{} printed no span lines",
            service.name()
        );
        // Metric points are JSON lines too (the worker's figures travel in its heartbeats).
        if service != Service::DeviceWorker {
            assert!(
                stdout.lines().any(|l| l.contains(r#""signal":"metric""#)),
                "{} printed no metric lines",
                service.name()
            );
        }
    }
    check_rollout_traces(&spans, &run.results, &run.run_id());

    // With logs on, log records are JSON lines too, with the service's resource.
    let logs: Vec<Value> = fleet
        .stdout(Service::Scheduler)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["signal"] == "log")
        .collect();
    assert!(
        logs.iter().any(|l| l["body"] == "worker registered"
            && l["resource"]["service.name"] == "nomad/scheduler"),
        "no 'worker registered' log record in {logs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_http_protobuf_delivers_the_same_traces() {
    let receiver = OtlpReceiver::http().await;
    let options = FleetOptions::default()
        .env("NOMAD_OTEL_ENABLED", "true")
        .env("NOMAD_OTEL_OTLP_PROTOCOL", "http/protobuf")
        .env("NOMAD_OTEL_OTLP_ENDPOINT", receiver.endpoint.clone());
    let mut fleet = Fleet::start(options).await;
    let run = run_checked_then_stop(&mut fleet, 4).await;
    check_rollout_traces(&receiver.spans(), &run.results, &run.run_id());
    assert!(
        receiver
            .metrics()
            .iter()
            .any(|m| m.name == "nomad.tool.requests"),
        "no metrics over OTLP/HTTP"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_off_gives_identical_results_and_never_connects() {
    let tasks = mlp_tasks(8);

    let on_receiver = OtlpReceiver::grpc().await;
    let mut on = Fleet::start(otlp(&on_receiver)).await;
    let with_telemetry = on.run_head(&tasks, 4).await;
    assert_outputs_match_the_model(&on, &tasks, &with_telemetry);
    on.terminate().await;
    assert!(
        on_receiver.connections() > 0,
        "the enabled fleet never exported"
    );

    // An endpoint variable alone would turn export on; enabled=false must win and stay silent.
    let off_receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions::default()
        .env("NOMAD_OTEL_ENABLED", "false")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", off_receiver.endpoint.clone());
    let mut off = Fleet::start(options).await;
    let without = off.run_head(&tasks, 4).await;
    assert_outputs_match_the_model(&off, &tasks, &without);
    off.terminate().await;

    assert_eq!(with_telemetry.outputs(), without.outputs());
    assert!(without.results.iter().all(|r| r["trace_id"] == ""));
    assert_eq!(
        off_receiver.connections(),
        0,
        "telemetry off still connected to OTLP"
    );
    for service in [Service::Gateway, Service::Scheduler, Service::DeviceWorker] {
        assert!(
            off.stdout(service).is_empty(),
            "{} wrote to stdout",
            service.name()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_sdk_disabled_beats_nomad_otel_enabled() {
    let receiver = OtlpReceiver::grpc().await;
    let options = otlp(&receiver).env("OTEL_SDK_DISABLED", "true");
    let mut fleet = Fleet::start(options).await;
    run_checked_then_stop(&mut fleet, 3).await;
    assert_eq!(receiver.connections(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_beats_the_config_file() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions {
        config_yaml: "telemetry:\n  enabled: true\n  exporter: console\n  service_name: from-file\n  span_groups: none\n".into(),
        ..Default::default()
    }
    .env("NOMAD_OTEL_EXPORTER", "otlp")
    .env("NOMAD_OTEL_OTLP_ENDPOINT", receiver.endpoint.clone())
    .env("NOMAD_OTEL_SERVICE_NAME", "from-env")
    .env("NOMAD_OTEL_SPAN_GROUPS", "default");
    let mut fleet = Fleet::start(options).await;
    let run = run_checked_then_stop(&mut fleet, 2).await;

    let services: BTreeSet<String> = receiver
        .spans()
        .into_iter()
        .map(|s| s.service_name)
        .collect();
    let expected: BTreeSet<String> = ["head", "gateway", "scheduler", "device-worker"]
        .iter()
        .map(|s| format!("from-env/{s}"))
        .collect();
    assert_eq!(services, expected);
    assert!(
        !run.stdout.contains(r#""signal""#),
        "the file's console exporter was used"
    );
    assert!(!fleet.stdout(Service::Scheduler).contains(r#""signal""#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_propagates_through_hops_whose_span_groups_are_off() {
    let receiver = OtlpReceiver::grpc().await;
    let options = otlp(&receiver)
        .service_env(Service::Head, "NOMAD_OTEL_SPAN_GROUPS", "rollout")
        .service_env(Service::Gateway, "NOMAD_OTEL_SPAN_GROUPS", "none")
        .service_env(Service::Scheduler, "NOMAD_OTEL_SPAN_GROUPS", "tool")
        .service_env(Service::DeviceWorker, "NOMAD_OTEL_SPAN_GROUPS", "batch");
    let mut fleet = Fleet::start(options).await;
    let run = run_checked_then_stop(&mut fleet, 3).await;

    let spans = receiver.spans();
    assert!(spans.iter().all(|s| s.service_name != "nomad/gateway"));
    for result in &run.results {
        let trace: Vec<&SpanRecord> = spans
            .iter()
            .filter(|s| s.trace_id == result["trace_id"].as_str().unwrap())
            .collect();
        let find = |name: &str| {
            trace
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name} missing from trace {}", result["trace_id"]))
        };
        let rollout = find("nomad.rollout");
        let tool = find("nomad.tool.request");
        let execute = find("nomad.device.execute");
        // The gateway recorded nothing, yet the scheduler's span hangs off the head's rollout;
        // the scheduler recorded no batch span, yet the worker's share of the batch hangs off
        // the request's span.
        assert_eq!(
            tool.parent_span_id.as_deref(),
            Some(rollout.span_id.as_str())
        );
        assert_eq!(
            execute.parent_span_id.as_deref(),
            Some(tool.span_id.as_str())
        );
        assert_eq!(
            execute.attr("nomad.rollout.id"),
            result["rollout_id"].as_str()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_boolean_fails_startup_naming_the_variable() {
    let dir = Fleet::new_dir();
    let tasks = dir.join("tasks.jsonl");
    std::fs::write(&tasks, "{\"id\":\"a\",\"tool\":\"mlp\"}\n").unwrap();
    let runs: [(&str, Vec<&str>); 4] = [
        ("nomad-scheduler", vec!["--listen", "127.0.0.1:0"]),
        ("nomad-gateway", vec!["--listen", "127.0.0.1:0"]),
        ("nomad-device-worker", vec!["--listen", "127.0.0.1:0"]),
        ("nomad", vec!["run", "--tasks", tasks.to_str().unwrap()]),
    ];
    for (name, args) in runs {
        let output = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::process::Command::new(binary(name))
                .args(&args)
                .env("NOMAD_OTEL_ENABLED", "maybe")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("{name} did not exit on a bad NOMAD_OTEL_ENABLED"))
        .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "{name} started despite NOMAD_OTEL_ENABLED=maybe"
        );
        assert!(
            stderr.contains("NOMAD_OTEL_ENABLED") && stderr.contains("maybe"),
            "{name}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
