//! The scheduler end to end: a real scheduler, simulated workers (real worker processes with
//! `--backend sim`) and the OTLP receiver.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::StreamExt as _;
use nomad_integration_tests::assert_status;
use nomad_integration_tests::receiver::{MetricRecord, assert_drained, scheduler_value};
use nomad_integration_tests::text_input;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver};
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{CallToolRequest, ToolInput, tool_output};
use nomad_rpc::Channel;
use tonic::Code;

/// The model-serving metric table of the original Nomad (name, type, unit): the contract.
const CONTRACT: &[(&str, &str, &str)] = &[
    ("nomad.tool.requests", "counter", "{request}"),
    ("nomad.tool.request_errors", "counter", "{request}"),
    ("nomad.tool.request_cancellations", "counter", "{request}"),
    ("nomad.tool.request_rejections", "counter", "{request}"),
    ("nomad.tool.request.duration", "histogram", "s"),
    ("nomad.tool.request.queue_wait", "histogram", "s"),
    ("nomad.tool.batch.duration", "histogram", "s"),
    ("nomad.tool.batch.size", "histogram", "{request}"),
    ("nomad.tool.batch.oom_reductions", "counter", "{event}"),
    ("nomad.tool.device.load_duration", "histogram", "s"),
    ("nomad.tool.device.offloads", "counter", "{event}"),
    ("nomad.tool.device.idle_evictions", "counter", "{event}"),
    ("nomad.tool.disk.loads", "counter", "{event}"),
    ("nomad.tool.disk.load_duration", "histogram", "s"),
    ("nomad.tool.disk.unloads", "counter", "{event}"),
    ("nomad.device.cache_clears", "counter", "{event}"),
    ("nomad.device.cache_clear.duration", "histogram", "s"),
    ("nomad.tool.queue.length", "updowncounter", "{request}"),
    ("nomad.tool.inflight.requests", "updowncounter", "{request}"),
    (
        "nomad.tool.batch.configured_size",
        "updowncounter",
        "{request}",
    ),
    ("nomad.tool.pending_tools", "updowncounter", "{tool}"),
    ("nomad.device.slot.busy", "gauge", "1"),
    ("nomad.device.tool.loaded", "updowncounter", "1"),
    ("nomad.tool.resident", "updowncounter", "1"),
    ("nomad.device.memory.allocated", "gauge", "By"),
    ("nomad.device.memory.reserved", "gauge", "By"),
    ("nomad.device.utilization", "gauge", "1"),
];

fn text(s: &str) -> ToolInput {
    text_input(s, "")
}

async fn call(
    client: &SchedulerClient<Channel>,
    tool: &str,
    input: ToolInput,
    timeout: Option<Duration>,
) -> Result<String, tonic::Status> {
    let mut request = tonic::Request::new(CallToolRequest {
        tool: tool.to_owned(),
        input: Some(input),
    });
    if let Some(t) = timeout {
        request.set_timeout(t);
    }
    let reply = client.clone().call_tool(request).await?.into_inner();
    match reply.output.and_then(|o| o.value) {
        Some(tool_output::Value::Text(t)) => Ok(t),
        other => panic!("unexpected output {other:?}"),
    }
}

