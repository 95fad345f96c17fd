//! Sequence classification heads: `rerank` (a cross-encoder: one label, a query and documents
//! in, each pair scored by the sigmoid of its logit, best first) and `classify` (labels from
//! `config.json`'s `id2label`, softmax probabilities, or sigmoid ones for a multi-label model).
//! The encoder is one of `families/encoder.rs`'s; pairs and texts are batched as `embed`'s texts
//! are, by length, over one single-threaded pool per core.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use nomad_proto::kinds::{self, KindSpec};
use serde_json::json;
use tokenizers::{EncodeInput, Tokenizer};

use crate::models::batch::{self, invalid};
use crate::models::families::encoder::Encoder;
use crate::models::formats::row::Row;
use crate::models::kinds::embed::{pools, tokenizer, weight_bytes};
use crate::models::kinds::options::Options;
use crate::models::model::{
    Answer, ExecError, ExecLimits, Input, LoadError, Model, Output, reloaded,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Rerank,
    Classify,
}

pub struct Scorer {
    dir: PathBuf,
    task: Task,
    encoder: Encoder,
    tokenizer: Tokenizer,
    labels: Vec<String>,
    /// `problem_type: multi_label_classification`: each label its own sigmoid.
    multi_label: bool,
    max_seq_length: usize,
    bytes: u64,
    device: Device,
    pools: crate::models::kinds::length_groups::Pools,
}

fn load_error(dir: &Path, reason: impl std::fmt::Display) -> LoadError {
    LoadError::Invalid {
        path: dir.to_owned(),
        reason: reason.to_string(),
    }
}

/// One request's rows: its pairs (rerank) or its text (classify).
struct Request {
    rows: std::ops::Range<usize>,
    top_n: usize,
    raw: bool,
}

impl Scorer {
    /// What loading `dir` for `task` would refuse, found from its config alone.
    pub fn check(dir: &Path, task: Task) -> Result<(), String> {
        let (_, shape, _) = crate::models::families::encoder::Shape::read(dir)?;
        check_labels(&shape.labels(), task)
    }

    pub fn load(dir: &Path, device: &Device, task: Task) -> Result<Self, LoadError> {
        let encoder = Encoder::load(dir, device, true).map_err(|e| load_error(dir, e))?;
        let labels = encoder.shape.labels();
        check_labels(&labels, task).map_err(|e| load_error(dir, e))?;
        #[derive(serde::Deserialize, Default)]
        struct Problem {
            problem_type: Option<String>,
        }
        let problem: Problem = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let multi_label = problem.problem_type.as_deref() == Some("multi_label_classification");
        let max_seq_length = sentence_max(dir)
            .unwrap_or(encoder.shape.max_tokens())
            .min(encoder.shape.max_tokens());
        let tokenizer = tokenizer(dir, max_seq_length)?;
        let bytes = weight_bytes(dir)?;
        let pools = pools(dir, device, task.name())?;
        tracing::info!(model = %dir.display(), family = encoder.family, task = task.name(), labels = %labels.join(", "), max_seq_length, multi_label, "sequence classification model");
        Ok(Self {
            dir: dir.to_owned(),
            task,
            encoder,
            tokenizer,
            labels,
            multi_label,
            max_seq_length,
            bytes,
            device: device.clone(),
            pools,
        })
    }

