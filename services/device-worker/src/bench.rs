//! `nomad-device-worker bench`: throughput of the real models on this machine, one JSON object
//! per measurement (scripts/bench-models and scripts/bench-cross-encoders put them next to
//! PyTorch's).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::Device;

use crate::models::kinds::cross::{Scorer, Task};
use crate::models::kinds::embed::Embedder;
use crate::models::kinds::generate::Generator;
use crate::models::model::{ExecLimits, Input, Model, Value};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// `embed`, `generate`, `rerank` or `classify`.
    #[arg(long)]
    what: String,
    /// The model directory (rerank, classify).
    #[arg(long)]
    source: Option<PathBuf>,
    /// Directory holding the fetched models.
    #[arg(long, env = "NOMAD_MODELS_DIR", default_value = "models")]
    models: PathBuf,
    /// One sentence per line (embed).
    #[arg(long, default_value = "scripts/reference/bench_sentences.txt")]
    sentences: PathBuf,
    /// Batch sizes (embed, classify; rerank: documents per query).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Tokens to decode per run (generate).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Sequences decoded together, one step for all (generate).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rows: Vec<usize>,
    /// Which weights to time (generate).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "q4_1,q8_0")]
    weights: Vec<Weights>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Weights {
    /// Q4_1, as shipped.
    #[value(name = "q4_1")]
    Q4_1,
    /// Q8_0, re-quantized from Q4_1 at load.
    #[value(name = "q8_0")]
    Q8_0,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    nomad_config::seconds("--seconds", args.seconds).map_err(anyhow::Error::msg)?;
    if args.rows.contains(&0) || args.batches.contains(&0) {
        anyhow::bail!("--rows and --batches must be at least 1");
    }
    match args.what.as_str() {
        "embed" => embed(&args),
        "generate" => generate(&args),
        "rerank" => scores(&args, Task::Rerank),
        "classify" => scores(&args, Task::Classify),
        other => anyhow::bail!("unknown --what {other:?}: use embed, generate, rerank or classify"),
    }
}

/// A cross-encoder's throughput: `rerank` scores one query against `batch` sentences per call,
/// `classify` labels `batch` sentences per call; texts scored per second either way.
fn scores(args: &BenchArgs, task: Task) -> anyhow::Result<()> {
    let source = args
        .source
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("--what {} needs --source DIR", task.name()))?;
    let model = Scorer::load(source, &Device::Cpu, task)?;
    let sentences = sentences(args)?;
    let text = |value: &str, options: serde_json::Value| Input {
        value: Value::Text(value.to_owned()),
        options: options.to_string(),
    };
    for &batch in &args.batches {
        let calls: Vec<Vec<Input>> = sentences
            .chunks(batch)
            .filter(|c| c.len() == batch)
            .map(|chunk| match task {
                Task::Rerank => vec![text(
                    "Which of these sentences answers the question best?",
                    serde_json::json!({ "documents": chunk }),
                )],
                Task::Classify => chunk
                    .iter()
                    .map(|s| text(s, serde_json::json!({})))
                    .collect(),
            })
            .collect();
        let calls: Vec<&[Input]> = calls.iter().map(Vec::as_slice).collect();
        let rate = per_second(&model, &calls, batch, args.seconds)?;
        println!(
            "{}",
            serde_json::json!({
                "runtime": "candle",
                "what": task.name(),
                "batch": batch,
                "texts_per_second": rate,
            })
        );
    }
    Ok(())
}

/// Texts per second of `model` running `calls` (each `texts` texts) in turn for `seconds`,
/// after three calls of warm-up.
fn per_second(
    model: &dyn Model,
    calls: &[&[Input]],
    texts: usize,
    seconds: f64,
) -> anyhow::Result<f64> {
    anyhow::ensure!(!calls.is_empty(), "fewer sentences than a batch of {texts}");
    for call in calls.iter().take(3) {
        model.execute(call, &ExecLimits::default())?;
    }
    let (mut done, mut i, started) = (0, 0, Instant::now());
    while started.elapsed() < Duration::from_secs_f64(seconds) {
        model.execute(calls[i % calls.len()], &ExecLimits::default())?;
        done += texts;
        i += 1;
    }
    Ok(done as f64 / started.elapsed().as_secs_f64())
}

/// The benchmark's sentences, one a line.
fn sentences(args: &BenchArgs) -> anyhow::Result<Vec<String>> {
    let sentences: Vec<String> = std::fs::read_to_string(&args.sentences)?
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    anyhow::ensure!(
        !sentences.is_empty(),
        "{} has no sentences",
        args.sentences.display()
    );
    Ok(sentences)
}

fn embed(args: &BenchArgs) -> anyhow::Result<()> {
    let model = Embedder::load(&args.models.join("all-minilm-l6-v2"), &Device::Cpu)?;
    let sentences = sentences(args)?;
    let inputs: Vec<Input> = sentences
        .iter()
        .map(|s| Input {
            value: Value::Text(s.clone()),
            options: String::new(),
        })
        .collect();
    for &batch in &args.batches {
        let batches: Vec<&[Input]> = inputs.chunks(batch).filter(|c| c.len() == batch).collect();
        let rate = per_second(&model, &batches, batch, args.seconds)?;
        println!(
            "{}",
            serde_json::json!({
                "runtime": "candle",
                "batch": batch,
                "sentences_per_second": rate,
            })
        );
    }
    Ok(())
}

fn generate(args: &BenchArgs) -> anyhow::Result<()> {
    for q8 in args.weights.iter().map(|&w| w == Weights::Q8_0) {
        let loading = Instant::now();
        let model =
            Generator::load_with(&args.models.join("smollm2-135m-instruct"), &Device::Cpu, q8)?;
        let load = loading.elapsed();
        let prompt = model
            .encode(
                &model
                    .prompt(
                        "Write a short story about a robot who learns to paint.",
                        true,
                    )
                    .map_err(anyhow::Error::msg)?,
                true,
            )
            .map_err(anyhow::Error::msg)?;
        model.time_decode(&prompt, 1, 4)?; // warm-up
        for &rows in &args.rows {
            let (mut prompt_time, mut decode_time, mut sequences) =
                (Duration::ZERO, Duration::ZERO, 0);
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs_f64(args.seconds) || sequences == 0 {
                let (p, d) = model.time_decode(&prompt, rows, args.tokens)?;
                prompt_time += p;
                decode_time += d;
                sequences += rows;
            }
            println!(
                "{}",
                serde_json::json!({
                    "runtime": "candle",
                    "weights": if q8 { "Q8_0 (re-quantized from Q4_1 at load)" } else { "Q4_1 (as shipped)" },
                    "load_seconds": load.as_secs_f64(),
                    "weights_bytes": model.bytes(),
                    "prompt_tokens": prompt.len(),
                    "rows": rows,
                    "prompt_tokens_per_second": (prompt.len() * sequences) as f64 / prompt_time.as_secs_f64(),
                    "decode_tokens_per_second": (args.tokens * sequences) as f64 / decode_time.as_secs_f64(),
                })
            );
        }
    }
    Ok(())
}
