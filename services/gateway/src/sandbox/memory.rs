//! A run's memory as a whole where no cgroup bounds it. `RLIMIT_AS` bounds each process of a run,
//! not their sum (64 processes of 1 GiB each); so the gateway sums the proportional set size
//! (PSS: shared pages divided among their sharers) of every process of the run, a few times a
//! second, and the run ends when the sum passes its budget.

use std::path::Path;
use std::time::Duration;

/// How often a run's memory is summed: what a run can allocate beyond its budget before it is
/// stopped is what it allocates in this long (each process still within `RLIMIT_AS`).
pub const INTERVAL: Duration = Duration::from_millis(200);

/// Processes of one run the walk visits at most (the run's `pids` rlimit is far lower).
const MAX_PROCESSES: usize = 4096;

/// Completes when the processes under `root` (it and its descendants) hold more than `limit`
/// bytes, with what they held then; pending while they hold less.
pub async fn exceeded(root: u32, limit: u64) -> u64 {
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        // smaps_rollup walks the process's page tables: off the event loop.
        let held = tokio::task::spawn_blocking(move || held_by_tree(Path::new("/proc"), root))
            .await
            .unwrap_or(0);
        if held > limit {
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
    async fn this_process_is_seen_over_a_small_budget_and_not_under_a_large_one() {
        let me = std::process::id();
        let held = tokio::time::timeout(Duration::from_secs(5), exceeded(me, 1 << 20))
            .await
            .expect("a test process holds more than 1 MiB");
        assert!(held > 1 << 20, "{held}");
        let never = tokio::time::timeout(INTERVAL * 3, exceeded(me, u64::MAX / 2)).await;
        assert!(never.is_err(), "under its budget, a run is left alone");
    }
}
