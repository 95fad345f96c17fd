//! Admission and the warm pool. A run is admitted when what all runs hold leaves room for it in
//! the gateway's memory budget for runs (see [`super::memory`]) and a slot is free: every
//! sandbox process, waiting or running, holds one of `max_concurrent` slots, so never more
//! Pythons run than that. A run takes a warm process when one is waiting, else starts one cold
//! in a free slot, else waits (at most `max_queued` runs wait, each until its deadline). The pool
//! refills in the background, only while no run is waiting, one process at a time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::memory::{Ledger, Share};

use super::cgroup::{Cgroups, RunLimits};
use super::init::Report;
use super::process::{Launch, Started};

/// Why a run did not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Rejected {
    #[error(
        "the sandbox is at capacity: {max_queued} runs already wait for one of its \
         {max_concurrent} slots (sandbox.max_queued, sandbox.max_concurrent)"
    )]
    QueueFull {
        max_queued: usize,
        max_concurrent: usize,
    },
    #[error(
        "no sandbox slot came free within {waited:.1} s: all {max_concurrent} are busy \
         (sandbox.max_concurrent)"
    )]
    NoSlot { waited: f64, max_concurrent: usize },
    #[error(
        "no room for another run within {waited:.1} s: the running runs hold {held_mib} MiB of \
         the {budget_mib} MiB they may hold together (sandbox.memory_budget_bytes)"
    )]
    NoMemory {
        waited: f64,
        held_mib: u64,
        budget_mib: u64,
    },
    #[error("could not start the sandbox: {0}")]
    Spawn(String),
}

impl Rejected {
    /// The `reason` attribute of the rejection counter.
    pub fn reason(&self) -> &'static str {
        self.into()
    }
}

/// A run's place in the queue, given up when dropped.
struct Queued<'a>(&'a Pool);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.counts.queued.fetch_sub(1, Ordering::AcqRel);
        // With nobody waiting, the pool may take free slots again.
        self.0.refill.notify_one();
    }
}

/// Counts for gauges, `Status` and tests.
#[derive(Debug, Default)]
pub struct Counts {
    pub running: AtomicUsize,
    pub queued: AtomicUsize,
    pub warm: AtomicUsize,
    pub warm_starts: AtomicU64,
    pub cold_starts: AtomicU64,
}

pub struct Pool {
    pub launch: Launch,
    /// The isolation every process must report.
    pub expected: Report,
    pub cgroups: Option<Cgroups>,
    pub run_limits: RunLimits,
    /// What all runs hold, against their budget.
    pub ledger: Arc<Ledger>,
    slots: Arc<Semaphore>,
    max_concurrent: usize,
    max_queued: usize,
    warm: usize,
    ready: Mutex<VecDeque<Started>>,
    refill: Notify,
    pub counts: Counts,
}

/// A running run's hold on its counters and its part of the memory budget.
pub struct Running<'a> {
    counts: &'a Counts,
    pub memory: Share,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.counts.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the pool admits: runs while their memory fits the ledger's budget, at most
/// `max_concurrent` processes at once, `max_queued` runs waiting, `warm` processes started ahead.
pub struct Admission {
    pub ledger: Arc<Ledger>,
    pub max_concurrent: usize,
    pub max_queued: usize,
    pub warm: usize,
}

