//! What a device must show through the fleet, with a real model: a batch over the worker's
//! memory is out of memory, the scheduler halves it and serves every request, and the device's
//! memory reaches the metrics. Candle workers run on `NOMAD_TEST_DEVICE` when it is set, so
//! `scripts/gpu-check.sh` runs this same test on `cuda:0`; here it runs on the CPU.

use std::time::Duration;

use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::receiver::MetricRecord;
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver};
use nomad_proto::v1::tool_output;

const BATCH_SIZE: usize = 16;

fn scheduler_metrics<'a>(
    metrics: &'a [MetricRecord],
    name: &'a str,
) -> impl Iterator<Item = &'a MetricRecord> + 'a {
    metrics
        .iter()
        .filter(move |m| m.service_name == "nomad/scheduler" && m.name == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_batch_over_device_memory_is_halved_and_every_request_served() {
    let model = models_dir().join("all-minilm-l6-v2");
    let weights = std::fs::metadata(model.join("model.safetensors"))
        .expect("scripts/fetch-models")
        .len();
    // Each input is about 123 tokens: the encoder's activations take about 2.6 MB a sequence,
    // so 12 fit beside the weights in 30 MiB and a full batch of 16 does not.
    let budget = weights + (30 << 20);
    let receiver = OtlpReceiver::grpc().await;
    let options = FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: {BATCH_SIZE}}}\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n",
            model.display()
        )),
        worker_args: vec!["--memory-budget-bytes".into(), budget.to_string()],
        ..Default::default()
    }
    .exporting_to(&receiver)
    .env("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.2");
    let mut fleet = Fleet::start(options).await;
    let client = fleet.scheduler_client().await;

    // All arrive while the model loads, so the first batch is a full one.
    let answers = futures::future::join_all((0..BATCH_SIZE).map(|i| {
        let mut client = client.clone();
        async move {
            let request = text_call("embed", format!("{i} {}", "the ".repeat(120)), "");
            client.call_tool(request).await.map(|r| r.into_inner())
        }
    }))
    .await;
    for (i, answer) in answers.into_iter().enumerate() {
        let answer = answer.unwrap_or_else(|e| panic!("request {i}: {e}"));
        match answer.output.and_then(|o| o.value) {
            Some(tool_output::Value::Tensor(t)) => assert_eq!(t.shape, [384], "request {i}"),
            other => panic!("request {i}: not a vector: {other:?}"),
        }
    }

    let mut reductions = Vec::new();
    let mut allocated = 0.0;
    for _ in 0..50 {
        let metrics = receiver.latest_metrics();
        reductions = scheduler_metrics(&metrics, "nomad.tool.batch.oom_reductions")
            .filter(|m| m.value > 0.0)
            .map(|m| m.attributes.clone())
            .collect();
        allocated = scheduler_metrics(&metrics, "nomad.device.memory.allocated")
            .map(|m| m.value)
            .fold(0.0, f64::max);
        if !reductions.is_empty() && allocated > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let first = reductions
        .first()
        .expect("an out-of-memory reduction was recorded");
    assert_eq!(first.get("tool").map(String::as_str), Some("embed"));
    let new_size: usize = first["new_batch_size"].parse().unwrap();
    assert!(new_size <= BATCH_SIZE / 2, "{first:?}");
    // The device's memory in use covers at least the weights (on CPU, the placed models'
    // bytes; on an accelerator, the driver's figure). gpu-check.sh prints it beside nvidia-smi.
    assert!(
        allocated >= weights as f64 * 0.9,
        "nomad.device.memory.allocated {allocated} B, weights {weights} B"
    );
    eprintln!("device memory: nomad.device.memory.allocated {allocated} B (weights {weights} B)");
    fleet.terminate().await;
}
