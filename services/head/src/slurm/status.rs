//! `nomad status <run id | job id>` and `nomad submit --wait`: a `nomad up` fleet's state from
//! its run directory (`fleets.rs`), or a job's state from Slurm, its steps, and the driver's
//! progress from the run directory.

use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cli;

#[derive(clap::Args)]
pub struct StatusArgs {
    /// A run id `nomad up` printed (or `latest`), or the job id `nomad submit` printed.
    pub job: String,
    /// Where the run directories are (`nomad up`'s, or a job's Slurm no longer knows).
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
}

/// The run directory: where Slurm writes the job's output, else `<runs_dir>/<job>`.
fn run_dir(job: &str, runs_dir: &Path) -> PathBuf {
    cli::job_fields(job)
        .ok()
        .and_then(|fields| {
            fields
                .into_iter()
                .find(|(k, _)| k == "StdOut")
                .and_then(|(_, out)| Path::new(&out).parent().map(Path::to_owned))
        })
        .unwrap_or_else(|| runs_dir.join(job))
}

fn driver_outcome(run_dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(run_dir.join("driver.json")).ok()?;
    serde_json::from_str(&text).ok()
}

pub async fn status(args: StatusArgs) -> anyhow::Result<bool> {
    if crate::fleets::status(&args.runs_dir, &args.job).is_some() {
        return Ok(true);
    }
    if args.job.is_empty() || !args.job.chars().all(|c| c.is_ascii_digit()) {
        let runs = crate::fleets::run_ids(&args.runs_dir);
        let there = match runs.is_empty() {
            true => "none there".to_owned(),
            false => format!("runs there: {}", runs.join(", ")),
        };
        anyhow::bail!(
            "{:?} is neither a fleet's run id under {} ({there}; --runs-dir to look elsewhere) \
             nor a Slurm job id",
            args.job,
            args.runs_dir.display()
        );
    }
    let state = match cli::queue_state(&args.job)? {
        Some(state) => state,
        None => match cli::run(
            "sacct",
            &["-n", "-P", "-X", "-j", &args.job, "-o", "State,ExitCode"],
        ) {
            Ok(out) if !out.trim().is_empty() => {
                out.lines().next().unwrap_or("").replace('|', " exit ")
            }
            _ => "not in the queue (finished, or unknown to this cluster)".into(),
        },
    };
    println!("job {}: {state}", args.job);
    for (id, name, nodes) in cli::steps(&args.job).unwrap_or_default() {
        println!("  step {id:<12} {name:<16} {nodes}");
    }
    let dir = run_dir(&args.job, &args.runs_dir);
    if !dir.is_dir() {
        println!("run directory {} is not here", dir.display());
        return Ok(true);
    }
    let total = crate::rollouts::read_jsonl(&dir.join("tasks.jsonl")).len();
    let results = crate::rollouts::read_jsonl(&dir.join("results.jsonl"));
    let failed = results.iter().filter(|r| r["status"] != "ok").count();
    println!(
        "rollouts: {} of {total} done, {failed} failed (run directory {})",
        results.len(),
        dir.display()
    );
    if let Some(outcome) = driver_outcome(&dir) {
        println!("driver: {}", outcome["status"].as_str().unwrap_or("?"));
        if let Some(error) = outcome["error"].as_str() {
            println!("  {error}");
        }
    }
    Ok(true)
}

/// Follows the job: its output as it grows, until it leaves the queue; then the driver's exit
/// status (a job that ended before its driver did failed).
pub async fn wait(job: &str, run_dir: &Path) -> anyhow::Result<bool> {
    let output = run_dir.join("job.out");
    let mut shown = 0u64;
    let mut last_state = String::new();
    let show_new = |shown: &mut u64| {
        if let Ok(mut file) = std::fs::File::open(&output)
            && file.seek(SeekFrom::Start(*shown)).is_ok()
        {
            let mut text = String::new();
            if let Ok(n) = file.read_to_string(&mut text) {
                *shown += n as u64;
                eprint!("{text}");
            }
        }
    };
    loop {
        let state = cli::queue_state(job)?;
        show_new(&mut shown);
        match state {
            None => break,
            Some(state) if state != last_state => {
                eprintln!("nomad submit: job {job} is {state}");
                last_state = state;
            }
            Some(_) => {}
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Slurm may close the output after the job leaves the queue.
    tokio::time::sleep(Duration::from_millis(500)).await;
    show_new(&mut shown);
    match driver_outcome(run_dir) {
        Some(outcome) => {
            let code = outcome["exit_code"].as_i64().unwrap_or(1);
            eprintln!(
                "nomad submit: job {job} ended; driver {} (exit {code})",
                outcome["status"].as_str().unwrap_or("?")
            );
            Ok(code == 0)
        }
        None => {
            eprintln!(
                "nomad submit: job {job} ended before its driver finished (cancelled, out of \
                 time, or it failed to start); see {}",
                output.display()
            );
            Ok(false)
        }
    }
}
