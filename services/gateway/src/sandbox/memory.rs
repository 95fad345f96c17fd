//! What runs hold in memory. The gateway sums the proportional set size (PSS: shared pages
//! divided among their sharers) of every process of a run a few times a second, for two ends:
//! - a run as a whole, where no cgroup bounds it: `RLIMIT_AS` bounds each process of a run, not
//!   their sum (64 processes of 1 GiB each), so a run whose sum passes its limit is ended;
//! - all runs together: admission counts each run against the gateway's budget for runs (the
//!   [`Ledger`]), so a run that waits on a tool costs what it holds, not a slot sized for the
//!   worst case.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// How often a run's memory is summed: what a run can allocate beyond its budget before it is
/// stopped is what it allocates in this long (each process still within `RLIMIT_AS`).
pub const INTERVAL: Duration = Duration::from_millis(200);

/// Processes of one run the walk visits at most (the run's `pids` rlimit is far lower).
const MAX_PROCESSES: usize = 4096;

/// What a run counts for from its admission until its first sample: about what a Python run
/// that waits on a tool holds (measured: BENCHMARKS.md, "Rollouts at scale").
pub const RUN_RESERVE: u64 = 32 << 20;

/// The memory all runs hold together, against the gateway's budget for them.
#[derive(Debug)]
pub struct Ledger {
    budget: u64,
    held: AtomicU64,
    freed: Notify,
}

impl Ledger {
    pub fn new(budget: u64) -> Arc<Self> {
        Arc::new(Self {
            budget,
            held: AtomicU64::new(0),
            freed: Notify::new(),
        })
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes the running runs hold (their last samples, or their reserve before one).
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// A new run's share, counted at [`RUN_RESERVE`], when that fits in the budget now.
    pub fn try_admit(self: &Arc<Self>) -> Option<Share> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held + RUN_RESERVE <= self.budget).then_some(held + RUN_RESERVE)
            })
            .ok()?;
        Some(Share {
            ledger: self.clone(),
            counted: RUN_RESERVE,
        })
    }

    /// Completes when a run's memory may have been freed (a run ended or shrank), or after
    /// `at_most`.
    pub async fn freed(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.freed.notified()).await;
    }
}

/// One run's part of the [`Ledger`]: its last sample, given back when the run ends.
#[derive(Debug)]
pub struct Share {
    ledger: Arc<Ledger>,
    counted: u64,
}

impl Share {
    fn set(&mut self, bytes: u64) {
        let ledger = &self.ledger;
        if bytes >= self.counted {
            ledger
                .held
                .fetch_add(bytes - self.counted, Ordering::AcqRel);
        } else {
            ledger
                .held
                .fetch_sub(self.counted - bytes, Ordering::AcqRel);
            ledger.freed.notify_waiters();
        }
        self.counted = bytes;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.ledger.held.fetch_sub(self.counted, Ordering::AcqRel);
        self.ledger.freed.notify_waiters();
    }
}

/// Samples what the processes under `root` (it and its descendants) hold into `share`, and
/// completes when that passes `limit` (where one is given), with what they held then.
pub async fn watch(root: u32, limit: Option<u64>, share: &mut Share) -> u64 {
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        // smaps_rollup walks the process's page tables: off the event loop.
        let held = tokio::task::spawn_blocking(move || held_by_tree(Path::new("/proc"), root))
            .await
            .unwrap_or(0);
        share.set(held);
        if limit.is_some_and(|limit| held > limit) {
            return held;
        }
    }
}

/// Bytes held by `root` and its descendants, as `proc` (a procfs mount) shows them.
fn held_by_tree(proc: &Path, root: u32) -> u64 {
    let mut pending = vec![root];
    let mut seen = 0;
    let mut held = 0;
    while let Some(pid) = pending.pop() {
        seen += 1;
        if seen > MAX_PROCESSES {
            break;
        }
        let dir = proc.join(pid.to_string());
        held += held_by(&dir);
        pending.extend(children(&dir));
    }
    held
}

