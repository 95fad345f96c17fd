use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::snapshot::SlotSnapshot;
use super::*;

const DELAY: Duration = Duration::from_millis(5);
const IDLE: Duration = Duration::from_secs(10);
const DISK_IDLE: Duration = Duration::from_secs(20);
const GC_IDLE: Duration = Duration::from_secs(30);

fn spec(name: &str, batch_size: u32, max_devices: u32, max_pending: u32) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        batch_size,
        max_devices,
        max_pending,
    }
}

/// A core with a fake clock.
struct Harness {
    core: Core,
    now: Instant,
}

impl Harness {
    fn new(tools: Vec<ToolSpec>, slots: u64) -> Self {
        let now = Instant::now();
        let timing = Timing {
            idle: IDLE,
            disk_idle: DISK_IDLE,
            gc_idle: GC_IDLE,
            max_batch_delay: DELAY,
        };
        let mut core = Core::new(tools, timing, now);
        for slot in 0..slots {
            core.worker_registered(slot, now);
        }
        Harness { core, now }
    }

    fn advance(&mut self, by: Duration) -> Vec<Action> {
        self.now += by;
        self.core.tick(self.now);
        self.core.take_actions()
    }

    fn submit(&mut self, tool: &str) -> RequestId {
        self.core.submit(tool, self.now).unwrap()
    }

    fn take(&mut self) -> Vec<Action> {
        self.core.take_actions()
    }

    /// Answers every Prepare in `actions` with success; returns the actions that follow.
    fn prepare_ok(&mut self, actions: &[Action]) -> Vec<Action> {
        let mut out = Vec::new();
        for a in actions {
            if let Action::Prepare { slot, tool, .. } = a {
                self.core.prepare_finished(*slot, *tool, Ok(()), self.now);
                out.extend(self.take());
            }
        }
        out
    }

    fn finish(&mut self, batch: BatchId, result: BatchResult) -> Vec<Action> {
        self.core.batch_finished(batch, result, self.now);
        self.take()
    }
}

fn prepares(actions: &[Action]) -> Vec<(SlotId, ToolId, Option<ToolId>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Prepare {
                slot,
                tool,
                offload,
                ..
            } => Some((*slot, *tool, *offload)),
            _ => None,
        })
        .collect()
}

fn dispatches(actions: &[Action]) -> Vec<(BatchId, SlotId, Vec<RequestId>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch {
                batch,
                slot,
                requests,
                ..
            } => Some((*batch, *slot, requests.clone())),
            _ => None,
        })
        .collect()
}

fn completions(actions: &[Action]) -> Vec<(RequestId, Outcome)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Complete { request, outcome } => Some((*request, outcome.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_request_is_loaded_placed_dispatched_and_completed() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8)], 1);
    let r = h.submit("a");
    let actions = h.take();
    assert_eq!(
        actions,
        vec![Action::Prepare {
            slot: 0,
            tool: 0,
            offload: None,
            load: Some(LoadKind::Resident)
        }]
    );
    let actions = h.prepare_ok(&actions);
    let d = dispatches(&actions);
    assert_eq!(d, vec![(0, 0, vec![r])]);
    let done = h.finish(0, BatchResult::Done(vec![None]));
    assert_eq!(completions(&done), vec![(r, Outcome::Ok)]);
    assert_eq!(h.core.open_requests(), 0);
}

#[test]
fn partial_batch_waits_for_max_batch_delay_and_a_full_one_does_not() {
    let mut h = Harness::new(vec![spec("a", 4, 1, 64)], 1);
    let first = h.submit("a");
    let actions = h.take();
    assert!(
        dispatches(&h.prepare_ok(&actions)).is_empty(),
        "one request of four waits"
    );
    assert_eq!(h.core.next_deadline(), Some(h.now + DELAY));
    let later = h.advance(DELAY);
    assert_eq!(dispatches(&later), vec![(0, 0, vec![first])]);
    h.finish(0, BatchResult::Done(vec![None]));

    let ids: Vec<_> = (0..5).map(|_| h.submit("a")).collect();
    let d = dispatches(&h.take());
    assert_eq!(
        d,
        vec![(1, 0, ids[..4].to_vec())],
        "a full batch goes at once, capped at 4"
    );
}

