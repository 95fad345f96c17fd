//! What runs hold in memory. The gateway sums the proportional set size (PSS: shared pages
//! divided among their sharers) of every process of a run, and what the run's own tmpfs holds
//! (its `/workspace`, `/tmp` and `/dev/shm`: memory too, mapped or not), a few times a second,
//! for two ends:
//! - a run as a whole, where no cgroup bounds it: `RLIMIT_AS` bounds each process of a run, not
//!   their sum (64 processes of 1 GiB each), so a run whose sum passes its limit is ended;
//! - all runs together: admission counts each run against the gateway's budget for runs (the
//!   [`Ledger`]), so a run that waits on a tool costs what it holds, not a slot sized for the
//!   worst case.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// How often a run's memory is summed: what a run can allocate beyond its budget before it is
/// stopped is what it allocates in this long (each process still within `RLIMIT_AS`).
pub const INTERVAL: Duration = Duration::from_millis(200);

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

/// Samples what the processes under `root` (it and its descendants) hold, and with `own_tmpfs`
/// what the tmpfs of `root`'s view holds, into `share`, and completes when that passes `limit`
/// (where one is given), with what they held then. (Memory no process maps and no file holds —
/// memfds, System V shared memory — is refused to runs by the seccomp filter.)
pub async fn watch(root: u32, own_tmpfs: bool, limit: Option<u64>, share: &mut Share) -> u64 {
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        // smaps_rollup walks the process's page tables: off the event loop.
        let held = tokio::task::spawn_blocking(move || {
            held_by_tree(root) + if own_tmpfs { held_by_tmpfs(root) } else { 0 }
        })
        .await
        .unwrap_or(0);
        share.set(held);
        if limit.is_some_and(|limit| held > limit) {
            return held;
        }
    }
}

/// Bytes held by `root` and its descendants: their PSS, or their RSS where a process's PSS
/// cannot be read; 0 when `root` is gone.
fn held_by_tree(root: u32) -> u64 {
    nomad_telemetry::process::tree_memory(root).map_or(0, |m| m.held)
}

/// Bytes in use on the tmpfs that holds `/tmp` in the mount namespace of `root` (a run's own,
/// which also holds its `/workspace` and `/dev/shm`); 0 when `root` is gone.
fn held_by_tmpfs(root: u32) -> u64 {
    nix::sys::statvfs::statvfs(format!("/proc/{root}/root/tmp").as_str()).map_or(0, |s| {
        s.blocks().saturating_sub(s.blocks_free()) * s.fragment_size()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn this_process_is_seen_over_a_small_limit_and_not_under_a_large_one() {
        let me = std::process::id();
        let ledger = Ledger::new(1 << 40);
        let mut share = ledger.try_admit().unwrap();
        let held = tokio::time::timeout(
            Duration::from_secs(5),
            watch(me, false, Some(1 << 20), &mut share),
        )
        .await
        .expect("a test process holds more than 1 MiB");
        assert!(held > 1 << 20, "{held}");
        assert_eq!(ledger.held(), held, "the sample replaced the reserve");
        let never = tokio::time::timeout(
            INTERVAL * 3,
            watch(me, false, Some(u64::MAX / 2), &mut share),
        );
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