    fn kind(&self) -> &'static KindSpec {
        match self.task {
            Task::Rerank => &kinds::RERANK,
            Task::Classify => &kinds::CLASSIFY,
        }
    }

    /// The token rows of request `index` (its pairs, or its text), or why it cannot run.
    fn encode(&self, index: usize, input: &Input) -> Result<(Vec<Row>, Options), Answer> {
        let text = batch::text(index, input, self.kind())?;
        let options = Options::parse(index, &input.options, self.kind())?;
        let rows = match self.task {
            Task::Rerank => {
                let documents = options.texts("documents");
                if documents.is_empty() {
                    return Err(invalid(
                        index,
                        "rerank needs the option \"documents\": the texts to score against the \
                         query",
                    ));
                }
                documents
                    .iter()
                    .map(|d| {
                        let pair = EncodeInput::Dual(text.into(), d.as_str().into());
                        self.tokenizer
                            .encode(pair, true)
                            .map(|e| Row::of(&e))
                            .map_err(|e| invalid(index, format!("tokenizing: {e}")))
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            Task::Classify => {
                let encoding = self
                    .tokenizer
                    .encode(text, true)
                    .map_err(|e| invalid(index, format!("tokenizing: {e}")))?;
                if !encoding.get_overflowing().is_empty() && !options.flag("truncate") {
                    return Err(invalid(
                        index,
                        format!(
                            "the text is longer than this model's max_seq_length of {} tokens; \
                             shorten it or pass the option \"truncate\": true",
                            self.max_seq_length
                        ),
                    ));
                }
                vec![Row::of(&encoding)]
            }
        };
        Ok((rows, options))
    }

    /// The logits of every row, in order, in passes of similar length.
    fn logits(&self, rows: &[Row]) -> Result<Vec<Vec<f32>>, ExecError> {
        let lens: Vec<usize> = rows.iter().map(Row::len).collect();
        crate::models::kinds::length_groups::run_passes(rows, &lens, &self.pools, |part| {
            let (hidden, mask) = self.encoder.hidden(part, &self.device)?;
            let logits = self.encoder.logits(&hidden, &mask)?;
            Ok(logits.to_device(&Device::Cpu)?.to_vec2()?)
        })
    }

    fn answer(&self, request: &Request, logits: &[Vec<f32>]) -> Answer {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        let value = match self.task {
            Task::Rerank => {
                let mut scored: Vec<(usize, f32)> = logits
                    .iter()
                    .enumerate()
                    .map(|(i, l)| (i, if request.raw { l[0] } else { sigmoid(l[0]) }))
                    .collect();
                scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                if request.top_n > 0 {
                    scored.truncate(request.top_n);
                }
                json!(
                    scored
                        .into_iter()
                        .map(|(i, s)| json!({"index": i, "score": s}))
                        .collect::<Vec<_>>()
                )
            }
            Task::Classify => {
                let l = &logits[0];
                let scores: Vec<f32> = if request.raw {
                    l.clone()
                } else if self.multi_label {
                    l.iter().map(|x| sigmoid(*x)).collect()
                } else {
                    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let exp: Vec<f32> = l.iter().map(|x| (x - max).exp()).collect();
                    let sum: f32 = exp.iter().sum();
                    exp.iter().map(|e| e / sum).collect()
                };
                let mut ranked: Vec<(usize, f32)> = scores.iter().copied().enumerate().collect();
                ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                json!({
                    "label": self.labels[ranked[0].0],
                    "scores": ranked
                        .iter()
                        .map(|(i, s)| json!({"label": self.labels[*i], "score": s}))
                        .collect::<Vec<_>>(),
                })
            }
        };
        Answer::Output(Output::Json(value.to_string()))
    }
}

/// A rerank model has one label, a classify model two or more.
fn check_labels(labels: &[String], task: Task) -> Result<(), String> {
    match task {
        Task::Rerank if labels.len() > 1 => Err(format!(
            "a rerank model scores with one label; this one has {} ({}): serve it as `classify`",
            labels.len(),
            labels.join(", ")
        )),
        Task::Classify if labels.len() < 2 => Err(
            "a classify model needs id2label with two labels or more in config.json; one label \
             is a relevance score: serve it as `rerank`"
                .into(),
        ),
        _ => Ok(()),
    }
}

/// `sentence_bert_config.json`'s `max_seq_length`, where the directory has one.
fn sentence_max(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("sentence_bert_config.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["max_seq_length"]
        .as_u64()
        .map(|n| n as usize)
}

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Task::Rerank => "rerank",
            Task::Classify => "classify",
        }
    }
}

impl Model for Scorer {
    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError> {
        reloaded(Scorer::load(&self.dir, device, self.task))
    }

    fn execute(&self, inputs: &[Input], limits: &ExecLimits) -> Result<Vec<Answer>, ExecError> {
        batch::run(
            inputs,
            |index, input| self.encode(index, input),
            |encoded, _| {
                let mut rows: Vec<Row> = Vec::new();
                let mut requests = Vec::with_capacity(encoded.len());
                for (own, options) in encoded {
                    let start = rows.len();
                    rows.extend(own);
                    requests.push(Request {
                        rows: start..rows.len(),
                        top_n: options.integer("top_n") as usize,
                        raw: options.flag("raw_scores"),
                    });
                }
                let len = rows.iter().map(Row::len).max().unwrap_or(0);
                let shape = &self.encoder.shape;
                let activations = (rows.len()
                    * len
                    * (shape.num_attention_heads * len
                        + shape.hidden_size * 6
                        + shape.intermediate_size)
                    * 4) as u64;
                limits.check(self.bytes, activations, rows.len())?;
                let logits = self.logits(&rows)?;
                Ok(requests
                    .iter()
                    .map(|request| self.answer(request, &logits[request.rows.clone()]))
                    .collect())
            },
        )
    }
}