#[test]
fn batch_size_is_capped_by_max_pending() {
    let mut h = Harness::new(vec![spec("a", 8, 1, 3)], 1);
    let ids: Vec<_> = (0..3).map(|_| h.submit("a")).collect();
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    assert_eq!(d, vec![(0, 0, ids)]);
}

#[test]
fn fairness_leaves_a_free_slot_for_a_waiting_tool_that_holds_none() {
    let mut h = Harness::new(vec![spec("a", 1, 2, 64), spec("b", 1, 2, 64)], 2);
    h.submit("a");
    let actions = h.take();
    assert_eq!(prepares(&actions).len(), 1);
    let (a_slot, _, _) = prepares(&actions)[0];
    h.prepare_ok(&actions); // a's batch now executes on a_slot
    h.submit("b");
    h.submit("a");
    let actions = h.take();
    // One free slot, two tools want it: b (holding none) gets it, a does not take a second.
    let p = prepares(&actions);
    assert_eq!(p.len(), 1, "{actions:?}");
    assert_eq!(p[0].1, 1, "the free slot went to b");
    assert_ne!(p[0].0, a_slot);
}

#[test]
fn max_devices_caps_the_slots_a_tool_holds() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 64)], 3);
    for _ in 0..10 {
        h.submit("a");
    }
    assert_eq!(prepares(&h.take()).len(), 1);
    let mut h = Harness::new(vec![spec("a", 1, 2, 64)], 3);
    for _ in 0..10 {
        h.submit("a");
    }
    assert_eq!(prepares(&h.take()).len(), 2);
}

#[test]
fn placing_on_a_slot_holding_another_tool_offloads_it_first() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 1);
    h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    h.submit("b");
    let actions = h.take();
    assert_eq!(
        actions,
        vec![Action::Prepare {
            slot: 0,
            tool: 1,
            offload: Some(0),
            load: Some(LoadKind::Resident)
        }]
    );
    // Back to a: still resident on that worker, so no load from disk this time.
    let d = dispatches(&h.prepare_ok(&actions));
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    h.submit("a");
    assert_eq!(
        h.take(),
        vec![Action::Prepare {
            slot: 0,
            tool: 0,
            offload: Some(1),
            load: None
        }]
    );
}

#[test]
fn a_slot_whose_tool_still_has_work_waiting_is_not_taken() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 1);
    h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    h.submit("a");
    h.submit("b");
    let after = h.finish(d[0].0, BatchResult::Done(vec![None]));
    // a's queued request runs on its slot; b waits rather than evicting a.
    assert!(prepares(&after).is_empty(), "{after:?}");
    assert_eq!(dispatches(&after).len(), 1);
}

#[test]
fn a_second_device_for_the_same_tool_is_a_replica_load() {
    let mut h = Harness::new(vec![spec("a", 1, 2, 64)], 2);
    h.submit("a");
    h.submit("a");
    let actions = h.take();
    let loads: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Prepare { load, .. } => Some(*load),
            _ => None,
        })
        .collect();
    assert_eq!(
        loads,
        vec![Some(LoadKind::Resident), Some(LoadKind::Replica)]
    );
}

