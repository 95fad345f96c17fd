//! Exactly-once completion under random events.

use rand::{Rng, SeedableRng};

use super::*;

/// Drives the core with random events and checks the central invariant: every accepted request
/// completes exactly once, nothing is left open once the work drains, and a due deadline always
/// makes progress when ticked.
#[test]
fn every_accepted_request_completes_exactly_once_under_random_events() {
    for seed in 0..200u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let generate = ToolSpec {
            continuous: true,
            ..spec("g", 3, 2, 16)
        };
        let tools = vec![
            spec("a", 4, 2, 16),
            spec("b", 2, 1, 8),
            spec("c", 8, 3, 32),
            generate,
        ];
        let mut h = Harness::new(tools, 0);
        let mut next_slot = 0;
        let mut accepted = Vec::new();
        let mut open = Open::default();
        let mut slots: Vec<SlotId> = Vec::new();

        for step in 0..400 {
            let now = h.now;
            match rng.random_range(0..100) {
                0..=34 => {
                    let tool = ["a", "b", "c", "g", "nope"][rng.random_range(0..5)];
                    if let Ok(id) = h.try_submit(tool) {
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
                48..=59 if !open.pending_prepares.is_empty() => {
                    let (slot, tool) = open.pending_prepares.swap_remove(0);
                    let result = if rng.random_range(0..10) == 0 {
                        Err("load failed".into())
                    } else {
                        Ok(())
                    };
                    h.core.prepare_finished(slot, tool, result, now);
                }
                60..=84 if !open.running.is_empty() => {
                    let (batch, len) = open
                        .running
                        .swap_remove(rng.random_range(0..open.running.len()));
                    let result = match rng.random_range(0..10) {
                        0 => BatchResult::OutOfMemory("oom".into()),
                        1 => BatchResult::Failed("boom".into()),
                        _ => BatchResult::Done(
                            (0..len)
                                .map(|i| match i % 7 {
                                    4 => Some(ItemFailure::InvalidInput("bad".into())),
                                    6 => Some(ItemFailure::Failed("raised".into())),
                                    _ => None,
                                })
                                .collect(),
                        ),
                    };
                    h.core.batch_finished(batch, result, now);
                }
                85..=89 if !open.maintenance.is_empty() => {
                    let slot = open.maintenance.swap_remove(0);
                    h.core.slot_freed(slot, now);
                }
                _ => {
                    h.now += Duration::from_millis(rng.random_range(0..40_000));
                    h.core.tick(h.now);
                }
            }
            open.absorb(h.take());
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
                open.absorb(progressed);
            }
        }
        // Drain: bring a worker, answer everything, until nothing is open.
        h.core.worker_registered(1000, h.now);
        for _ in 0..10_000 {
            if h.core.open_requests() == 0 {
                break;
            }
            let now = h.now;
            if let Some((slot, tool)) = open.pending_prepares.pop() {
                h.core.prepare_finished(slot, tool, Ok(()), now);
            } else if let Some((batch, len)) = open.running.pop() {
                h.core
                    .batch_finished(batch, BatchResult::Done(vec![None; len]), now);
            } else if let Some(slot) = open.maintenance.pop() {
                h.core.slot_freed(slot, now);
            } else {
                h.now += Duration::from_millis(10);
                h.core.tick(h.now);
            }
            open.absorb(h.take());
        }
        assert_eq!(h.core.open_requests(), 0, "seed {seed}: requests left open");
        for id in &accepted {
            assert_eq!(
                open.completed.get(id),
                Some(&1),
                "seed {seed}: request {id}"
            );
        }
        assert_eq!(
            open.completed.len(),
            accepted.len(),
            "seed {seed}: completions of unknown ids"
        );
    }
}

/// What the core has asked for and the test has not answered yet, and what it completed.
#[derive(Default)]
struct Open {
    completed: HashMap<RequestId, usize>,
    pending_prepares: Vec<(SlotId, ToolId)>,
    running: Vec<(BatchId, usize)>,
    maintenance: Vec<SlotId>,
}

impl Open {
    fn absorb(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Complete { request, .. } => {
                    *self.completed.entry(request).or_default() += 1
                }
                Action::Prepare { slot, tool, .. } => self.pending_prepares.push((slot, tool)),
                Action::Dispatch {
                    batch, requests, ..
                } => self.running.push((batch, requests.len())),
                Action::Evict { slot, .. }
                | Action::Unload { slot, .. }
                | Action::ClearCache { slot } => self.maintenance.push(slot),
                Action::BatchSizeChanged { .. } => {}
            }
        }
    }
}
