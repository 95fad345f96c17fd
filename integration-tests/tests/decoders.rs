//! `generate` from GGUF files of each served family — llama with Llama 3's tokenizer and
//! template, llama with a SentencePiece vocabulary and Mistral's template, qwen2 (q/k/v biases),
//! qwen3 (q/k norms, heads wider than hidden / heads, tied embeddings) — and from transformers
//! directories (safetensors in f32 and bfloat16, `tokenizer.json`, `chat_template.jinja`, rope
//! scaling of Llama 3.1's kind and linear, Mistral's sliding window far shorter than the
//! prompts), made
//! by the test itself (`python/make_decoders.py`: random weights in each family's layout, a real
//! vocabulary under the family's pre-tokenizer, its special tokens and chat template), served by
//! a real fleet, and checked against what transformers computes from the same files: the
//! prompt's token count (tokenizer, chat template, BOS) and the greedy continuation; a
//! conversation the model's template refuses is refused with the template's own words. Files of
//! a family, pre-tokenizer or rope scaling Nomad does not serve are refused at start-up, naming
//! it.

use std::time::Duration;

use nomad_integration_tests::encoders::decoder_cases;
use nomad_integration_tests::model_host::{described_tools, listed_as, text_calls_at_once};
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::{ToolState, tool_output};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decoders_of_each_family_answer_as_transformers_does_and_the_rest_are_refused() {
    let (out, cases) = decoder_cases();
    let mut tools = String::from("tools:\n");
    for case in &cases {
        tools.push_str(&format!(
            "  - {{name: {}, kind: generate, source: {}}}\n",
            case["name"].as_str().unwrap(),
            out.join(case["file"].as_str().unwrap()).display()
        ));
    }
    let refused = [
        (
            "phi3-arch",
            "architecture \"phi3\" is not served (served: llama, mistral, qwen2, qwen3)",
        ),
        (
            "tekken-pre",
            "tokenizer.ggml.pre = \"tekken\" is not a pre-tokenizer this worker knows",
        ),
        (
            "yarn-rope",
            "qwen2.rope.scaling.type = \"yarn\": this rope scaling is not served",
        ),
    ];
    for (name, _) in &refused {
        tools.push_str(&format!(
            "  - {{name: {name}, kind: generate, source: {}}}\n",
            out.join(format!("{name}.gguf")).display()
        ));
    }
    tools.push_str("tool_manager:\n  heartbeat_interval_ms: 200\n");
    let dir = Fleet::new_dir();
    let fleet = Fleet::start(FleetOptions::serving(tools).in_dir(&dir)).await;
    let mut client = fleet.scheduler_client().await;
    let listed = described_tools(&mut client, Duration::from_secs(120)).await;
    for (name, expected) in &refused {
        let tool = listed_as(&listed, name, ToolState::Failed);
        assert!(tool.error.contains(expected), "{name}: {}", tool.error);
    }

    for case in &cases {
        let name = case["name"].as_str().unwrap();
        listed_as(&listed, name, ToolState::Ready);
        // Every request at once: they decode together.
        let requests = case["requests"].as_array().unwrap();
        let calls = requests.iter().map(|r| {
            let mut options = json!({});
            if let Some(max_tokens) = r.get("max_tokens") {
                options["max_tokens"] = max_tokens.clone();
            }
            if let Some(messages) = r.get("messages") {
                options["messages"] = messages.clone();
            } else {
                options["chat"] = r["chat"].clone();
            }
            let text = r.get("text").and_then(Value::as_str).unwrap_or("");
            (text.to_owned(), options.to_string())
        });
        let answers = text_calls_at_once(&client, name, calls.collect()).await;
        for (i, (answer, want)) in answers.into_iter().zip(requests).enumerate() {
            if let Some(refused) = want.get("refused").and_then(Value::as_str) {
                let status = answer.expect_err("the template refuses this conversation");
                assert_eq!(
                    status.code(),
                    tonic::Code::InvalidArgument,
                    "{name}: {status:?}"
                );
                assert!(
                    status.message().contains(&format!(
                        "the model's chat template refuses this conversation: {refused}"
                    )),
                    "{name}: {status:?}"
                );
                continue;
            }
            let answer = answer.unwrap_or_else(|e| panic!("{name} request {i}: {e}"));
            let stats = answer.generation.clone().unwrap();
            assert_eq!(
                u64::from(stats.prompt_tokens),
                want["prompt_tokens"].as_u64().unwrap(),
                "{name} request {i}: prompt tokens (as transformers renders it: {:?})",
                want.get("rendered")
            );
            // Null where transformers' first step is a near-tie: only the prompt is compared.
            let expected = want["expected"].as_str();
            match answer.output.and_then(|o| o.value) {
                Some(tool_output::Value::Text(text)) => {
                    if let Some(expected) = expected {
                        assert_eq!(text, expected, "{name} request {i}: greedy continuation");
                    }
                }
                other => panic!("{name} request {i}: unexpected output {other:?}"),
            }
        }
    }
}