#[test]
fn idle_eviction_takes_the_least_recently_used_slot_first() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 2);
    h.submit("a");
    let a = dispatches(&{
        let actions = h.take();
        h.prepare_ok(&actions)
    });
    h.finish(a[0].0, BatchResult::Done(vec![None]));
    h.now += Duration::from_secs(3);
    h.submit("b");
    let b = dispatches(&{
        let actions = h.take();
        h.prepare_ok(&actions)
    });
    h.finish(b[0].0, BatchResult::Done(vec![None]));

    // a's slot has been idle 3 s longer: it goes first, b's 3 s later.
    let first = h.advance(IDLE - Duration::from_secs(3));
    assert_eq!(
        first,
        vec![Action::Evict {
            slot: a[0].1,
            tool: 0
        }]
    );
    h.core.slot_freed(a[0].1, h.now);
    assert!(h.advance(Duration::from_secs(2)).is_empty());
    let second = h.advance(Duration::from_secs(1));
    assert_eq!(
        second,
        vec![Action::Evict {
            slot: b[0].1,
            tool: 1
        }]
    );
}

#[test]
fn disk_unload_waits_for_no_slot_no_queue_and_nothing_in_flight() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8)], 1);
    h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    // In flight: nothing is unloaded however long it runs.
    assert!(
        h.advance(DISK_IDLE * 2)
            .iter()
            .all(|a| !matches!(a, Action::Unload { .. }))
    );
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    // Still on a device: evicted at IDLE, not unloaded.
    let evicted = h.advance(IDLE);
    assert_eq!(evicted, vec![Action::Evict { slot: 0, tool: 0 }]);
    h.core.slot_freed(0, h.now);
    // No slot now; unloaded once DISK_IDLE has passed since its last use.
    assert!(
        h.advance(DISK_IDLE - IDLE - Duration::from_millis(1))
            .is_empty()
    );
    assert_eq!(
        h.advance(Duration::from_millis(1)),
        vec![Action::Unload { slot: 0, tool: 0 }]
    );
    h.core.slot_freed(0, h.now);
    // Once unloaded, the next request loads from disk again.
    h.submit("a");
    let p = h.take();
    assert!(matches!(
        p[..],
        [Action::Prepare {
            load: Some(LoadKind::Resident),
            ..
        }]
    ));
}

#[test]
fn a_queued_request_blocks_disk_unload() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 1);
    h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    h.advance(IDLE);
    h.core.slot_freed(0, h.now);
    h.core.take_actions();
    // b takes the slot and keeps it busy; a queues behind it (1 slot only).
    h.submit("b");
    let actions = h.take();
    h.prepare_ok(&actions);
    h.submit("a");
    let later = h.advance(DISK_IDLE);
    assert!(
        later
            .iter()
            .all(|a| !matches!(a, Action::Unload { tool: 0, .. })),
        "{later:?}"
    );
}

#[test]
fn cache_clear_runs_once_after_whole_server_idleness() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8)], 2);
    assert!(
        h.advance(GC_IDLE).is_empty(),
        "nothing used, nothing to clear"
    );
    h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    let t = h.advance(GC_IDLE);
    // The eviction at IDLE came first and keeps its slot busy until freed.
    assert!(t.contains(&Action::Evict { slot: 0, tool: 0 }), "{t:?}");
    h.core.slot_freed(0, h.now);
    // Idle past DISK_IDLE too: the unload comes first and also keeps the slot busy.
    let unloaded = h.advance(Duration::from_millis(1));
    assert_eq!(unloaded, vec![Action::Unload { slot: 0, tool: 0 }]);
    h.core.slot_freed(0, h.now);
    let cleared = h.advance(Duration::from_millis(1));
    assert_eq!(
        cleared,
        vec![Action::ClearCache { slot: 0 }],
        "only the used slot"
    );
    h.core.slot_freed(0, h.now);
    assert!(
        h.advance(GC_IDLE * 3).is_empty(),
        "cleared once per idle period"
    );
}

