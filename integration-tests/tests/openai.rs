//! The OpenAI-compatible routes with the official `openai` Python client against a real fleet
//! (the default models, and a cross-encoder the encoder tests make): embeddings equal the
//! `embed` tool's output, a chat completion equals `generate` greedy for the same conversation,
//! streamed deltas concatenate to the unary text, 64 concurrent streams are batched, a
//! `traceparent` header continues the caller's trace, and bad requests and a missing token are
//! answered in OpenAI's error shape.

use std::time::Duration;

use nomad_integration_tests::fleet::{TEST_TOKEN, models_dir};
use nomad_integration_tests::peers::run_script;
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver};
use nomad_proto::v1::tool_output;
use serde_json::{Value, json};

const TRACE_ID: &str = "6bf92f3577b34da6a3ce929d0e0e4736";

async fn openai(base: &str, token: &str, ops: &Value) -> Vec<Value> {
    let args = [base.to_owned(), token.to_owned()];
    let (lines, stderr) =
        run_script("openai_client.py", &args, ops, Duration::from_secs(300)).await;
    assert_eq!(
        lines.len(),
        ops.as_array().unwrap().len(),
        "stderr:\n{stderr}"
    );
    lines
}

async fn tool(
    fleet: &Fleet,
    tool: &str,
    text: &str,
    options: Value,
) -> nomad_proto::v1::CallToolResponse {
    let mut client = fleet.scheduler_client().await;
    client
        .call_tool(text_call(tool, text, options.to_string()))
        .await
        .unwrap()
        .into_inner()
}

/// The `embed` tool's vector of `text`.
async fn embedding(fleet: &Fleet, text: &str) -> Vec<f32> {
    match tool(fleet, "embed", text, json!({}))
        .await
        .output
        .and_then(|o| o.value)
    {
        Some(tool_output::Value::Tensor(t)) => t.to_f32_vec().unwrap(),
        other => panic!("not a vector: {other:?}"),
    }
}

