//! Sentence embeddings (`embed`): an encoder of one of the families `encoder` runs, its token
//! vectors pooled as the model's own sentence-transformers files say (cls, mean, max,
//! mean-sqrt-len, last token; several concatenated), normalised when its modules end with
//! `Normalize`, with its named prompts and its `max_seq_length` (`formats/sentence.rs`).
//!
//! The model directory holds `config.json`, `model.safetensors` and `tokenizer.json`, and the
//! sentence-transformers files where it has them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp as _, Tensor};
use tokenizers::{Tokenizer, TruncationParams};

use crate::models::batch::{self, invalid};
use crate::models::families::encoder::Encoder;
use crate::models::formats::row::Row;
use crate::models::formats::sentence::{Pooling, SentenceConfig};
use crate::models::kinds::length_groups::Pools;
use crate::models::kinds::options::Options;
use crate::models::model::{Answer, ExecError, ExecLimits, Input, LoadError, Model, reloaded};
use nomad_proto::kinds;

pub struct Embedder {
    dir: PathBuf,
    encoder: Encoder,
    sentence: SentenceConfig,
    tokenizer: Tokenizer,
    max_seq_length: usize,
    bytes: u64,
    device: Device,
    /// One single-threaded pool per core, for splitting batches (CPU only).
    pools: Pools,
}

fn load_error(dir: &Path, reason: impl std::fmt::Display) -> LoadError {
    LoadError::Invalid {
        path: dir.to_owned(),
        reason: reason.to_string(),
    }
}

/// A tokenizer from `dir`'s `tokenizer.json`, padding left to the caller and truncating at
/// `max_length` (a longer input is refused unless asked).
pub(crate) fn tokenizer(dir: &Path, max_length: usize) -> Result<Tokenizer, LoadError> {
    let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| load_error(dir, format!("tokenizer.json: {e}")))?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length,
            ..Default::default()
        }))
        .map_err(|e| load_error(dir, format!("tokenizer truncation: {e}")))?;
    Ok(tokenizer)
}

/// The bytes of `dir`'s weights.
pub(crate) fn weight_bytes(dir: &Path) -> Result<u64, LoadError> {
    Ok(std::fs::metadata(dir.join("model.safetensors"))
        .map_err(|e| {
            load_error(
                dir,
                format!("model.safetensors: {e} (fetch the models with scripts/fetch-models)"),
            )
        })?
        .len())
}

/// One single-threaded pool per core on a CPU (none on an accelerator).
pub(crate) fn pools(dir: &Path, device: &Device, name: &str) -> Result<Pools, LoadError> {
    let cores = if device.is_cpu() {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        0
    };
    Pools::new(cores, name).map_err(|e| load_error(dir, format!("starting compute threads: {e}")))
}

/// The sentence vectors `[n, hidden * modes]` of `hidden` (`[n, len, hidden]`) over the real
/// tokens of `mask`, one pooling after another, concatenated as sentence-transformers does.
fn pool(
    hidden: &Tensor,
    mask: &Tensor,
    lens: &[usize],
    modes: &[Pooling],
) -> candle_core::Result<Tensor> {
    let maskf = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let counts = maskf.sum(1)?;
    let mut parts = Vec::with_capacity(modes.len());
    for mode in modes {
        parts.push(match mode {
            Pooling::Cls => hidden.i((.., 0, ..))?.contiguous()?,
            Pooling::Mean => hidden
                .broadcast_mul(&maskf)?
                .sum(1)?
                .broadcast_div(&counts)?,
            Pooling::MeanSqrtLen => hidden
                .broadcast_mul(&maskf)?
                .sum(1)?
                .broadcast_div(&counts.sqrt()?)?,
            Pooling::Max => {
                // Padding never wins: -1e9 where the mask is 0, as sentence-transformers does.
                let floor = ((maskf.ones_like()? - &maskf)? * -1e9)?;
                hidden.broadcast_add(&floor)?.max(1)?
            }
            Pooling::LastToken => {
                let rows: Vec<Tensor> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, len)| hidden.i((i, len.saturating_sub(1), ..)))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::stack(&rows, 0)?
            }
        });
    }
    Tensor::cat(&parts, 1)
}