#[test]
fn oom_halves_the_batch_8_4_2_1_and_requeues_at_the_front() {
    let mut h = Harness::new(vec![spec("a", 8, 1, 64)], 1);
    let ids: Vec<_> = (0..10).map(|_| h.submit("a")).collect();
    let actions = h.take();
    let mut d = dispatches(&h.prepare_ok(&actions));
    assert_eq!(d[0].2, ids[..8]);
    for (old, new) in [(8, 4), (4, 2), (2, 1)] {
        let after = h.finish(d[0].0, BatchResult::OutOfMemory("too big".into()));
        assert!(
            after.contains(&Action::OomReduced { tool: 0, old, new }),
            "{old}->{new}: {after:?}"
        );
        d = dispatches(&after);
        // The retried batch starts with the same first requests, in order.
        assert_eq!(d[0].2, ids[..new as usize], "{old}->{new}");
        assert!(completions(&after).is_empty());
    }
    // Out of memory with a batch of one: nothing left to halve, that request fails.
    let after = h.finish(d[0].0, BatchResult::OutOfMemory("too big".into()));
    assert_eq!(
        completions(&after),
        vec![(ids[0], Outcome::OutOfMemory("too big".into()))]
    );
    assert_eq!(
        dispatches(&after)[0].2,
        vec![ids[1]],
        "the rest continue one by one"
    );
    assert_eq!(h.core.snapshot().tools[0].batch_size, 1);
}

#[test]
fn cancelling_a_queued_request_removes_it_from_the_queue() {
    let mut h = Harness::new(vec![spec("a", 4, 1, 64)], 1);
    let a = h.submit("a");
    let b = h.submit("a");
    let actions = h.take();
    h.prepare_ok(&actions); // two of four: waiting for the delay
    h.core.cancel(a, h.now);
    assert_eq!(completions(&h.take()), vec![(a, Outcome::Cancelled)]);
    let d = dispatches(&h.advance(DELAY));
    assert_eq!(d[0].2, vec![b]);
    assert_eq!(h.core.snapshot().tools[0].queue_length, 0);
}

#[test]
fn cancelling_an_executing_request_answers_now_and_drops_its_result() {
    let mut h = Harness::new(vec![spec("a", 2, 1, 64)], 1);
    let a = h.submit("a");
    let b = h.submit("a");
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    h.core.cancel(a, h.now);
    assert_eq!(completions(&h.take()), vec![(a, Outcome::Cancelled)]);
    let done = h.finish(d[0].0, BatchResult::Done(vec![None, None]));
    assert_eq!(
        completions(&done),
        vec![(b, Outcome::Ok)],
        "a completes once only"
    );
    h.core.cancel(a, h.now);
    assert!(
        h.take().is_empty(),
        "cancelling a finished request does nothing"
    );
}

#[test]
fn each_rejection_reason() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 2)], 0);
    assert_eq!(h.core.submit("nope", h.now), Err(Rejection::UnknownTool));
    h.submit("a");
    h.submit("a");
    assert_eq!(h.core.submit("a", h.now), Err(Rejection::QueueFull));
    h.core.close();
    assert_eq!(h.core.submit("a", h.now), Err(Rejection::ManagerClosed));
    assert_eq!(
        [
            Rejection::UnknownTool,
            Rejection::QueueFull,
            Rejection::ManagerClosed
        ]
        .map(Rejection::reason),
        ["unknown_tool", "queue_full", "manager_closed"]
    );
    // Closing keeps what was accepted: both queued requests still get served.
    h.core.worker_registered(9, h.now);
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    assert_eq!(d.len(), 1);
}

#[test]
fn a_lost_workers_batch_is_requeued_once_then_failed() {
    let mut h = Harness::new(vec![spec("a", 2, 1, 64)], 1);
    let ids = [h.submit("a"), h.submit("a")];
    let actions = h.take();
    dispatches(&h.prepare_ok(&actions));
    h.core.worker_lost(0, "heartbeats stopped", h.now);
    assert!(completions(&h.take()).is_empty(), "requeued, not failed");
    h.core.worker_registered(1, h.now);
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    assert_eq!(d[0].2, ids, "requeued at the front, same order");
    h.core.worker_lost(1, "connection refused", h.now);
    let failed = completions(&h.take());
    assert_eq!(failed.len(), 2);
    assert!(
        failed
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Unavailable(m) if m.contains("lost twice")))
    );
}

