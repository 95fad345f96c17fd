//! The built-in encoder kinds read the model's own files: `embed` for BERT, DistilBERT, RoBERTa,
//! XLM-RoBERTa, CamemBERT and ModernBERT with every pooling sentence-transformers saves (cls, mean, max,
//! mean-sqrt-len, last token, several concatenated), with and without `Normalize`, with named
//! prompts; `rerank` (cross-encoders) and `classify` (labels from `id2label`). The models are
//! made by the test itself (`python/make_encoders.py`: random weights in each family's layout,
//! a real tokenizer, saved by transformers and sentence-transformers), and every answer is
//! checked within 1e-4 against what sentence-transformers and transformers compute for the same
//! directory. What Nomad does not compute is refused at start-up, naming it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_integration_tests::assert_status;
use nomad_integration_tests::encoders::cases;
use nomad_integration_tests::model_host::{described_tools, listed_as, text_calls_at_once};
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::{ToolState, tool_output};
use serde_json::{Value, json};
use tonic::Code;

fn max_diff(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "dimensions");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// A copy of `from` changed by `edit` (for the refusals).
fn variant(from: &Path, to: &Path, edit: impl FnOnce(&Path)) {
    std::fs::create_dir_all(to).unwrap();
    for entry in walk(from) {
        let target = to.join(entry.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &target).unwrap();
    }
    edit(to);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.file_type().unwrap().is_dir() {
            files.extend(walk(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoders_answer_as_sentence_transformers_and_transformers_do_and_refuse_what_they_do_not_compute()
 {
    let (out, cases) = cases();
    let dir = Fleet::new_dir();
    // What Nomad does not compute, each refused naming it.
    let bert = out.join("bert-mean");
    variant(&bert, &dir.join("dense"), |d| {
        let mut modules: Vec<Value> =
            serde_json::from_str(&std::fs::read_to_string(d.join("modules.json")).unwrap())
                .unwrap();
        modules.insert(2, json!({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}));
        std::fs::write(d.join("modules.json"), json!(modules).to_string()).unwrap();
    });
    variant(&bert, &dir.join("weighted"), |d| {
        std::fs::write(
            d.join("1_Pooling/config.json"),
            r#"{"pooling_mode": "weightedmean"}"#,
        )
        .unwrap();
    });
    variant(&bert, &dir.join("gpt2"), |d| {
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        config["model_type"] = json!("gpt2");
        std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    });
    variant(&out.join("xlm-roberta-cls"), &dir.join("relative"), |d| {
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        config["position_embedding_type"] = json!("relative_key");
        std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    });
    let mut tools = String::from("tools:\n");
    for case in &cases {
        tools.push_str(&format!(
            "  - {{name: {}, kind: {}, source: {}, batch_size: 16}}\n",
            case["name"].as_str().unwrap(),
            case["kind"].as_str().unwrap(),
            case["dir"].as_str().unwrap()
        ));
    }
    let refused = [
        (
            "dense",
            "embed",
            dir.join("dense"),
            "module 2 is sentence_transformers.models.Dense",
        ),
        (
            "weighted",
            "embed",
            dir.join("weighted"),
            "weighted-mean pooling is not supported",
        ),
        (
            "gpt2",
            "embed",
            dir.join("gpt2"),
            "model_type \"gpt2\" is not an encoder family Nomad runs (bert, distilbert, xlm-roberta, roberta, camembert, modernbert)",
        ),
        (
            "classify-as-rerank",
            "rerank",
            out.join("bert-classify"),
            "serve it as `classify`",
        ),
        (
            "rerank-as-classify",
            "classify",
            out.join("bert-rerank"),
            "serve it as `rerank`",
        ),
        (
            "relative",
            "embed",
            dir.join("relative"),
            "position_embedding_type \"relative_key\" is not served (absolute is)",
        ),
    ];
    for (name, kind, path, _) in &refused {
        tools.push_str(&format!(
            "  - {{name: {name}, kind: {kind}, source: {}}}\n",
            path.display()
        ));
    }
    tools.push_str("tool_manager:\n  heartbeat_interval_ms: 200\n");
    let mut fleet = Fleet::start(FleetOptions::serving(tools).in_dir(&dir)).await;
    let mut client = fleet.scheduler_client().await;
    let listed = described_tools(&mut client, Duration::from_secs(120)).await;
    for (name, _, _, expected) in &refused {
        let tool = listed_as(&listed, name, ToolState::Failed);
        assert!(tool.error.contains(expected), "{name}: {}", tool.error);
    }

    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let kind = case["kind"].as_str().unwrap();
        listed_as(&listed, name, ToolState::Ready);
        // Every request at once, so they run as one batch of different lengths.
        let calls = (case["requests"].as_array().unwrap().iter())
            .map(|r| {
                (
                    r["text"].as_str().unwrap().to_owned(),
                    r["options"].to_string(),
                )
            })
            .collect();
        let answers = text_calls_at_once(&client, name, calls).await;
        for (i, (answer, want)) in answers
            .into_iter()
            .zip(case["expected"].as_array().unwrap())
            .enumerate()
        {
            let answer = answer.unwrap_or_else(|e| panic!("{name} request {i}: {e}"));
            match (kind, answer.output.and_then(|o| o.value)) {
                ("embed", Some(tool_output::Value::Tensor(t))) => {
                    let got: Vec<f64> =
                        t.to_f32_vec().unwrap().into_iter().map(f64::from).collect();
                    let diff = max_diff(&got, &floats(want));
                    assert!(diff <= 1e-4, "{name} text {i}: max abs diff {diff:e}");
                }
                ("rerank" | "classify", Some(tool_output::Value::Json(text))) => {
                    let got: Value = serde_json::from_str(&text).unwrap();
                    let (got_list, want_list) = if kind == "rerank" {
                        (&got, want)
                    } else {
                        assert_eq!(got["label"], want["label"], "{name} text {i}");
                        (&got["scores"], &want["scores"])
                    };
                    let (got_list, want_list) =
                        (got_list.as_array().unwrap(), want_list.as_array().unwrap());
                    assert_eq!(got_list.len(), want_list.len(), "{name} request {i}: {got}");
                    for (g, w) in got_list.iter().zip(want_list) {
                        let key = if kind == "rerank" { "index" } else { "label" };
                        assert_eq!(g[key], w[key], "{name} request {i}: order {got} vs {want}");
                        let d = (g["score"].as_f64().unwrap() - w["score"].as_f64().unwrap()).abs();
                        assert!(
                            d <= 1e-4,
                            "{name} request {i}: score differs by {d:e}: {got} vs {want}"
                        );
                    }
                }
                (_, other) => panic!("{name} request {i}: unexpected output {other:?}"),
            }
        }
    }

    // A prompt the model does not have is refused naming the ones it has.
    let unknown = client
        .call_tool(text_call("bert-prompts", "x", r#"{"prompt": "doc"}"#))
        .await
        .unwrap_err();
    assert_status(
        &unknown,
        Code::InvalidArgument,
        "prompt \"doc\": this model's prompts are document, passage, query",
    );
    // A rerank request without documents is refused saying what it needs.
    let empty = client
        .call_tool(text_call("bert-rerank", "query", ""))
        .await
        .unwrap_err();
    assert!(
        empty
            .message()
            .contains("rerank needs the option \"documents\""),
        "{empty:?}"
    );
    fleet.terminate().await;
}
