//! The real default models through the whole fleet: head -> gateway -> scheduler -> worker,
//! compared with the same worker called directly.

use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::text_input;
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::{
    ExecuteBatchRequest, GatewayCallToolRequest, PlaceRequest, ToolInput, execute_batch_response,
    item_result, tool_output,
};
use serde::Deserialize as _;
use serde_json::{Value, json};

/// Runs one input on the worker directly (the scheduler has already loaded the tool there).
async fn worker_alone(fleet: &Fleet, tool: &str, input: ToolInput) -> tool_output::Value {
    let addr = std::fs::read_to_string(fleet.dir.join("device-worker.addr")).unwrap();
    let mut worker = DeviceWorkerClient::connect(format!("http://{}", addr.trim()))
        .await
        .unwrap();
    // One slot: the scheduler may have offloaded this tool for the other; placing is idempotent.
    worker
        .place(PlaceRequest { tool: tool.into() })
        .await
        .unwrap();
    let reply = worker
        .execute_batch(ExecuteBatchRequest {
            tool: tool.into(),
            inputs: vec![input],
            traces: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    let Some(execute_batch_response::Outcome::Results(results)) = reply.outcome else {
        panic!("worker gave no results");
    };
    match results.items[0].result.clone() {
        Some(item_result::Result::Output(o)) => o.value.unwrap(),
        other => panic!("worker refused: {other:?}"),
    }
}

fn text(s: &str, options: Value) -> ToolInput {
    text_input(s, options.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_and_generate_through_the_fleet_equal_the_worker_alone() {
    let models = models_dir();
    let options = FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n\
             \x20 - {{name: embed, kind: embed, source: {}, batch_size: 16}}\n\
             \x20 - {{name: generate, kind: generate, source: {}, batch_size: 2}}\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n",
            models.join("all-minilm-l6-v2").display(),
            models.join("smollm2-135m-instruct").display()
        )),
        ..Default::default()
    };
    let mut fleet = Fleet::start(options).await;
    let sentence = "Nomad serves models as tools to agents.";
    let prompt = "What is 2 + 2?";
    let tasks = vec![
        json!({"id": "e", "tool": "embed", "arguments": {"text": sentence}}),
        json!({"id": "g", "tool": "generate", "arguments": {"text": prompt, "max_tokens": 8}}),
    ];
    let run = fleet.run_head(&tasks, 2).await;
    assert!(run.success, "{}", run.stderr);
    let result = |id: &str| {
        run.results
            .iter()
            .find(|r| r["task_id"] == id)
            .unwrap()
            .clone()
    };

    // The full embedding through the gateway.
    let mut gateway = fleet.gateway_client().await;
    let full: Value = serde_json::from_str(
        &gateway
            .call_tool(GatewayCallToolRequest {
                server: "nomad".into(),
                tool: "embed".into(),
                arguments_json: json!({"text": sentence}).to_string(),
            })
            .await
            .unwrap()
            .into_inner()
            .result_json,
    )
    .unwrap();
    let through = Vec::<f32>::deserialize(&full["output"]).unwrap();

    let tool_output::Value::Tensor(alone) =
        worker_alone(&fleet, "embed", text(sentence, json!({}))).await
    else {
        panic!("embed returned text");
    };
    let alone = alone.to_f32_vec().unwrap();
    assert_eq!(alone.len(), 384);
    assert_eq!(through, alone, "the fleet changed the embedding");
    // The head's result summarises long outputs: first values and the norm.
    let summary = result("e")["output"].clone();
    let first = Vec::<f32>::deserialize(&summary["output"]).unwrap();
    assert_eq!(first, alone[..8]);
    assert!((summary["l2_norm"].as_f64().unwrap() - 1.0).abs() < 1e-5);

    let tool_output::Value::Text(generated) =
        worker_alone(&fleet, "generate", text(prompt, json!({"max_tokens": 8}))).await
    else {
        panic!("generate returned a tensor");
    };
    assert!(!generated.is_empty());
    assert_eq!(result("g")["output"]["text"], generated.as_str());
    // Through the gateway the text comes with its token counts and why it ended.
    let g = &result("g")["output"];
    assert!(g["prompt_tokens"].as_u64().unwrap() > 10, "{g}");
    assert!(g["cached_prompt_tokens"].as_u64().unwrap() < g["prompt_tokens"].as_u64().unwrap());
    let completion = g["completion_tokens"].as_u64().unwrap();
    let reason = g["finish_reason"].as_str().unwrap();
    assert!(
        (reason == "length" && completion == 8) || (reason == "stop" && completion < 8),
        "{g}"
    );
    fleet.terminate().await;
}
