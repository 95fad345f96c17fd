//! `nomad report RUN_ID`: one self-contained HTML file of a run's plots (rollout durations,
//! rewards, tool latency, batch sizes, queue lengths, memory) and its slowest rollouts'
//! waterfalls, from the run directory's files. `nomad up --demo` writes one.

mod data;
mod html;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::Value;

use crate::traces;

#[derive(clap::Args)]
pub struct ReportArgs {
    /// The run id.
    pub run_id: String,
    /// The run directory (default: runs/<RUN_ID>).
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Where to write the report (default: report.html in the run directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Waterfalls of this many of the slowest rollouts.
    #[arg(long, default_value_t = 3)]
    pub waterfalls: usize,
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The metric points the report plots, from every `*.jsonl` of the run (and its `otel/`).
fn metric_points(dir: &Path) -> Vec<Value> {
    let files = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .chain(std::fs::read_dir(dir.join("otel")).into_iter().flatten())
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"));
    let mut points = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        // Only memory points are plotted from metrics: skip the rest without parsing it.
        points.extend(
            text.lines()
                .filter(|l| l.contains("\"nomad.server.memory.usage\""))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|v| v["signal"] == "metric"),
        );
    }
    points
}

/// Writes the report of run `run_id` from `dir` to `out`.
pub fn write(dir: &Path, run_id: &str, out: &Path, waterfalls: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        dir.is_dir(),
        "run directory {} does not exist",
        dir.display()
    );
    let results = jsonl(&dir.join("results.jsonl"));
    let spans = traces::load_dir(dir)?;
    let figures = data::figures(&results, &spans, &metric_points(dir));
    let rollouts = traces::rollouts(spans, run_id);
    let slowest: Vec<String> = rollouts
        .iter()
        .take(waterfalls)
        .map(traces::waterfall)
        .collect();
    let page = html::render(run_id, &figures, &slowest)?;
    std::fs::write(out, page).with_context(|| format!("writing {}", out.display()))
}

pub async fn report(args: ReportArgs) -> anyhow::Result<bool> {
    crate::run_id::check(&args.run_id)
        .map_err(|e| anyhow::anyhow!("run id {:?}: {e}", args.run_id))?;
    let dir = args
        .from
        .unwrap_or_else(|| Path::new("runs").join(&args.run_id));
    let out = args.out.unwrap_or_else(|| dir.join("report.html"));
    write(&dir, &args.run_id, &out, args.waterfalls)?;
    println!("{}", out.display());
    Ok(true)
}
