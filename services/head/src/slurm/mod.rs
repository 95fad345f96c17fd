//! Nomad on a Slurm cluster: `nomad submit` writes and submits a job that runs the whole fleet
//! across its nodes (`job.rs` is that job's body), `nomad status` reports on one.

mod cli;
pub mod job;
mod script;
pub mod status;

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use self::script::JobPlan;
use crate::up::{DEMO_AGENT, DEMO_TASKS, models, write_private};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("task_set").required(true).args(["demo", "tasks"])))]
pub struct SubmitArgs {
    /// Nodes for the job; every node runs device workers.
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    /// GPUs per node: one device worker per GPU. 0 runs one CPU worker per node.
    #[arg(long, default_value_t = 0)]
    pub gpus_per_node: u32,
    /// Slurm partition to submit to (sbatch --partition; default: the cluster's).
    #[arg(long)]
    pub partition: Option<String>,
    /// Time limit, in sbatch's format (e.g. 2:00:00).
    #[arg(long)]
    pub time: Option<String>,
    /// Slurm account to charge (sbatch --account; default: yours).
    #[arg(long)]
    pub account: Option<String>,
    /// Another sbatch option for the script, e.g. --sbatch-arg=--qos=high (repeatable).
    #[arg(long = "sbatch-arg", allow_hyphen_values = true)]
    pub sbatch_args: Vec<String>,
    /// Fleet config (default: the `embed` and `generate` tools on the default models).
    #[arg(long, env = "NOMAD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Run the bundled demo task set.
    #[arg(long)]
    pub demo: bool,
    /// Run this tasks JSONL file.
    #[arg(long)]
    pub tasks: Option<PathBuf>,
    /// Python script for tasks that give `inputs` (with --tasks).
    #[arg(long, requires = "tasks")]
    pub template: Option<PathBuf>,
    /// Rollouts in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    #[arg(long, default_value = "embed")]
    pub embed_tool: String,
    /// Run directories go here (runs/<job id>/), on a filesystem every node sees. Default:
    /// `runs` beside the tasks file (with --demo, in the current directory).
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
    /// Where the default models are (fetched here when missing); every node must see it.
    #[arg(long, env = "NOMAD_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Directory of the service binaries, seen by every node (default: the one holding `nomad`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Follow the job until it ends: its output as it comes, then exit with the driver's status.
    #[arg(long)]
    pub wait: bool,
}

const BINARIES: [&str; 4] = [
    "nomad",
    "nomad-scheduler",
    "nomad-gateway",
    "nomad-device-worker",
];

/// Everything that can be checked before anything is submitted.
fn check(args: &SubmitArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.nodes >= 1,
        "--nodes must be at least 1 (got {})",
        args.nodes
    );
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    for arg in &args.sbatch_args {
        anyhow::ensure!(
            arg.starts_with('-') && !arg.contains('\n'),
            "--sbatch-arg {arg:?} is not one sbatch option (like --qos=high)"
        );
    }
    if let Some(partition) = &args.partition {
        let known = cli::partitions()?;
        anyhow::ensure!(
            known.iter().any(|p| p == partition),
            "unknown partition {partition:?}: sinfo lists {}",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        );
    }
    Ok(())
}

fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {what} {}", path.display()))
}

pub async fn submit(args: SubmitArgs) -> anyhow::Result<bool> {
    check(&args)?;
    let bin_dir = std::path::absolute(crate::up::bin_dir(args.bin_dir.as_deref())?)?;
    for name in BINARIES {
        anyhow::ensure!(
            bin_dir.join(name).is_file(),
            "{} is missing; build every service (cargo build --release --workspace --bins) or \
             pass --bin-dir",
            bin_dir.join(name).display()
        );
    }
    let (tasks, template) = match &args.tasks {
        Some(path) => (
            read(path, "tasks file")?,
            args.template
                .as_deref()
                .map(|t| read(t, "template"))
                .transpose()?,
        ),
        None => (DEMO_TASKS.to_owned(), Some(DEMO_AGENT.to_owned())),
    };
    // A bad task file or config fails here, not on the cluster.
    crate::tasks::parse(&tasks, "the tasks", template.as_deref()).map_err(anyhow::Error::msg)?;
    let config = args
        .config
        .as_deref()
        .map(std::path::absolute)
        .transpose()?;
    nomad_config::ConfigFile::load(config.as_deref())?;
    let runs_dir = std::path::absolute(match (&args.runs_dir, &args.tasks) {
        (Some(dir), _) => dir.clone(),
        (None, Some(tasks)) => tasks.parent().unwrap_or(Path::new(".")).join("runs"),
        (None, None) => PathBuf::from("runs"),
    })?;
    let default_config = match &config {
        Some(_) => None,
        None => {
            let models = std::path::absolute(&args.models_dir)?;
            if !models::models_present(&models) {
                models::fetch_models(&models)?;
            }
            Some(models::default_config(&models))
        }
    };
    std::fs::create_dir_all(&runs_dir)
        .with_context(|| format!("creating {}", runs_dir.display()))?;

    let plan = JobPlan {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        partition: args.partition.clone(),
        time: args.time.clone(),
        account: args.account.clone(),
        sbatch_args: args.sbatch_args.clone(),
        runs_dir: runs_dir.clone(),
        bin_dir,
        config,
        concurrency: args.concurrency,
        embed_tool: args.embed_tool.clone(),
    };
    let staged = runs_dir.join(format!(".submit-{}.sbatch", std::process::id()));
    std::fs::write(&staged, script::render(&plan))
        .with_context(|| format!("writing {}", staged.display()))?;
    // Held until its run directory is ready: the directory is named by the job id.
    let submitted = cli::run(
        "sbatch",
        &["--parsable", "--hold", &staged.display().to_string()],
    )
    .and_then(|out| cli::parse_job_id(&out));
    let job = match submitted {
        Ok(job) => job,
        Err(e) => {
            let _ = std::fs::remove_file(&staged);
            return Err(e.context("submitting the job"));
        }
    };
    let run_dir = runs_dir.join(&job);
    let prepared = prepare(
        &run_dir,
        &staged,
        &tasks,
        template.as_deref(),
        default_config.as_deref(),
    )
    .and_then(|()| cli::run("scontrol", &["release", &job]).map(drop));
    if let Err(e) = prepared {
        let _ = cli::run("scancel", &[&job]);
        let _ = std::fs::remove_file(&staged);
        return Err(e.context(format!("preparing job {job} (cancelled)")));
    }
    println!("{job}");
    eprintln!(
        "nomad submit: job {job} submitted; run directory {}",
        run_dir.display()
    );
    eprintln!("  script   {}", run_dir.join("job.sbatch").display());
    eprintln!("  output   {}", run_dir.join("job.out").display());
    eprintln!("  follow   nomad status {job}");
    if args.wait {
        return status::wait(&job, &run_dir).await;
    }
    Ok(true)
}

/// The run directory as the job expects it: script, tasks, template, config and token.
fn prepare(
    run_dir: &Path,
    staged: &Path,
    tasks: &str,
    template: Option<&str>,
    config: Option<&str>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !run_dir.exists(),
        "run directory {} already exists",
        run_dir.display()
    );
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = run_dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    std::fs::rename(staged, run_dir.join("job.sbatch")).context("keeping the job script")?;
    write("tasks.jsonl", tasks)?;
    if let Some(t) = template {
        write("template.py", t)?;
    }
    if let Some(c) = config {
        write("nomad.yaml", c)?;
    }
    let token = run_dir.join("token");
    write_private(&token, nomad_rpc::auth::random_token().as_bytes())
        .with_context(|| format!("writing {}", token.display()))
}