fn text_of(r: &nomad_proto::v1::CallToolResponse) -> String {
    match r.output.as_ref().and_then(|o| o.value.as_ref()) {
        Some(tool_output::Value::Text(t)) => t.clone(),
        other => panic!("not text: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_gets_what_the_tools_give() {
    let models = models_dir();
    let (encoders, _) = nomad_integration_tests::encoders::cases();
    let receiver = OtlpReceiver::grpc().await;
    let tools = format!(
        "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: 32, max_pending: 8}}\n  \
         - {{name: generate, kind: generate, source: {}, max_running: 64}}\n  \
         - {{name: rerank, kind: rerank, source: {}}}\n\
         tool_manager:\n  heartbeat_interval_ms: 200\n",
        models.join("all-minilm-l6-v2").display(),
        models.join("smollm2-135m-instruct").display(),
        encoders.join("bert-rerank").display(),
    );
    let mut fleet = Fleet::start(
        FleetOptions {
            auth: true,
            ..FleetOptions::serving(tools)
        }
        .exporting_to(&receiver)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.2"),
    )
    .await;
    let base = fleet.gateway_mcp_url().replace("/mcp", "/v1");
    let question = json!([{"role": "user", "content": "What is the capital of France?"}]);
    // More texts in one request than the embed tool queues (its max_pending is 8).
    let many: Vec<String> = (0..40).map(|i| format!("text number {i}")).collect();
    let ops = json!([
        {"op": "models"},
        {"op": "embeddings", "model": "embed", "input": ["Nomad serves models.", "hi"]},
        {"op": "embeddings", "model": "embed", "input": "hi", "encoding_format": "float"},
        {"op": "chat", "model": "generate", "messages": question, "max_tokens": 12, "temperature": 0},
        {"op": "chat", "model": "generate", "messages": question, "max_tokens": 12, "temperature": 0,
         "stream": true, "stream_options": {"include_usage": true},
         "headers": {"traceparent": format!("00-{TRACE_ID}-00f067aa0ba902b7-01")}},
        {"op": "completion", "model": "generate", "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0},
        {"op": "completion", "model": "generate", "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "stream": true},
        {"op": "chats", "count": 64, "model": "generate", "messages": question, "max_tokens": 8, "temperature": 0},
        {"op": "rerank", "body": {"model": "rerank", "query": "heat in metals",
            "documents": ["Copper conducts heat.", "Two eggs.", "Electrons carry heat in metals."],
            "top_n": 2, "return_documents": true}},
        {"op": "embeddings", "model": "embed", "input": "x", "dimensions": 8},
        {"op": "embeddings", "model": "nope", "input": "x"},
        {"op": "embeddings", "model": "generate", "input": "x"},
        {"op": "chat", "model": "generate", "messages": question, "n": 2},
        {"op": "chat", "model": "generate", "messages": question, "presence_penalty": 0.5},
        {"op": "embeddings", "model": "embed", "input": many.clone(), "encoding_format": "float"},
    ]);
    let r = openai(&base, TEST_TOKEN, &ops).await;

    let listed: Vec<(&str, &str)> = r[0]["models"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", r[0]))
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap(),
                m["kind"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    for want in [
        ("embed", "embed"),
        ("generate", "generate"),
        ("rerank", "rerank"),
    ] {
        assert!(listed.contains(&want), "{listed:?}");
    }

    // Embeddings (base64, as the client asks by default, and floats) equal the embed tool's.
    for (i, text) in ["Nomad serves models.", "hi"].iter().enumerate() {
        let reference = embedding(&fleet, text).await;
        let got: Vec<f32> = r[1]["vectors"][i]
            .as_array()
            .unwrap_or_else(|| panic!("{}", r[1]))
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let diff = got
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(got.len() == 384 && diff < 1e-5, "{text}: {diff}");
    }
    assert_eq!(r[2]["vectors"][0].as_array().unwrap().len(), 384);
    // 40 texts against a queue of 8: admitted a few at a time, all answered, in order.
    let last = r.last().unwrap();
    let vectors = last["vectors"]
        .as_array()
        .unwrap_or_else(|| panic!("40 texts: {last}"));
    assert_eq!(vectors.len(), many.len());
    for i in [0, 17, 39] {
        let reference = embedding(&fleet, &many[i]).await;
        let diff = vectors[i]
            .as_array()
            .unwrap()
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a.as_f64().unwrap() as f32 - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-5, "text {i} of 40: {diff}");
    }

    // A chat completion is generate greedy on the same conversation; streamed, the same text.
    let reference = tool(
        &fleet,
        "generate",
        "",
        json!({"messages": question, "max_tokens": 12}),
    )
    .await;
    let want = text_of(&reference);
    assert_eq!(r[3]["text"], want, "{}", r[3]);
    assert_eq!(
        r[3]["usage"]["completion_tokens"],
        reference.generation.as_ref().unwrap().completion_tokens
    );
    assert_eq!(r[4]["text"], want, "{}", r[4]);
    assert!(r[4]["pieces"].as_u64().unwrap() > 1, "one piece: {}", r[4]);
    assert_eq!(
        r[4]["usage"]["prompt_tokens"],
        reference.generation.as_ref().unwrap().prompt_tokens
    );
    assert_eq!(r[4]["finish_reason"], r[3]["finish_reason"]);
    // The prefix cache's share of the prompt, in OpenAI's field for it.
    let cached = r[4]["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(
        cached.is_some_and(|c| c <= r[4]["usage"]["prompt_tokens"].as_u64().unwrap()),
        "{}",
        r[4]
    );
    let completion = tool(
        &fleet,
        "generate",
        "1, 2, 3,",
        json!({"chat": false, "max_tokens": 6}),
    )
    .await;
    assert_eq!(r[5]["text"], text_of(&completion), "{}", r[5]);
    assert_eq!(r[6]["text"], text_of(&completion), "{}", r[6]);

    // 64 streams at once: one answer, greedy, and they ran together.
    let texts = r[7]["texts"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", r[7]));
    assert_eq!(texts.len(), 64);
    let first = texts[0].as_str().unwrap();
    assert!(texts.iter().all(|t| t == first), "{texts:?}");
    // A generation's batch size is the requests decoding together when it ran.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let most = loop {
        let most = receiver
            .latest_metrics()
            .iter()
            .filter(|m| m.name == "nomad.tool.batch.size")
            .filter(|m| m.attributes.get("tool").map(String::as_str) == Some("generate"))
            .filter_map(|m| m.max)
            .fold(0.0, f64::max);
        if most > 1.0 || std::time::Instant::now() > deadline {
            break most;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        most > 1.0,
        "generations ran together at most {most} at once"
    );

    // Rerank in the common shape, against the rerank tool.
    let scored = tool(
        &fleet,
        "rerank",
        "heat in metals",
        json!({"documents":
        ["Copper conducts heat.", "Two eggs.", "Electrons carry heat in metals."], "top_n": 2}),
    )
    .await;
    let scored: Value = match scored.output.and_then(|o| o.value) {
        Some(tool_output::Value::Json(j)) => serde_json::from_str(&j).unwrap(),
        other => panic!("{other:?}"),
    };
    let results = r[8]["results"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", r[8]));
    assert_eq!(results.len(), 2);
    for (got, want) in results.iter().zip(scored.as_array().unwrap()) {
        assert_eq!(got["index"], want["index"]);
        assert!(
            (got["relevance_score"].as_f64().unwrap() - want["score"].as_f64().unwrap()).abs()
                < 1e-6
        );
        assert!(got["document"]["text"].is_string());
    }

    // Errors in OpenAI's shape, with the status a client expects.
    let error = |i: usize, status: u64, param: Option<&str>, words: &str| {
        assert_eq!(r[i]["status"], status, "{}", r[i]);
        let e = &r[i]["error"]["error"];
        assert!(e["message"].as_str().unwrap().contains(words), "{}", r[i]);
        assert!(e["type"].is_string(), "{}", r[i]);
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{}", r[i]);
        }
    };
    error(9, 400, Some("dimensions"), "`dimensions` is not supported");
    error(
        10,
        404,
        Some("model"),
        "the model \"nope\" does not exist here; models for this endpoint: embed",
    );
    error(
        11,
        400,
        Some("model"),
        "model \"generate\" is a generate tool; this endpoint serves embed tools",
    );
    error(12, 400, Some("n"), "only 1 is supported");
    error(
        13,
        400,
        Some("presence_penalty"),
        "`presence_penalty` is not supported",
    );

    // Without the token: 401 in the same shape, saying what is wrong.
    let refused = openai(
        &base,
        "wrong-token-0123456789abcdef",
        &json!([{"op": "models"}]),
    )
    .await;
    assert_eq!(refused[0]["status"], 401, "{}", refused[0]);
    assert_eq!(refused[0]["error"]["error"]["code"], "invalid_api_key");

    // The caller's traceparent is the parent of the call's spans in the scheduler.
    fleet.terminate().await;
    let spans = receiver.spans();
    let in_trace: Vec<&str> = spans
        .iter()
        .filter(|s| s.trace_id == TRACE_ID)
        .map(|s| s.name.as_str())
        .collect();
    assert!(in_trace.contains(&"nomad.tool.request"), "{in_trace:?}");
    assert!(
        in_trace.contains(&"nomad.gateway.upstream_tool"),
        "{in_trace:?}"
    );
}