impl Pool {
    pub fn new(
        launch: Launch,
        expected: Report,
        cgroups: Option<Cgroups>,
        run_limits: RunLimits,
        admission: Admission,
    ) -> Self {
        let Admission {
            ledger,
            max_concurrent,
            max_queued,
            warm,
        } = admission;
        Self {
            launch,
            expected,
            cgroups,
            run_limits,
            ledger,
            slots: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            max_queued,
            warm: warm.min(max_concurrent),
            ready: Mutex::new(VecDeque::new()),
            refill: Notify::new(),
            counts: Counts::default(),
        }
    }

    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent
    }

    fn spawn(&self, slot: OwnedSemaphorePermit, warm: bool) -> std::io::Result<Started> {
        self.launch
            .start(slot, self.cgroups.as_ref(), self.run_limits, warm)
    }

    /// A process for one run: a warm one, or a cold one in a free slot, or, after waiting up to
    /// `wait`, one in the slot that came free.
    pub async fn acquire(&self, wait: Duration) -> Result<(Started, Running<'_>), Rejected> {
        let deadline = Instant::now() + wait;
        let memory = match self.ledger.try_admit() {
            Some(share) => share,
            None => self.wait_for_memory(wait).await?,
        };
        let running = |memory| {
            self.counts.running.fetch_add(1, Ordering::Relaxed);
            Running {
                counts: &self.counts,
                memory,
            }
        };
        if let Some(process) = self.take_warm() {
            self.counts.warm_starts.fetch_add(1, Ordering::Relaxed);
            self.refill.notify_one();
            return Ok((process, running(memory)));
        }
        let slot = match self.slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                self.wait_for_slot(deadline.saturating_duration_since(Instant::now()))
                    .await?
            }
        };
        self.counts.cold_starts.fetch_add(1, Ordering::Relaxed);
        let mut process = self
            .spawn(slot, false)
            .map_err(|e| Rejected::Spawn(e.to_string()))?;
        // A forked run is checked here, so that one from a fork server that can no longer start
        // a sound run is replaced by a spawned one (and the fork server let go) before any code.
        if let Some(server) = process.fork_server().cloned() {
            let left = deadline.saturating_duration_since(Instant::now());
            let checked =
                tokio::time::timeout(left, process.check(Some(&self.expected), false)).await;
            let why = match checked {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.describe()),
                Err(_) => Some("its report did not come before the run's deadline".into()),
            };
            if let Some(why) = why {
                if let Some(servers) = &self.launch.fork_server {
                    servers.unsound(&server, &why);
                }
                let slot = process.abandon().await;
                process = self
                    .spawn(slot, false)
                    .map_err(|e| Rejected::Spawn(e.to_string()))?;
            }
        }
        Ok((process, running(memory)))
    }

    /// Joins the queue (at most `max_queued` wait), or says it is full.
    fn enqueue(&self) -> Result<Queued<'_>, Rejected> {
        let queued = &self.counts.queued;
        if queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Rejected::QueueFull {
                max_queued: self.max_queued,
                max_concurrent: self.max_concurrent,
            });
        }
        Ok(Queued(self))
    }

    /// Waits, in the queue, until the runs' memory leaves room for one more.
    async fn wait_for_memory(&self, wait: Duration) -> Result<Share, Rejected> {
        let _queued = self.enqueue()?;
        let deadline = Instant::now() + wait;
        loop {
            if let Some(share) = self.ledger.try_admit() {
                return Ok(share);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Rejected::NoMemory {
                    waited: wait.as_secs_f64(),
                    held_mib: self.ledger.held() >> 20,
                    budget_mib: self.ledger.budget() >> 20,
                });
            }
            // A wake-up can be missed between the check and the wait: never wait long on one.
            self.ledger.freed(left.min(Duration::from_millis(50))).await;
        }
    }

    async fn wait_for_slot(&self, wait: Duration) -> Result<OwnedSemaphorePermit, Rejected> {
        let queued = self.enqueue()?;
        let slot = tokio::time::timeout(wait, self.slots.clone().acquire_owned()).await;
        drop(queued);
        match slot {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_)) => Err(Rejected::Spawn("the sandbox is shutting down".into())),
            Err(_) => Err(Rejected::NoSlot {
                waited: wait.as_secs_f64(),
                max_concurrent: self.max_concurrent,
            }),
        }
    }

    fn take_warm(&self) -> Option<Started> {
        let mut ready = self.ready.lock().expect("pool lock");
        while let Some(mut process) = ready.pop_front() {
            self.counts.warm.store(ready.len(), Ordering::Relaxed);
            if process.alive() {
                return Some(process);
            }
        }
        None
    }

    /// A run finished: its slot is free, so the pool may refill.
    pub fn finished(&self) {
        self.refill.notify_one();
    }

    /// Keeps `warm` processes waiting. Runs until the pool is dropped by every holder.
    pub async fn keep_warm(self: Arc<Self>) {
        let mut failures = 0u32;
        loop {
            let short = self.ready.lock().expect("pool lock").len() < self.warm;
            let idle_slot = short && self.counts.queued.load(Ordering::Acquire) == 0;
            let slot = idle_slot
                .then(|| self.slots.clone().try_acquire_owned().ok())
                .flatten();
            let Some(slot) = slot else {
                // Woken by a take, a finished run or an emptied queue; a timer covers a slot
                // freed by a process that died without a run.
                let _ = tokio::time::timeout(Duration::from_secs(1), self.refill.notified()).await;
                if Arc::strong_count(&self) == 1 {
                    return;
                }
                continue;
            };
            let started = match self.spawn(slot, true) {
                Ok(mut process) => {
                    let checked = tokio::time::timeout(
                        Duration::from_secs(30),
                        process.check(Some(&self.expected), true),
                    )
                    .await;
                    let failed = match checked {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(e.describe()),
                        Err(_) => Some("the warm runner was not ready within 30 s".into()),
                    };
                    match failed {
                        None => Ok(process),
                        Some(why) => {
                            if let (Some(server), Some(servers)) =
                                (process.fork_server(), &self.launch.fork_server)
                            {
                                servers.unsound(server, &why);
                            }
                            Err(why)
                        }
                    }
                }
                Err(e) => Err(e.to_string()),
            };
            match started {
                Ok(process) => {
                    failures = 0;
                    let mut ready = self.ready.lock().expect("pool lock");
                    ready.push_back(process);
                    self.counts.warm.store(ready.len(), Ordering::Relaxed);
                }
                Err(e) => {
                    // Runs still start cold; back off so a broken host is not hammered.
                    failures += 1;
                    if failures == 1 || failures.is_power_of_two() {
                        tracing::warn!(failures, "starting a warm sandbox runner failed: {e}");
                    }
                    let backoff = Duration::from_millis(100 << failures.min(6));
                    tokio::time::sleep(backoff).await;
                }
            }
        }
    }

    /// Keeps a fork server in use where one was: a zygote that died, or forked a run that did not
    /// come up sound, is replaced by a new one that passes the same self-test (runs start an
    /// interpreter each meanwhile). Runs until the pool is dropped by every holder.
    pub async fn keep_fork_server(self: Arc<Self>) {
        let Some(servers) = self.launch.fork_server.clone() else {
            return;
        };
        let spawning = Launch {
            fork_server: None,
            ..self.launch.clone()
        };
        let mut failures = 0u32;
        loop {
            // Woken when one is let go; a timer notices one that died between runs.
            let _ = tokio::time::timeout(Duration::from_secs(1), servers.lost.notified()).await;
            if Arc::strong_count(&self) == 1 {
                return;
            }
            if servers.current().is_some() {
                continue;
            }
            match super::self_test::start_fork_server(&spawning, &self.expected, self.run_limits)
                .await
            {
                Some(server) => {
                    failures = 0;
                    servers.install(server);
                    tracing::info!("the sandbox's fork server was replaced by a new one");
                }
                None => {
                    failures += 1;
                    tokio::time::sleep(Duration::from_secs(1 << failures.min(6))).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `reason`s docs/metrics.md lists for `nomad.gateway.sandbox.rejections`.
    #[test]
    fn rejections_are_named_as_the_metric_table_names_them() {
        let rejections = [
            Rejected::QueueFull {
                max_queued: 1,
                max_concurrent: 1,
            },
            Rejected::NoSlot {
                waited: 1.0,
                max_concurrent: 1,
            },
            Rejected::NoMemory {
                waited: 1.0,
                held_mib: 1,
                budget_mib: 1,
            },
            Rejected::Spawn("no".into()),
        ];
        let reasons: Vec<&str> = rejections.iter().map(Rejected::reason).collect();
        assert_eq!(reasons, ["queue_full", "no_slot", "no_memory", "spawn"]);
    }
}