#[test]
fn a_failed_prepare_fails_the_requests_waiting_for_that_tool() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 64)], 1);
    let r = h.submit("a");
    h.take();
    h.core
        .prepare_finished(0, 0, Err("model source /m: not found".into()), h.now);
    let done = completions(&h.take());
    assert!(
        matches!(&done[..], [(id, Outcome::Unavailable(m))] if *id == r && m.contains("not found"))
    );
}

#[test]
fn model_errors_fail_the_whole_batch_and_invalid_inputs_only_their_request() {
    let mut h = Harness::new(vec![spec("a", 2, 1, 64)], 1);
    let ids = [h.submit("a"), h.submit("a")];
    let actions = h.take();
    let d = dispatches(&h.prepare_ok(&actions));
    let done = h.finish(
        d[0].0,
        BatchResult::Done(vec![Some("request 0: bad".into()), None]),
    );
    assert_eq!(
        completions(&done),
        vec![
            (ids[0], Outcome::InvalidInput("request 0: bad".into())),
            (ids[1], Outcome::Ok)
        ]
    );
    let ids = [h.submit("a"), h.submit("a")];
    let d = dispatches(&h.take());
    let done = h.finish(d[0].0, BatchResult::Failed("kernel panic".into()));
    assert_eq!(
        completions(&done),
        ids.map(|id| (id, Outcome::Failed("kernel panic".into())))
            .to_vec()
    );
}

#[test]
fn snapshot_reports_queues_slots_and_residency() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 64), spec("b", 1, 1, 64)], 1);
    h.submit("a");
    h.submit("a");
    let actions = h.take();
    h.prepare_ok(&actions);
    let s = h.core.snapshot();
    assert_eq!(s.tools[0].queue_length, 1);
    assert_eq!(s.tools[0].inflight, 1);
    assert!(s.tools[0].resident && !s.tools[1].resident);
    assert_eq!(s.pending_tools, 1);
    assert_eq!(
        s.slots,
        vec![SlotSnapshot {
            slot: 0,
            busy: true,
            on_device: Some("a".into())
        }]
    );
}

