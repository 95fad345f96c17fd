//! Continuous tools (generation): requests join a slot while others run, one per dispatch.

use super::*;

fn continuous(name: &str, max_running: u32, max_devices: u32) -> ToolSpec {
    ToolSpec {
        continuous: true,
        ..spec(name, max_running, max_devices, 64)
    }
}

fn running_of(actions: &[Action]) -> Vec<u32> {
    picked!(actions, Action::Dispatch { running, .. } => *running)
}

#[test]
fn requests_join_a_running_slot_up_to_max_running_and_the_next_starts_when_one_ends() {
    let mut h = Harness::new(vec![continuous("g", 4, 1)], 1);
    let ids: Vec<_> = (0..6).map(|_| h.submit("g")).collect();
    let started = h.prepared();
    let d = dispatches(&started);
    assert_eq!(
        d.iter().map(|(_, _, r)| r.clone()).collect::<Vec<_>>(),
        vec![vec![ids[0]], vec![ids[1]], vec![ids[2]], vec![ids[3]]],
        "one request per dispatch, four at once"
    );
    assert_eq!(running_of(&started), vec![1, 2, 3, 4]);
    // The third ends first: its place goes to the fifth at once, the others keep running.
    let next = h.finish(d[2].0, BatchResult::Done(vec![None]));
    assert_eq!(completions(&next), vec![(ids[2], Outcome::Ok)]);
    assert_eq!(dispatches(&next)[0].2, vec![ids[4]]);
    assert_eq!(running_of(&next), vec![4]);
    // Arriving while the slot has room, a request goes without waiting for anything.
    for (batch, _, _) in &d[..2] {
        h.finish(*batch, BatchResult::Done(vec![None]));
    }
    let late = h.submit("g");
    let now = dispatches(&h.take());
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].2, vec![late]);
}

#[test]
fn out_of_memory_halves_max_running_requeues_the_request_and_regrows() {
    let mut spec = continuous("g", 4, 1);
    spec.oom_regrow_after = 2;
    let mut h = Harness::new(vec![spec], 1);
    let ids: Vec<_> = (0..4).map(|_| h.submit("g")).collect();
    let d = h.placed();
    assert_eq!(d.len(), 4);
    // The fourth ran out of memory beside three others: the bound becomes min(4, 4) / 2.
    let after = h.finish(d[3].0, BatchResult::OutOfMemory("KV cache".into()));
    assert!(after.contains(&Action::BatchSizeChanged {
        tool: 0,
        old: 4,
        new: 2,
        cause: SizeChange::OutOfMemory
    }));
    assert!(completions(&after).is_empty(), "requeued, not failed");
    // Three still run, over the new bound of two: nothing starts until two have ended.
    let one = h.finish(d[0].0, BatchResult::Done(vec![None]));
    assert!(dispatches(&one).is_empty());
    let two = h.finish(d[1].0, BatchResult::Done(vec![None]));
    assert_eq!(dispatches(&two)[0].2, vec![ids[3]]);
    // Out of memory beside one other: the bound becomes 1 and it runs again once alone.
    let rest = dispatches(&two)[0].0;
    let halved = h.finish(rest, BatchResult::OutOfMemory("KV cache".into()));
    assert!(completions(&halved).is_empty() && dispatches(&halved).is_empty());
    let alone = h.finish(d[2].0, BatchResult::Done(vec![None]));
    let alone = dispatches(&alone);
    assert_eq!(alone[0].2, vec![ids[3]]);
    // Alone out of memory: nothing left to halve, it fails.
    let fail = h.finish(alone[0].0, BatchResult::OutOfMemory("KV cache".into()));
    assert!(matches!(&completions(&fail)[..], [(id, Outcome::OutOfMemory(_))] if *id == ids[3]));
    // Good requests at the reduced bound double it back, a step at a time: 1 -> 2 -> 4.
    for _ in 0..4 {
        h.submit("g");
        let d = dispatches(&h.take());
        h.finish(d[0].0, BatchResult::Done(vec![None]));
    }
    assert_eq!(h.core.snapshot().tools[0].batch_size, 4);
}

#[test]
fn a_lost_worker_requeues_every_running_request_once() {
    let mut h = Harness::new(vec![continuous("g", 4, 1)], 2);
    let ids: Vec<_> = (0..3).map(|_| h.submit("g")).collect();
    let d = h.placed();
    let slot = d[0].1;
    assert!(
        d.iter().all(|(_, s, _)| *s == slot),
        "max_devices 1: one slot"
    );
    h.core.worker_lost(slot, "connection reset", h.now);
    let actions = h.take();
    assert!(completions(&actions).is_empty());
    // The other slot takes the tool and runs all three again, in their order.
    let again = dispatches(&h.prepare_ok(&actions));
    assert_eq!(
        again.iter().map(|(_, _, r)| r[0]).collect::<Vec<_>>(),
        ids.to_vec()
    );
    assert!(again.iter().all(|(_, s, _)| *s != slot));
}

#[test]
fn a_cancelled_running_request_is_answered_now_and_frees_its_place_when_the_worker_stops_it() {
    let mut h = Harness::new(vec![continuous("g", 2, 1)], 1);
    let ids: Vec<_> = (0..3).map(|_| h.submit("g")).collect();
    let d = h.placed();
    assert_eq!(d.len(), 2);
    h.core.cancel(ids[0], h.now);
    assert_eq!(completions(&h.take()), vec![(ids[0], Outcome::Cancelled)]);
    // The driver stops the call; the worker drops the sequence; the place goes to the third.
    let next = h.finish(d[0].0, BatchResult::Failed("cancelled".into()));
    assert!(completions(&next).is_empty(), "already answered once");
    assert_eq!(dispatches(&next)[0].2, vec![ids[2]]);
    assert_eq!(h.core.open_requests(), 2);
}