impl Embedder {
    /// What loading `dir` would refuse, found from its config files alone.
    pub fn check(dir: &Path) -> Result<(), String> {
        SentenceConfig::read(dir)?;
        crate::models::families::encoder::Shape::read(dir).map(|_| ())
    }

    pub fn load(dir: &Path, device: &Device) -> Result<Self, LoadError> {
        let sentence = SentenceConfig::read(dir).map_err(|e| load_error(dir, e))?;
        let encoder = Encoder::load(dir, device, false).map_err(|e| load_error(dir, e))?;
        let max_seq_length = sentence
            .max_seq_length
            .unwrap_or(encoder.shape.max_tokens())
            .min(encoder.shape.max_tokens());
        let tokenizer = tokenizer(dir, max_seq_length)?;
        let bytes = weight_bytes(dir)?;
        let pools = pools(dir, device, "embed")?;
        tracing::info!(
            model = %dir.display(),
            family = encoder.family,
            dimensions = encoder.shape.hidden_size * sentence.pooling.len(),
            max_seq_length,
            prompts = sentence.prompts.len(),
            "embedding model: {}{}",
            sentence.describe(),
            if sentence.from_files { "" } else { " (no modules.json: sentence-transformers' defaults)" }
        );
        Ok(Self {
            pools,
            dir: dir.to_owned(),
            encoder,
            sentence,
            tokenizer,
            max_seq_length,
            bytes,
            device: device.clone(),
        })
    }

    /// The tokens of request `index`, or why it cannot run.
    fn encode(&self, index: usize, input: &Input) -> Result<Row, Answer> {
        let text = batch::text(index, input, &kinds::EMBED)?;
        let options = Options::parse(index, &input.options, &kinds::EMBED)?;
        let truncate = options.flag("truncate");
        let prompt = self
            .sentence
            .prompt(options.text("prompt"))
            .map_err(|e| invalid(index, e))?;
        let mut text = match prompt {
            Some(prompt) => format!("{prompt}{text}"),
            None => text.to_owned(),
        };
        if self.sentence.do_lower_case {
            text = text.to_lowercase();
        }
        let encoding = self
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| invalid(index, format!("tokenizing: {e}")))?;
        if !encoding.get_overflowing().is_empty() && !truncate {
            let total = encoding.get_ids().len()
                + encoding
                    .get_overflowing()
                    .iter()
                    .map(|o| o.get_ids().len())
                    .sum::<usize>();
            return Err(invalid(
                index,
                format!(
                    "the text is about {total} tokens, more than this model's max_seq_length of {}; \
                     shorten it or pass the option \"truncate\": true",
                    self.max_seq_length
                ),
            ));
        }
        Ok(Row::of(&encoding))
    }

    /// Memory the encoder's activations need for `n` sequences of `len` tokens (attention scores
    /// dominate, plus a few hidden-size buffers per layer).
    fn activation_bytes(&self, n: usize, len: usize) -> u64 {
        let c = &self.encoder.shape;
        let scores = n * c.num_attention_heads * len * len;
        let hidden = n * len * (c.hidden_size * 6 + c.intermediate_size);
        ((scores + hidden) * 4) as u64
    }
    /// Runs a batch as forward passes of similar-length sequences (little padding), shared
    /// over one single-threaded pool per core on a CPU.
    fn forward_parallel(&self, rows: &[Row]) -> Result<Vec<Vec<f32>>, ExecError> {
        let lens: Vec<usize> = rows.iter().map(Row::len).collect();
        crate::models::kinds::length_groups::run_passes(rows, &lens, &self.pools, |part| {
            self.forward(part)
        })
    }

    fn forward(&self, rows: &[Row]) -> Result<Vec<Vec<f32>>, ExecError> {
        let (hidden, mask) = self.encoder.hidden(rows, &self.device)?;
        let lens: Vec<usize> = rows.iter().map(Row::len).collect();
        let mut pooled = pool(&hidden, &mask, &lens, &self.sentence.pooling)?;
        if self.sentence.normalize {
            let norm = pooled.sqr()?.sum_keepdim(1)?.sqrt()?;
            pooled = pooled.broadcast_div(&norm)?;
        }
        Ok(pooled.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
    }
}