fn attributes_of<'a>(metrics: &'a [MetricRecord], name: &str) -> Vec<&'a BTreeMap<String, String>> {
    metrics
        .iter()
        .filter(|m| m.name == name)
        .map(|m| &m.attributes)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_model_serving_metric_is_exported_with_its_type_unit_and_attributes() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions::simulated(
        1,
        "tools:\n\
             \x20 - {name: a, kind: mlp, source: sim, batch_size: 8, max_pending: 64}\n\
             \x20 - {name: b, kind: mlp, source: sim, batch_size: 1, max_pending: 3}\n\
             tool_manager:\n\
             \x20 heartbeat_interval_ms: 100\n\
             \x20 idle_seconds: 0.4\n\
             \x20 disk_idle_seconds: 0.8\n\
             \x20 gc_idle_seconds: 1.2\n\
             \x20 max_batch_delay_ms: 300\n",
        // A batch of 8 of `a` needs 900 bytes of 700: out of memory; 4 need 500 and fit.
        "sim:\n\
                      \x20 memory_bytes: 700\n\
                      \x20 model_bytes: 100\n\
                      \x20 activation_bytes_per_item: 100\n\
                      \x20 models:\n\
                      \x20   b: {base_latency_ms: 300}\n",
    )
    .exporting_to(&receiver)
    .env("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.2");
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;

    // 1. Eight requests fill one batch of 8: out of memory, halved to 4, all served.
    let answers = futures::future::join_all(
        (0..8).map(|i| call(&client, "a", text(&format!("a-{i}")), None)),
    )
    .await;
    for (i, answer) in answers.into_iter().enumerate() {
        assert_eq!(
            answer.unwrap(),
            format!("a-{i}"),
            "each request gets its own answer"
        );
    }

    // 2. `b` takes 300 ms a batch and holds 3 in its queue: the fifth request is refused.
    let running = tokio::spawn({
        let client = client.clone();
        async move { call(&client, "b", text("b-1"), None).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let queued: Vec<_> = (2..=4)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { call(&client, "b", text(&format!("b-{i}")), None).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refused = call(&client, "b", text("b-5"), None).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("max_pending"),
        "{}",
        refused.message()
    );
    assert_eq!(running.await.unwrap().unwrap(), "b-1");
    for q in queued {
        q.await.unwrap().unwrap();
    }

    // 3. An unknown tool is refused at once, naming the tools there are.
    let unknown = call(&client, "nope", text("x"), None).await.unwrap_err();
    assert_status(&unknown, Code::NotFound, "a, b");

    // 4. An input the model refuses fails that request only.
    let invalid = call(&client, "a", ToolInput::default(), None)
        .await
        .unwrap_err();
    assert_status(&invalid, Code::InvalidArgument, "empty input");

    // 5. A caller that gives up while queued cancels its request.
    let busy = tokio::spawn({
        let client = client.clone();
        async move { call(&client, "b", text("b-6"), None).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let gave_up = call(&client, "b", text("b-7"), Some(Duration::from_millis(100)))
        .await
        .unwrap_err();
    // The server enforces grpc-timeout too, so either side may report it first.
    assert!(
        matches!(gave_up.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{gave_up:?}"
    );
    busy.await.unwrap().unwrap();

    // 6. Idle: eviction (0.4 s), disk unload (0.8 s), cache clear (1.2 s).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    fleet.terminate().await;

    let metrics = receiver.latest_metrics();
    for (name, kind, unit) in CONTRACT {
        let points: Vec<&MetricRecord> = metrics.iter().filter(|m| m.name == *name).collect();
        assert!(!points.is_empty(), "{name} was never exported");
        for p in &points {
            assert_eq!(p.service_name, "nomad/scheduler", "{name}");
            assert_eq!(
                (p.kind, p.unit.as_str()),
                (*kind, *unit),
                "{name}: type and unit"
            );
        }
    }

    let counts = [
        ("nomad.tool.requests", vec![("tool", "a")], 9.0),
        ("nomad.tool.requests", vec![("tool", "b")], 6.0),
        (
            "nomad.tool.request_rejections",
            vec![("tool", "b"), ("reason", "queue_full")],
            1.0,
        ),
        (
            "nomad.tool.request_rejections",
            vec![("tool", "unknown"), ("reason", "unknown_tool")],
            1.0,
        ),
        ("nomad.tool.request_errors", vec![("tool", "a")], 1.0),
        ("nomad.tool.request_errors", vec![("tool", "b")], 0.0),
        ("nomad.tool.request_cancellations", vec![("tool", "b")], 1.0),
        (
            "nomad.tool.batch.oom_reductions",
            vec![
                ("tool", "a"),
                ("old_batch_size", "8"),
                ("new_batch_size", "4"),
            ],
            1.0,
        ),
        (
            "nomad.tool.batch.size",
            vec![("tool", "a"), ("status", "error")],
            1.0,
        ),
        (
            "nomad.tool.request.duration",
            vec![("tool", "b"), ("status", "cancelled")],
            1.0,
        ),
        (
            "nomad.tool.request.duration",
            vec![("tool", "a"), ("status", "ok")],
            8.0,
        ),
        ("nomad.tool.batch.configured_size", vec![("tool", "a")], 4.0),
        ("nomad.tool.queue.length", vec![("tool", "b")], 0.0),
        ("nomad.tool.inflight.requests", vec![("tool", "a")], 0.0),
    ];
    for (name, filter, expected) in counts {
        assert_eq!(
            scheduler_value(&metrics, name, &filter),
            expected,
            "{name}{filter:?}"
        );
    }
    for name in [
        "nomad.tool.device.offloads",
        "nomad.tool.device.idle_evictions",
        "nomad.tool.disk.unloads",
        "nomad.device.cache_clears",
    ] {
        assert!(
            scheduler_value(&metrics, name, &[]) >= 1.0,
            "{name} never counted"
        );
    }
    // Each tool was loaded from disk at least once (again if its unload came first), and after
    // the final idle period every load has been matched by an unload.
    for tool in ["a", "b"] {
        let loads = scheduler_value(
            &metrics,
            "nomad.tool.disk.loads",
            &[("tool", tool), ("load.kind", "resident")],
        );
        let unloads = scheduler_value(&metrics, "nomad.tool.disk.unloads", &[("tool", tool)]);
        assert!(
            loads >= 1.0 && loads == unloads,
            "{tool}: {loads} loads, {unloads} unloads"
        );
    }
    // Batch and device metrics carry the device; load metrics their kind.
    for name in [
        "nomad.tool.batch.duration",
        "nomad.tool.batch.size",
        "nomad.tool.device.load_duration",
        "nomad.device.slot.busy",
        "nomad.device.memory.allocated",
    ] {
        for attributes in attributes_of(&metrics, name) {
            for key in ["device", "device.type", "device.index"] {
                assert!(
                    attributes.contains_key(key),
                    "{name} lacks {key}: {attributes:?}"
                );
            }
        }
    }
    for attributes in attributes_of(&metrics, "nomad.tool.batch.duration") {
        assert!(attributes.contains_key("status") && attributes.contains_key("tool"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_batch_under_load_loses_no_request() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions::simulated(
        2,
        "tools:\n\
             \x20 - {name: t, kind: mlp, source: sim, batch_size: 8, max_devices: 2, max_pending: 8000}\n\
             tool_manager:\n\
             \x20 heartbeat_interval_ms: 100\n\
             \x20 max_batch_delay_ms: 1\n",
        "sim:\n  base_latency_ms: 5\n",
    )
    .exporting_to(&receiver)
    .env("NOMAD_OTEL_SPAN_GROUPS", "none");
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;

    const TOTAL: usize = 5000;
    let completed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load = {
        let completed = completed.clone();
        let client = client.clone();
        tokio::spawn(async move {
            futures::stream::iter(0..TOTAL)
                .map(|i| {
                    let client = client.clone();
                    let completed = completed.clone();
                    async move {
                        let answer = call(
                            &client,
                            "t",
                            text(&format!("req-{i}")),
                            Some(Duration::from_secs(30)),
                        )
                        .await;
                        completed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        (i, answer)
                    }
                })
                .buffer_unordered(64)
                .collect::<Vec<_>>()
                .await
        })
    };
    while completed.load(std::sync::atomic::Ordering::SeqCst) < 1000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fleet.kill_worker(0);
    let answers = tokio::time::timeout(Duration::from_secs(60), load)
        .await
        .expect("requests hung after the worker was killed")
        .unwrap();

    let mut seen: HashMap<usize, usize> = HashMap::new();
    let mut codes: HashMap<String, usize> = HashMap::new();
    for (i, answer) in &answers {
        *seen.entry(*i).or_default() += 1;
        match answer {
            Ok(text) => assert_eq!(
                text,
                &format!("req-{i}"),
                "request {i} got another's answer"
            ),
            Err(status) => *codes.entry(format!("{:?}", status.code())).or_default() += 1,
        }
    }
    assert_eq!(seen.len(), TOTAL);
    assert!(seen.values().all(|&n| n == 1));
    assert!(
        !codes.contains_key("DeadlineExceeded"),
        "requests hung: {codes:?}"
    );
    // One worker survives, so a requeued batch runs there; only a request whose worker was lost
    // twice may fail, and only with UNAVAILABLE.
    assert!(codes.keys().all(|c| c == "Unavailable"), "{codes:?}");

    fleet.reap_killed().await;
    fleet.terminate().await;
    // The scheduler's own count: every accepted request ended exactly once.
    let metrics = receiver.latest_metrics();
    let accepted = scheduler_value(&metrics, "nomad.tool.requests", &[("tool", "t")]);
    let ended: f64 = ["ok", "error", "cancelled"]
        .iter()
        .map(|s| {
            scheduler_value(
                &metrics,
                "nomad.tool.request.duration",
                &[("tool", "t"), ("status", s)],
            )
        })
        .sum();
    assert_eq!(accepted, TOTAL as f64);
    assert_eq!(ended, TOTAL as f64);
    assert_eq!(
        scheduler_value(
            &metrics,
            "nomad.tool.request.duration",
            &[("tool", "t"), ("status", "ok")]
        ),
        (TOTAL - codes.values().sum::<usize>()) as f64
    );
    // Nothing is left queued or in flight once every answer is in.
    assert_drained(&metrics, "t");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_model_hangs_is_dropped_at_the_deadline_and_its_batch_served_elsewhere() {
    let options = FleetOptions::simulated(
        2,
        "tools:\n\
             \x20 - {name: a, kind: mlp, source: sim, batch_size: 4, max_devices: 2}\n\
             tool_manager:\n\
             \x20 heartbeat_interval_ms: 200\n\
             \x20 max_batch_delay_ms: 50\n\
             \x20 execute_timeout_seconds: 1\n",
        "sim:\n  hang_worker: worker-1\n",
    );
    let fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;
    // Rounds of eight at once (a batch of four for each slot) until worker-1 has had a batch:
    // its first never finishes. Every request is still answered, by the other worker.
    let started = std::time::Instant::now();
    let mut round = 0;
    let log = loop {
        let replies = futures::future::join_all(
            (0..8).map(|i| call(&client, "a", text(&format!("r{round}-{i}")), None)),
        )
        .await;
        for (i, reply) in replies.iter().enumerate() {
            match reply {
                Ok(text) => assert_eq!(text, &format!("r{round}-{i}"), "request {i}"),
                Err(status) => panic!("round {round}, request {i}: {status}"),
            }
        }
        let log = fleet.stderr(nomad_integration_tests::Service::Scheduler);
        if log.contains("no answer to a batch") {
            break log;
        }
        round += 1;
        assert!(round < 10, "worker-1 never got a batch: {log}");
    };
    assert!(
        log.contains("no answer to a batch (execute_timeout_seconds) within 1 s"),
        "{log}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // The hung worker cannot stop cleanly with its model stuck: the fleet is killed on drop.
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_kills_workers_fails_alone_while_its_seven_neighbours_are_served() {
    let options = FleetOptions::simulated(
        3,
        "tools:\n\
             \x20 - {name: t, kind: mlp, source: sim, batch_size: 8, max_devices: 3}\n\
             tool_manager:\n\
             \x20 heartbeat_interval_ms: 100\n\
             \x20 max_batch_delay_ms: 200\n",
        // The load is slow enough that all eight are queued before the first slot is ready.
        "sim:\n  load_ms: 300\n  base_latency_ms: 20\n  crash_on: poison\n",
    );
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;
    let inputs: Vec<String> = (0..8)
        .map(|i| {
            if i == 3 {
                "poison".into()
            } else {
                format!("n{i}")
            }
        })
        .collect();
    let answers = tokio::time::timeout(
        Duration::from_secs(60),
        futures::future::join_all(inputs.iter().map(|i| call(&client, "t", text(i), None))),
    )
    .await
    .expect("requests hung after workers died");
    for (input, answer) in inputs.iter().zip(&answers) {
        if input == "poison" {
            let status = answer.as_ref().expect_err("the poison input was served");
            assert_eq!(status.code(), Code::Unavailable, "{status}");
            assert!(
                status
                    .message()
                    .contains("two workers were lost while running it"),
                "{status}"
            );
        } else {
            assert_eq!(
                answer.as_ref().unwrap(),
                input,
                "a neighbour of the poison failed"
            );
        }
    }
    // It took exactly two workers with it: the first batch's and its solo retry's.
    fleet.reap_killed().await;
    let live = fleet
        .pids()
        .iter()
        .filter(|(s, _)| *s == nomad_integration_tests::Service::DeviceWorker)
        .count();
    assert_eq!(
        live,
        1,
        "{}",
        fleet.stderr(nomad_integration_tests::Service::Scheduler)
    );
    // The survivor still serves.
    assert_eq!(
        call(&client, "t", text("after"), None).await.unwrap(),
        "after"
    );
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_one_mib_inputs_go_in_batches_under_the_byte_budget_and_are_all_answered() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions::simulated(
        1,
        "tools:\n\
             \x20 - {name: big, kind: mlp, source: sim, batch_size: 32}\n\
             tool_manager:\n\
             \x20 max_batch_delay_ms: 500\n",
        "sim:\n  load_ms: 300\n  base_latency_ms: 50\n",
    )
    .exporting_to(&receiver)
    .env("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.2");
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;
    let inputs: Vec<String> = (0..32u8)
        .map(|i| char::from(b'A' + i % 26).to_string().repeat(1 << 20))
        .collect();
    let answers =
        futures::future::join_all(inputs.iter().map(|i| call(&client, "big", text(i), None))).await;
    for (i, (input, answer)) in inputs.iter().zip(answers).enumerate() {
        match answer {
            Ok(output) => assert!(output == *input, "request {i} got another answer"),
            Err(status) => panic!("request {i}: {status}"),
        }
    }
    fleet.terminate().await;
    let metrics = receiver.latest_metrics();
    let sizes = metrics
        .iter()
        .find(|m| m.service_name == "nomad/scheduler" && m.name == "nomad.tool.batch.size")
        .expect("nomad.tool.batch.size was not exported");
    assert_eq!(sizes.sum, Some(32.0), "{sizes:?}");
    // The default budget is 16 MiB: fifteen 1 MiB inputs and their framing fit, sixteen do not.
    let largest = sizes.max.expect("the histogram has no max");
    assert!(
        (2.0..=15.0).contains(&largest),
        "a batch of {largest} inputs of 1 MiB: {sizes:?}"
    );
    assert!(sizes.value >= 3.0, "{sizes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_on_an_idle_slot_waits_zero_in_the_queue() {
    let options = FleetOptions::simulated(
        1,
        "tools:\n  - {name: a, kind: mlp, source: sim, batch_size: 16}\n",
        "",
    );
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;
    let ask = |i: usize| {
        let mut client = client.clone();
        async move {
            client
                .call_tool(CallToolRequest {
                    tool: "a".into(),
                    input: Some(text(&format!("r{i}"))),
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    // The first waits for the load; the rest find the slot idle and holding the tool.
    ask(0).await;
    for i in 1..6 {
        let reply = ask(i).await;
        assert_eq!(
            reply.queue_wait_seconds, 0.0,
            "request {i} waited with the slot idle"
        );
    }
    fleet.terminate().await;
}
