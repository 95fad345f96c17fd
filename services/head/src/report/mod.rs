//! `nomad report RUN_ID`: one self-contained HTML file of a run's plots (rollout durations,
//! rewards, tool latency, batch sizes, queue lengths, memory) and its slowest rollouts'
//! waterfalls, from the run directory's files. `nomad up --demo` writes one.

mod about;
mod data;
mod html;
mod summary;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::Value;

use crate::traces;

#[derive(clap::Args)]
pub struct ReportArgs {
    /// The run id; `latest` is the newest run under runs/.
    pub run_id: String,
    /// The run directory (default: <runs dir>/<RUN_ID>); with `latest`, its name is the run id.
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Where the run directories are.
    #[arg(long, default_value = "runs", conflicts_with = "from")]
    pub runs_dir: PathBuf,
    /// Where to write the report (default: report.html in the run directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Waterfalls of this many of the slowest rollouts.
    #[arg(long, default_value_t = 3)]
    pub waterfalls: usize,
}

/// The run's spans, and the metric points the report plots, reading each telemetry file once.
fn telemetry(dir: &Path) -> anyhow::Result<(Vec<traces::Span>, Vec<Value>)> {
    let (mut spans, mut points) = (Vec::new(), Vec::new());
    for file in traces::telemetry_files(dir)? {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        spans.extend(nomad_telemetry::records::from_console(&text).0);
        // Only memory points are plotted from metrics: skip the rest without parsing it.
        points.extend(
            text.lines()
                .filter(|l| l.contains("\"nomad.server.memory.usage\""))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|v| v["signal"] == "metric"),
        );
    }
    Ok((spans, points))
}

/// Writes the report of run `run_id` from `dir` to `out`.
pub fn write(dir: &Path, run_id: &str, out: &Path, waterfalls: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        dir.is_dir(),
        "run directory {} does not exist",
        dir.display()
    );
    let results = crate::rollouts::read_jsonl(&dir.join("results.jsonl"));
    let (spans, points) = telemetry(dir)?;
    let figures = data::figures(&results, &spans, &points);
    let about = about::about(dir, &spans);
    let counted = summary::in_results(&results);
    let rollouts = traces::rollouts(spans, run_id);
    let slowest: Vec<String> = rollouts
        .iter()
        .filter(|r| counted(&r.root))
        .take(waterfalls)
        .map(traces::waterfall)
        .collect();
    let page = html::render(run_id, &figures, &slowest, &about)?;
    std::fs::write(out, page).with_context(|| format!("writing {}", out.display()))
}

pub async fn report(args: ReportArgs) -> anyhow::Result<bool> {
    let (run_id, dir) = crate::run_id::resolve(&args.runs_dir, args.from.as_deref(), &args.run_id)?;
    let out = args.out.unwrap_or_else(|| dir.join("report.html"));
    write(&dir, &run_id, &out, args.waterfalls)?;
    println!("{}", out.display());
    Ok(true)
}