/// Drives the core with random events and checks the central invariant: every accepted request
/// completes exactly once, nothing is left open once the work drains, and a due deadline always
/// makes progress when ticked.
#[test]
fn every_accepted_request_completes_exactly_once_under_random_events() {
    for seed in 0..200u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let tools = vec![spec("a", 4, 2, 16), spec("b", 2, 1, 8), spec("c", 8, 3, 32)];
        let mut h = Harness::new(tools, 0);
        let mut next_slot = 0;
        let mut accepted = Vec::new();
        let mut completed: HashMap<RequestId, usize> = HashMap::new();
        let mut pending_prepares: Vec<(SlotId, ToolId)> = Vec::new();
        let mut running: Vec<(BatchId, usize)> = Vec::new();
        let mut maintenance: Vec<SlotId> = Vec::new();
        let mut slots: Vec<SlotId> = Vec::new();

        let absorb = |actions: Vec<Action>,
                      completed: &mut HashMap<RequestId, usize>,
                      pending_prepares: &mut Vec<(SlotId, ToolId)>,
                      running: &mut Vec<(BatchId, usize)>,
                      maintenance: &mut Vec<SlotId>| {
            for a in actions {
                match a {
                    Action::Complete { request, .. } => *completed.entry(request).or_default() += 1,
                    Action::Prepare { slot, tool, .. } => pending_prepares.push((slot, tool)),
                    Action::Dispatch {
                        batch, requests, ..
                    } => running.push((batch, requests.len())),
                    Action::Evict { slot, .. }
                    | Action::Unload { slot, .. }
                    | Action::ClearCache { slot } => maintenance.push(slot),
                    Action::OomReduced { .. } => {}
                }
            }
        };

        for step in 0..400 {
            let now = h.now;
            match rng.random_range(0..100) {
                0..=34 => {
                    let tool = ["a", "b", "c", "nope"][rng.random_range(0..4)];
                    if let Ok(id) = h.core.submit(tool, now) {
                        accepted.push(id);
                    }
                }
                35..=39 if !accepted.is_empty() => {
                    let id = accepted[rng.random_range(0..accepted.len())];
                    h.core.cancel(id, now);
                }
                40..=44 if slots.len() < 4 => {
                    h.core.worker_registered(next_slot, now);
                    slots.push(next_slot);
                    next_slot += 1;
                }
                45..=47 if !slots.is_empty() => {
                    let slot = slots.swap_remove(rng.random_range(0..slots.len()));
                    h.core.worker_lost(slot, "killed", now);
                }
                48..=59 if !pending_prepares.is_empty() => {
                    let (slot, tool) = pending_prepares.swap_remove(0);
                    let result = if rng.random_range(0..10) == 0 {
                        Err("load failed".into())
                    } else {
                        Ok(())
                    };
                    h.core.prepare_finished(slot, tool, result, now);
                }
                60..=84 if !running.is_empty() => {
                    let (batch, len) = running.swap_remove(rng.random_range(0..running.len()));
                    let result = match rng.random_range(0..10) {
                        0 => BatchResult::OutOfMemory("oom".into()),
                        1 => BatchResult::Failed("boom".into()),
                        _ => BatchResult::Done(
                            (0..len)
                                .map(|i| (i % 5 == 4).then(|| "bad".to_owned()))
                                .collect(),
                        ),
                    };
                    h.core.batch_finished(batch, result, now);
                }
                85..=89 if !maintenance.is_empty() => {
                    let slot = maintenance.swap_remove(0);
                    h.core.slot_freed(slot, now);
                }
                _ => {
                    h.now += Duration::from_millis(rng.random_range(0..40_000));
                    h.core.tick(h.now);
                }
            }
            let actions = h.take();
            absorb(
                actions,
                &mut completed,
                &mut pending_prepares,
                &mut running,
                &mut maintenance,
            );
            if step == 300 {
                h.core.close();
            }
            // A due deadline makes progress when ticked: no busy loop in the driver.
            if let Some(deadline) = h.core.next_deadline()
                && deadline <= h.now
            {
                h.core.tick(h.now);
                let progressed = h.take();
                assert!(
                    !progressed.is_empty() || h.core.next_deadline().is_none_or(|d| d > h.now),
                    "seed {seed}: deadline {deadline:?} due but ticking did nothing"
                );
                absorb(
                    progressed,
                    &mut completed,
                    &mut pending_prepares,
                    &mut running,
                    &mut maintenance,
                );
            }
        }
        // Drain: bring a worker, answer everything, until nothing is open.
        h.core.worker_registered(1000, h.now);
        for _ in 0..10_000 {
            if h.core.open_requests() == 0 {
                break;
            }
            let now = h.now;
            if let Some((slot, tool)) = pending_prepares.pop() {
                h.core.prepare_finished(slot, tool, Ok(()), now);
            } else if let Some((batch, len)) = running.pop() {
                h.core
                    .batch_finished(batch, BatchResult::Done(vec![None; len]), now);
            } else if let Some(slot) = maintenance.pop() {
                h.core.slot_freed(slot, now);
            } else {
                h.now += Duration::from_millis(10);
                h.core.tick(h.now);
            }
            let actions = h.take();
            absorb(
                actions,
                &mut completed,
                &mut pending_prepares,
                &mut running,
                &mut maintenance,
            );
        }
        assert_eq!(h.core.open_requests(), 0, "seed {seed}: requests left open");
        for id in &accepted {
            assert_eq!(completed.get(id), Some(&1), "seed {seed}: request {id}");
        }
        assert_eq!(
            completed.len(),
            accepted.len(),
            "seed {seed}: completions of unknown ids"
        );
    }
}
