//! The sbatch script `nomad submit` writes: every choice in `#SBATCH` lines with a comment
//! saying why, then one command that runs the job's steps (`nomad slurm-job`). Pure text.

use std::fmt::Write as _;
use std::path::PathBuf;

/// What the job asks of Slurm and where its files are.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPlan {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub partition: Option<String>,
    pub time: Option<String>,
    pub account: Option<String>,
    /// Passed to sbatch as they are, after Nomad's own lines (so they win).
    pub sbatch_args: Vec<String>,
    /// Absolute; `<runs_dir>/<job id>/` is the run directory, on a filesystem every node sees.
    pub runs_dir: PathBuf,
    /// Where `nomad` and the service binaries are (absolute, seen by every node).
    pub bin_dir: PathBuf,
    /// The user's config (absolute); `None`: the run directory's `nomad.yaml` (the default).
    pub config: Option<PathBuf>,
    pub concurrency: usize,
    pub embed_tool: String,
}

/// Quotes `s` for bash (single quotes, each `'` closed and escaped).
pub fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,+@%".contains(c))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

pub fn render(plan: &JobPlan) -> String {
    let runs = plan.runs_dir.display().to_string();
    let bin = plan.bin_dir.display().to_string();
    let workers_per_node = plan.gpus_per_node.max(1);
    let mut s = String::new();
    let mut line = |text: String| {
        s.push_str(&text);
        s.push('\n');
    };
    line("#!/bin/bash".into());
    line(
        "# A Nomad run as one Slurm job, written by `nomad submit`. The run id is the job id;"
            .into(),
    );
    line("# everything the run keeps is in the run directory below.".into());
    line("#".into());
    line("#SBATCH --job-name=nomad".into());
    line(format!("#SBATCH --nodes={}", plan.nodes));
    line(format!(
        "# One task slot per device worker on each node ({}); the collector, scheduler, gateway \
         and driver share the first node's slots (their steps run with --overlap).",
        if plan.gpus_per_node > 0 {
            format!("one per GPU, {workers_per_node}")
        } else {
            "one CPU worker".into()
        }
    ));
    line(format!("#SBATCH --ntasks-per-node={workers_per_node}"));
    if plan.gpus_per_node > 0 {
        line("# Each worker step takes one of these GPUs (--gpus-per-task=1 sets CUDA_VISIBLE_DEVICES).".into());
        line(format!("#SBATCH --gpus-per-node={}", plan.gpus_per_node));
    }
    if let Some(p) = &plan.partition {
        line(format!("#SBATCH --partition={}", quote(p)));
    }
    if let Some(t) = &plan.time {
        line(
            "# The job's time limit: at its end Slurm sends SIGTERM and every step flushes.".into(),
        );
        line(format!("#SBATCH --time={}", quote(t)));
    }
    if let Some(a) = &plan.account {
        line(format!("#SBATCH --account={}", quote(a)));
    }
    line(
        "# The job's own output: each step's command line, the driver's progress, and the log"
            .into(),
    );
    line("# tail of any step that dies. Each step's log is <step>.log beside it.".into());
    line(format!(
        "#SBATCH --output={}",
        quote(&format!("{runs}/%j/job.out"))
    ));
    if !plan.sbatch_args.is_empty() {
        line("# Given with --sbatch-arg; later lines win over earlier ones.".into());
        for arg in &plan.sbatch_args {
            line(format!("#SBATCH {arg}"));
        }
    }
    line(String::new());
    line("set -euo pipefail".into());
    line(
        "# The run directory: nomad submit wrote the config, the tasks and the fleet's token"
            .into(),
    );
    line("# here before releasing the job. Every node must see it (a shared filesystem).".into());
    line(format!("run_dir={}/\"$SLURM_JOB_ID\"", quote(&runs)));
    line("# One credential for every hop of the fleet, readable by this user only.".into());
    line("NOMAD_AUTH_TOKEN=$(cat \"$run_dir/token\")".into());
    line("export NOMAD_AUTH_TOKEN".into());
    line("# The steps, in order, each an `srun --overlap` step printed below as it starts:".into());
    line(
        "#   1. nomad collect on the first node: OTLP in, $run_dir/otel/*.jsonl out; every".into(),
    );
    line(
        "#      process exports to it (OTEL_EXPORTER_OTLP_ENDPOINT, unless you set your own);"
            .into(),
    );
    line("#   2. nomad-scheduler and 3. nomad-gateway on the first node;".into());
    line(format!(
        "#   4. {} on every node, registering with the scheduler;",
        if plan.gpus_per_node > 0 {
            "one nomad-device-worker per GPU (--gpus-per-task=1)"
        } else {
            "one CPU nomad-device-worker"
        }
    ));
    line(
        "#   5. the rollout driver here, writing results.jsonl. When it ends, the steps stop in"
            .into(),
    );
    line(
        "#      reverse order with SIGTERM (each flushes its telemetry), the collector last."
            .into(),
    );
    line(
        "# A step that dies is named with its node and log tail; losing the scheduler, gateway"
            .into(),
    );
    line("# or collector fails the job, losing a worker does not while another one serves.".into());
    let mut command = format!(
        "exec {}/nomad slurm-job --run-dir \"$run_dir\" --bin-dir {} --gpus-per-node {} --concurrency {}",
        quote(&bin),
        quote(&bin),
        plan.gpus_per_node,
        plan.concurrency
    );
    let _ = write!(command, " --embed-tool {}", quote(&plan.embed_tool));
    if let Some(config) = &plan.config {
        let _ = write!(
            command,
            " --config {}",
            quote(&config.display().to_string())
        );
    }
    line(command);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> JobPlan {
        JobPlan {
            nodes: 2,
            gpus_per_node: 0,
            partition: Some("debug".into()),
            time: None,
            account: None,
            sbatch_args: vec!["--exclusive".into()],
            runs_dir: "/shared/my runs".into(),
            bin_dir: "/opt/nomad/bin".into(),
            config: None,
            concurrency: 8,
            embed_tool: "embed".into(),
        }
    }

    #[test]
    fn the_script_says_what_it_asks_for() {
        let text = render(&plan());
        assert!(text.starts_with("#!/bin/bash\n"));
        assert!(text.contains("\n#SBATCH --nodes=2\n"), "{text}");
        assert!(text.contains("\n#SBATCH --ntasks-per-node=1\n"));
        assert!(text.contains("\n#SBATCH --partition=debug\n"));
        assert!(!text.contains("--gpus-per-node="));
        assert!(!text.contains("--time="));
        // Paths with spaces are quoted; the user's arguments come after Nomad's.
        assert!(text.contains("#SBATCH --output='/shared/my runs/%j/job.out'"));
        assert!(text.find("--output").unwrap() < text.find("--exclusive").unwrap());
        assert!(text.contains("run_dir='/shared/my runs'/\"$SLURM_JOB_ID\""));
        assert!(text.contains("exec /opt/nomad/bin/nomad slurm-job --run-dir \"$run_dir\""));
    }

    #[test]
    fn gpus_give_one_worker_per_gpu() {
        let text = render(&JobPlan {
            gpus_per_node: 4,
            ..plan()
        });
        assert!(text.contains("\n#SBATCH --ntasks-per-node=4\n"));
        assert!(text.contains("\n#SBATCH --gpus-per-node=4\n"));
        assert!(text.contains("--gpus-per-node 4"));
    }

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("plain/path-1.0"), "plain/path-1.0");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
    }
}
