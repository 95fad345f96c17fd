//! Reliability at scale: traces stay whole for a thousand concurrent rollouts flushed by
//! SIGTERM, and a storm of cancellations leaves the scheduler's books balanced and its queues
//! empty.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use nomad_integration_tests::assert_status;
use nomad_integration_tests::fleet::mlp_tasks;
use nomad_integration_tests::receiver::{assert_drained, scheduler_value};
use nomad_integration_tests::spans::{check_batch_links, check_rollout_traces};
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_rollouts_at_concurrency_64_are_whole_traces_after_sigterm() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions {
        tools_yaml: None,
        ..Default::default()
    }
    .exporting_to(&receiver);
    let mut fleet = Fleet::start(options).await;
    let tasks = mlp_tasks(1000);
    let run = fleet.run_head(&tasks, 64).await;
    assert!(run.success, "{}", run.stderr);
    assert_eq!(run.results.len(), 1000);
    // SIGTERM right after the last rollout: whatever is still buffered must be flushed.
    fleet.terminate().await;
    let spans = receiver.spans();
    // One trace per rollout, one root, no orphan (a lost span orphans its children), the run id
    // on every span, all four services.
    check_rollout_traces(&spans, &run.results, &run.run_id());
    check_batch_links(&spans);
}

/// xorshift64*: test randomness, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_cancelled_requests_leave_the_books_balanced_and_the_queues_empty() {
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions::simulated(
        2,
        "tools:\n\
             \x20 - {name: t, kind: mlp, source: sim, batch_size: 8, max_devices: 2, max_pending: 20000}\n\
             tool_manager:\n\
             \x20 heartbeat_interval_ms: 200\n\
             \x20 max_batch_delay_ms: 2\n",
        "sim:\n  base_latency_ms: 4\n  per_item_latency_ms: 1\n",
    )
    .exporting_to(&receiver)
    .env("NOMAD_OTEL_SPAN_GROUPS", "none");
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;

    const TOTAL: u64 = 10_000;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Each request is abandoned at a random point: half by dropping the call (the stream is
    // reset), half by a gRPC deadline the scheduler enforces itself.
    let plans: Vec<(u64, bool)> = (0..TOTAL)
        .map(|_| {
            let quick = rng.below(2) == 0;
            (rng.below(if quick { 20 } else { 400 }), rng.below(2) == 0)
        })
        .collect();
    let outcomes: Vec<String> = futures::stream::iter(plans.into_iter().enumerate())
        .map(|(i, (after_ms, by_deadline))| {
            let mut client = client.clone();
            async move {
                let mut request = tonic::Request::new(text_call("t", format!("r{i}"), ""));
                let limit = Duration::from_millis(after_ms + 1);
                if by_deadline {
                    request.set_timeout(limit);
                    match client.call_tool(request).await {
                        Ok(_) => "ok".to_owned(),
                        Err(s) if s.code() == Code::DeadlineExceeded => "abandoned".to_owned(),
                        Err(s) if s.code() == Code::Cancelled => "abandoned".to_owned(),
                        Err(s) => format!("error {:?}: {}", s.code(), s.message()),
                    }
                } else {
                    match tokio::time::timeout(limit, client.call_tool(request)).await {
                        Ok(Ok(_)) => "ok".to_owned(),
                        Ok(Err(s)) => format!("error {:?}: {}", s.code(), s.message()),
                        Err(_) => "abandoned".to_owned(),
                    }
                }
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    for o in &outcomes {
        *counts.entry(o.as_str()).or_default() += 1;
    }
    eprintln!("client outcomes: {counts:?}");
    assert_eq!(outcomes.len() as u64, TOTAL);
    assert!(
        counts.keys().all(|k| !k.starts_with("error")),
        "no request failed: {counts:?}"
    );
    let abandoned = counts.get("abandoned").copied().unwrap_or(0);
    assert!(
        abandoned > 1000,
        "the storm cancelled too little to test: {counts:?}"
    );

    // Let the scheduler notice the last cancellations, then flush its metrics.
    tokio::time::sleep(Duration::from_millis(500)).await;
    fleet.terminate().await;
    let metrics = receiver.latest_metrics();
    let accepted = scheduler_value(&metrics, "nomad.tool.requests", &[("tool", "t")]);
    let ended = |status: &str| {
        scheduler_value(
            &metrics,
            "nomad.tool.request.duration",
            &[("tool", "t"), ("status", status)],
        )
    };
    let cancelled = scheduler_value(
        &metrics,
        "nomad.tool.request_cancellations",
        &[("tool", "t")],
    );
    // The scheduler's books: every accepted request ended once, and the cancellation counter is
    // exactly the requests that ended cancelled (while pending or executing).
    assert_eq!(accepted, ended("ok") + ended("error") + ended("cancelled"));
    assert_eq!(cancelled, ended("cancelled"));
    assert!(cancelled > 0.0, "no cancellation reached the scheduler");
    // What the client saw bounds it: a request abandoned before the scheduler took it, or after
    // it answered, is not a cancellation there.
    assert!(cancelled <= abandoned as f64, "{cancelled} > {abandoned}");
    assert!(ended("ok") >= counts.get("ok").copied().unwrap_or(0) as f64);
    assert!(accepted <= TOTAL as f64);
    assert_drained(&metrics, "t");
}

/// The scheduler SIGKILLed while the gateway and a worker keep running: a call made during the
/// outage waits for it (`gateway.scheduler_wait_seconds`, 2 s here) and fails with UNAVAILABLE
/// naming that bound when it does not come back, instead of hanging; back on the same address,
/// the worker registers again and the gateway reconnects with no restart of their own, and a call
/// made while it was down is answered once it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scheduler_gets_its_workers_and_gateway_back_and_a_call_waits_for_it() {
    use nomad_proto::v1::GatewayCallToolRequest;
    use nomad_proto::v1::gateway_client::GatewayClient;
    let options = FleetOptions::simulated(
        1,
        "tools:\n  - {name: t, kind: mlp, source: sim}\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n",
        "gateway:\n  scheduler_wait_seconds: 2\n",
    );
    let mut fleet = Fleet::start(options).await;
    let gateway = fleet.gateway_client().await;
    let call = |mut gateway: GatewayClient<tonic::transport::Channel>| async move {
        let started = std::time::Instant::now();
        let reply = gateway
            .call_tool(GatewayCallToolRequest {
                server: "nomad".into(),
                tool: "t".into(),
                arguments_json: r#"{"input": [1, 2]}"#.into(),
            })
            .await;
        (reply, started.elapsed())
    };
    let (reply, _) = call(gateway.clone()).await;
    reply.expect("the fleet serves before the outage");

    fleet.kill_scheduler().await;
    // A call sent in the instant before the gateway sees the connection close goes out on it
    // and is lost with it: UNAVAILABLE, naming the lost scheduler (it may have run, so it is
    // not sent again).
    let (reply, _) = call(gateway.clone()).await;
    let status = reply.expect_err("no scheduler, no answer");
    assert_status(&status, Code::Unavailable, "scheduler");
    // No scheduler for longer than the wait: UNAVAILABLE once the wait is over, naming it.
    for _ in 0..2 {
        let (reply, took) = call(gateway.clone()).await;
        let status = reply.expect_err("no scheduler, no answer");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status
                .message()
                .contains("could not be reached within 2.0 s")
                && status.message().contains("gateway.scheduler_wait_seconds"),
            "{status:?}"
        );
        assert!(
            took >= Duration::from_millis(1500) && took < Duration::from_secs(4),
            "the call waited {took:?}"
        );
    }

    // A call made while it is down, then the scheduler back on the same address: the call is
    // answered, the worker registers again and the gateway reconnects, with no restart of their
    // own.
    let waiting = tokio::spawn(call(gateway.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    fleet.restart_scheduler().await;
    let (reply, took) = waiting.await.unwrap();
    let answer = reply.expect("a call made during the outage is answered once it is over");
    // The simulated worker echoes its input.
    assert!(
        answer.into_inner().result_json.contains("[1.0,2.0]"),
        "after {took:?}"
    );
    fleet.wait_for_workers(1).await;
    let (reply, _) = call(gateway.clone()).await;
    assert!(
        reply
            .unwrap()
            .into_inner()
            .result_json
            .contains("[1.0,2.0]")
    );
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_is_resource_exhausted_naming_the_limit() {
    use nomad_proto::v1::GatewayCallToolRequest;
    use nomad_proto::v1::gateway_client::GatewayClient;
    use nomad_proto::v1::scheduler_client::SchedulerClient;
    let fleet = Fleet::start(FleetOptions::default()).await;
    let channel = |address: &str| {
        tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .unwrap()
            .connect_lazy()
    };
    let big = "x".repeat(5 << 20);
    let to_gateway = GatewayClient::new(channel(&fleet.gateway_addr))
        .call_tool(GatewayCallToolRequest {
            server: "nomad".into(),
            tool: "mlp".into(),
            arguments_json: big.clone(),
        })
        .await;
    let to_scheduler = SchedulerClient::new(channel(&fleet.scheduler_addr))
        .call_tool(text_call("mlp", big, ""))
        .await;
    for status in [to_gateway.map(|_| ()), to_scheduler.map(|_| ())] {
        let status = status.expect_err("5 MiB is over the limit");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("4194304-byte limit") && status.message().contains("smaller"),
            "{}",
            status.message()
        );
    }
}