impl Model for Embedder {
    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError> {
        reloaded(Embedder::load(&self.dir, device))
    }

    fn execute(&self, inputs: &[Input], limits: &ExecLimits) -> Result<Vec<Answer>, ExecError> {
        batch::run(
            inputs,
            |index, input| self.encode(index, input),
            |rows, _| {
                let len = rows.iter().map(Row::len).max().unwrap_or(0);
                limits.check(
                    self.bytes,
                    self.activation_bytes(rows.len(), len),
                    rows.len(),
                )?;
                let embeddings = self.forward_parallel(&rows)?;
                Ok(embeddings.into_iter().map(batch::vector).collect())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model::Value;
    use crate::models::testing::text_input as text;
    use serde::Deserialize as _;

    use crate::models::testing::vector_of as vector;

    fn refusal(r: &Answer) -> &str {
        match r {
            Answer::Invalid(m) => m,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn model() -> Embedder {
        Embedder::load(
            &crate::models::testing::test_models_dir().join("all-minilm-l6-v2"),
            &Device::Cpu,
        )
        .unwrap()
    }

    /// The largest difference between two vectors' components (of the same length).
    fn max_diff<T: Copy + Into<f64>>(a: &[f32], b: &[T]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - (*y).into()).abs())
            .fold(0.0, f64::max)
    }

    /// Parity with sentence-transformers (fixture made by scripts/reference/embeddings.py).
    #[test]
    fn embeddings_match_the_sentence_transformers_reference() {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/fixtures/embeddings.json")).unwrap();
        let model = model();
        let sentences = Vec::<&str>::deserialize(&fixture["sentences"]).unwrap();
        let inputs: Vec<Input> = sentences.iter().map(|s| text(s, "")).collect();
        // One batch, padded to the longest: padding must not change any embedding.
        let results = model.execute(&inputs, &ExecLimits::default()).unwrap();
        for (i, reference) in fixture["embeddings"].as_array().unwrap().iter().enumerate() {
            let reference = Vec::<f64>::deserialize(reference).unwrap();
            let diff = max_diff(&vector(&results[i]), &reference);
            assert!(
                diff <= 1e-5,
                "sentence {i} {:?}: max abs diff {diff:e}",
                sentences[i]
            );
        }
        let truncated = &fixture["truncated"];
        let got = model
            .execute(
                &[text(
                    truncated["text"].as_str().unwrap(),
                    r#"{"truncate": true}"#,
                )],
                &ExecLimits::default(),
            )
            .unwrap();
        let reference = Vec::<f64>::deserialize(&truncated["embedding"]).unwrap();
        let diff = max_diff(&vector(&got[0]), &reference);
        assert!(diff <= 1e-5, "truncated text: max abs diff {diff:e}");
    }

    #[test]
    fn embeddings_are_unit_length_and_the_same_alone_or_batched() {
        let model = model();
        let alone = vector(
            &model
                .execute(&[text("short", "")], &ExecLimits::default())
                .unwrap()[0],
        );
        let batched = model
            .execute(
                &[
                    text(
                        "a much longer sentence than the other one in this batch",
                        "",
                    ),
                    text("short", ""),
                ],
                &ExecLimits::default(),
            )
            .unwrap();
        let norm: f32 = alone.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        let diff = max_diff(&alone, &vector(&batched[1]));
        assert!(diff < 1e-5, "padding changed the embedding by {diff}");
    }

    #[test]
    fn a_batch_of_very_different_lengths_answers_each_as_alone_in_its_order() {
        let model = model();
        let long = "the quick brown fox jumps over the lazy dog ".repeat(12);
        let texts = [
            "tiny",
            long.as_str(),
            "a short one",
            "two words",
            long.as_str(),
        ];
        let inputs: Vec<Input> = texts.iter().map(|t| text(t, "")).collect();
        let batched = model.execute(&inputs, &ExecLimits::default()).unwrap();
        for (i, t) in texts.iter().enumerate() {
            let alone = model
                .execute(&[text(t, "")], &ExecLimits::default())
                .unwrap();
            let diff = max_diff(&vector(&alone[0]), &vector(&batched[i]));
            assert!(diff < 1e-5, "input {i} differs by {diff} in the batch");
        }
    }

    #[test]
    fn bad_inputs_are_refused_by_request_and_a_long_text_needs_truncate() {
        let model = model();
        let long = "word ".repeat(400);
        let tensor = Input {
            value: Value::Tensor {
                values: vec![1.0],
                shape: vec![1],
            },
            options: String::new(),
        };
        let results = model
            .execute(
                &[
                    text("fine", ""),
                    text("  ", ""),
                    tensor,
                    text(&long, ""),
                    text("x", r#"{"normalize": false}"#),
                    text("x", r#"{"truncate": "yes"}"#),
                ],
                &ExecLimits::default(),
            )
            .unwrap();
        vector(&results[0]);
        assert!(refusal(&results[1]).starts_with("request 1: empty text"));
        assert!(refusal(&results[2]).contains("got a tensor"));
        let long_refusal = refusal(&results[3]);
        assert!(
            long_refusal.starts_with("request 3:")
                && long_refusal.contains("max_seq_length of 256")
                && long_refusal.contains("\"truncate\": true"),
            "{long_refusal}"
        );
        assert!(refusal(&results[4]).contains("unknown option \"normalize\""));
        assert!(refusal(&results[5]).contains("true or false"));
    }

    #[test]
    fn a_batch_over_the_memory_budget_is_out_of_memory() {
        let model = model();
        let batch: Vec<Input> = (0..32)
            .map(|i| text(&format!("sentence number {i} {}", "pad ".repeat(40)), ""))
            .collect();
        let tight = ExecLimits {
            memory_budget: Some(model.bytes() + (4 << 20)),
        };
        assert!(matches!(
            model.execute(&batch, &tight),
            Err(ExecError::OutOfMemory(_))
        ));
        assert!(
            model.execute(&batch[..1], &tight).is_ok(),
            "a batch of one fits"
        );
    }

    /// A real accelerator out-of-memory error becomes the distinct OOM outcome. Needs a GPU:
    /// `NOMAD_TEST_DEVICE=cuda:0 cargo test --features cuda -- --ignored` (scripts/gpu-check.sh).
    #[test]
    #[ignore = "needs an accelerator (NOMAD_TEST_DEVICE)"]
    fn an_accelerator_allocation_failure_is_out_of_memory() {
        let device = crate::models::testing::test_device();
        assert!(!device.is_cpu(), "set NOMAD_TEST_DEVICE to an accelerator");
        let total = crate::device::memory_info(&device).map_or(1 << 40, |(_, t)| t);
        // More f32 elements than the device has bytes for.
        let error = Tensor::zeros(((total / 4 + 1) as usize,), DType::F32, &device).unwrap_err();
        let mapped = ExecError::from(error);
        assert!(matches!(mapped, ExecError::OutOfMemory(_)), "{mapped:?}");
    }

    /// Prints the driver's memory figures around loading the model (scripts/gpu-check.sh).
    #[test]
    #[ignore = "needs an accelerator (NOMAD_TEST_DEVICE)"]
    fn loading_the_model_shows_in_the_drivers_memory_figures() {
        let device = crate::models::testing::test_device();
        let (free_before, total) = crate::device::memory_info(&device).expect("memory figures");
        let model = model();
        let (free_after, _) = crate::device::memory_info(&device).unwrap();
        eprintln!(
            "device memory: total {total} B, in use before load {} B, after {} B (weights {} B)",
            total - free_before,
            total - free_after,
            model.bytes()
        );
        assert!(
            free_after < free_before,
            "loading the weights used no device memory"
        );
    }
}