/// One process's PSS in bytes (its RSS where smaps_rollup cannot be read); 0 when it is gone.
fn held_by(dir: &Path) -> u64 {
    if let Ok(rollup) = std::fs::read_to_string(dir.join("smaps_rollup"))
        && let Some(kib) = kib_field(&rollup, "Pss:")
    {
        return kib * 1024;
    }
    // statm: sizes in pages; the second is resident.
    let page = 4096;
    std::fs::read_to_string(dir.join("statm"))
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

/// `field`'s value in a `/proc` file of `Name:   123 kB` lines.
fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The children of every thread of the process at `dir`.
fn children(dir: &Path) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(dir.join("task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|pid| pid.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_of_processes_is_summed_from_its_procfs_files() {
        let proc = std::env::temp_dir().join(format!("nomad-proc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&proc);
        let process = |pid: u32, rollup: Option<&str>, statm: &str, children: &str| {
            let task = proc.join(format!("{pid}/task/{pid}"));
            std::fs::create_dir_all(&task).unwrap();
            if let Some(rollup) = rollup {
                std::fs::write(proc.join(format!("{pid}/smaps_rollup")), rollup).unwrap();
            }
            std::fs::write(proc.join(format!("{pid}/statm")), statm).unwrap();
            std::fs::write(task.join("children"), children).unwrap();
        };
        process(10, Some("Rss:  900 kB\nPss:  100 kB\n"), "1 1 1", "11 12 ");
        process(11, Some("Pss:  200 kB\n"), "1 1 1", "13");
        // No smaps_rollup: its resident pages instead.
        process(12, None, "50 3 1 1 0 1 0", "");
        process(13, Some("Pss:  4 kB\n"), "1 1 1", "");
        process(99, Some("Pss:  1000 kB\n"), "1 1 1", "");
        assert_eq!(
            held_by_tree(&proc, 10),
            (100 + 200 + 4) * 1024 + 3 * 4096,
            "the tree under 10, and nothing beside it"
        );
        assert_eq!(
            held_by_tree(&proc, 12345),
            0,
            "a process that is gone holds nothing"
        );
        std::fs::remove_dir_all(&proc).unwrap();
    }

    #[tokio::test]
    async fn this_process_is_seen_over_a_small_limit_and_not_under_a_large_one() {
        let me = std::process::id();
        let ledger = Ledger::new(1 << 40);
        let mut share = ledger.try_admit().unwrap();
        let held =
            tokio::time::timeout(Duration::from_secs(5), watch(me, Some(1 << 20), &mut share))
                .await
                .expect("a test process holds more than 1 MiB");
        assert!(held > 1 << 20, "{held}");
        assert_eq!(ledger.held(), held, "the sample replaced the reserve");
        let never = tokio::time::timeout(INTERVAL * 3, watch(me, Some(u64::MAX / 2), &mut share));
        assert!(never.await.is_err(), "under its limit, a run is left alone");
        drop(share);
        assert_eq!(ledger.held(), 0, "an ended run holds nothing");
    }

    #[test]
    fn admission_counts_each_run_until_the_budget_is_full() {
        let ledger = Ledger::new(3 * RUN_RESERVE + RUN_RESERVE / 2);
        let mut shares: Vec<Share> = (0..3).map(|_| ledger.try_admit().unwrap()).collect();
        assert!(
            ledger.try_admit().is_none(),
            "a fourth reserve does not fit"
        );
        // A run found to hold less than its reserve makes room for another.
        shares[0].set(RUN_RESERVE / 4);
        let fourth = ledger.try_admit().expect("room after a sample");
        shares[1].set(RUN_RESERVE * 2);
        assert_eq!(ledger.held(), RUN_RESERVE / 4 + RUN_RESERVE * 4);
        drop(fourth);
        drop(shares);
        assert_eq!(ledger.held(), 0);
    }
}
