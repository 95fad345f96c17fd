//! `nomad ps` and `nomad down`: the fleets `nomad up` started under a runs directory, found by
//! their `fleet.json`, and stopped through their head (SIGTERM: it stops its servers in order and
//! flushes their telemetry, as Ctrl-C does).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

#[derive(clap::Args)]
pub struct PsArgs {
    /// Where `nomad up` made its run directories.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Stopped fleets too (their run directories stay until removed).
    #[arg(long, short)]
    pub all: bool,
    /// One JSON object per fleet and line, for scripts.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct DownArgs {
    /// The fleet's run id, or `latest` (default: the one fleet running there).
    pub run_id: Option<String>,
    /// Where `nomad up` made its run directories.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Seconds to wait for the fleet to stop.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
}

/// A fleet as its `fleet.json` describes it.
#[derive(Debug, Clone)]
struct Fleet {
    run_id: String,
    dir: PathBuf,
    head_pid: Option<u32>,
    mcp: String,
    running: bool,
    started: std::time::SystemTime,
}

impl Fleet {
    fn read(dir: &Path) -> Option<Self> {
        let path = dir.join("fleet.json");
        let text = std::fs::read_to_string(&path).ok()?;
        let json: Value = serde_json::from_str(&text).ok()?;
        let head_pid = json["head_pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok());
        Some(Self {
            run_id: json["run_id"].as_str()?.to_owned(),
            dir: dir.to_owned(),
            head_pid,
            mcp: json["gateway_mcp"].as_str().unwrap_or_default().to_owned(),
            running: head_pid.is_some_and(head_alive),
            started: std::fs::metadata(&path).and_then(|m| m.modified()).ok()?,
        })
    }
}

/// Whether `pid` is a live `nomad` head (not a zombie, not a process that reused the pid).
fn head_alive(pid: u32) -> bool {
    let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| !stat.contains(") Z "));
    let ours = std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
        cmdline
            .split(|b| *b == 0)
            .next()
            .is_some_and(|program| program.ends_with(b"nomad"))
    });
    alive && ours
}

/// Every fleet under `runs`, newest first.
fn fleets(runs: &Path) -> Vec<Fleet> {
    let mut found: Vec<Fleet> = std::fs::read_dir(runs)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| Fleet::read(&entry.path()))
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.started));
    found
}

/// The run ids of the fleets running under `runs`, newest first.
pub fn running(runs: &Path) -> Vec<String> {
    fleets(runs)
        .into_iter()
        .filter(|f| f.running)
        .map(|f| f.run_id)
        .collect()
}

/// `nomad status` of a fleet `nomad up` started under `runs` (by run id, or `latest`): whether
/// it runs, where to connect, its rollouts so far. `None` when there is no such fleet.
pub fn status(runs: &Path, id: &str) -> Option<()> {
    let all = fleets(runs);
    let fleet = match id {
        "latest" => all.first()?,
        id => all.iter().find(|f| f.run_id == id)?,
    };
    let state = match (fleet.running, fleet.head_pid) {
        (true, Some(pid)) => format!("running (head pid {pid})"),
        _ => "stopped".to_owned(),
    };
    println!("run {}: fleet {state}", fleet.run_id);
    if fleet.running && !fleet.mcp.is_empty() {
        println!(
            "  mcp: {} (token in {})",
            fleet.mcp,
            fleet.dir.join("fleet.json").display()
        );
    }
    println!("  run directory: {}", fleet.dir.display());
    if let Some(restarts) = crate::supervisor::restarts_line(&fleet.dir) {
        println!("  {restarts}");
    }
    let results = crate::rollouts::read_jsonl(&fleet.dir.join("results.jsonl"));
    if !results.is_empty() {
        let failed = results.iter().filter(|r| r["status"] != "ok").count();
        println!("rollouts: {} finished, {failed} failed", results.len());
    }
    Some(())
}

/// The run ids of every fleet under `runs`, newest first (for messages).
pub fn run_ids(runs: &Path) -> Vec<String> {
    fleets(runs).into_iter().map(|f| f.run_id).collect()
}

pub fn ps(args: PsArgs) -> anyhow::Result<bool> {
    let shown: Vec<Fleet> = fleets(&args.runs_dir)
        .into_iter()
        .filter(|f| args.all || f.running)
        .collect();
    if args.json {
        for f in &shown {
            let line = serde_json::json!({
                "run_id": f.run_id,
                "state": if f.running { "running" } else { "stopped" },
                "head_pid": f.head_pid,
                "mcp": f.mcp,
                "dir": std::path::absolute(&f.dir).unwrap_or_else(|_| f.dir.clone()),
            });
            println!("{line}");
        }
        return Ok(true);
    }
    if shown.is_empty() {
        let stopped = if args.all { "" } else { " running" };
        eprintln!(
            "no fleets{stopped} under {} (`nomad up` starts one; --runs-dir to look elsewhere)",
            args.runs_dir.display()
        );
        return Ok(true);
    }
    println!(
        "{:<28} {:<8} {:>8}  {:<34} DIR",
        "RUN", "STATE", "HEAD", "MCP"
    );
    for f in &shown {
        println!(
            "{:<28} {:<8} {:>8}  {:<34} {}",
            f.run_id,
            if f.running { "running" } else { "stopped" },
            f.head_pid.map_or("-".to_owned(), |p| p.to_string()),
            f.mcp,
            f.dir.display()
        );
    }
    Ok(true)
}

pub async fn down(args: DownArgs) -> anyhow::Result<bool> {
    let all = fleets(&args.runs_dir);
    let running: Vec<&Fleet> = all.iter().filter(|f| f.running).collect();
    let names = |fleets: &[&Fleet]| -> String {
        fleets
            .iter()
            .map(|f| f.run_id.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let fleet = match args.run_id.as_deref() {
        None => match running.as_slice() {
            [only] => *only,
            [] => anyhow::bail!(
                "no fleet is running under {} (`nomad ps --all` lists the stopped ones)",
                args.runs_dir.display()
            ),
            several => anyhow::bail!(
                "{} fleets are running under {}: {}; name the one to stop (`nomad down RUN_ID`)",
                several.len(),
                args.runs_dir.display(),
                names(several)
            ),
        },
        Some("latest") => running.first().copied().ok_or_else(|| {
            anyhow::anyhow!("no fleet is running under {}", args.runs_dir.display())
        })?,
        Some(id) => match all.iter().find(|f| f.run_id == id) {
            Some(f) if f.running => f,
            Some(f) => anyhow::bail!(
                "fleet {id} is not running (its run directory: {})",
                f.dir.display()
            ),
            None => anyhow::bail!(
                "no fleet {id:?} under {}; running: {}",
                args.runs_dir.display(),
                if running.is_empty() {
                    "none".to_owned()
                } else {
                    names(&running)
                }
            ),
        },
    };
    let pid = fleet.head_pid.expect("a running fleet has a head pid");
    eprintln!(
        "nomad down: stopping fleet {} (head pid {pid})",
        fleet.run_id
    );
    // SAFETY: kill(2) with a pid just checked to be a live nomad head of this fleet.
    if unsafe { libc::kill(pid as i32, libc::SIGTERM) } != 0 {
        anyhow::bail!(
            "could not signal fleet {}'s head (pid {pid}): {}",
            fleet.run_id,
            std::io::Error::last_os_error()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    while head_alive(pid) {
        if Instant::now() > deadline {
            anyhow::bail!(
                "fleet {} did not stop within {} s (head pid {pid}; its logs: {})",
                fleet.run_id,
                args.timeout,
                fleet.dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("stopped fleet {}", fleet.run_id);
    Ok(true)
}
