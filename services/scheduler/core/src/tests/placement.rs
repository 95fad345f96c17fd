//! Placement and batching: slots, fairness, max_devices, offloads, replicas, delays.

use super::*;

#[test]
fn a_request_is_loaded_placed_dispatched_and_completed() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8)], 1);
    let r = h.submit("a");
    let actions = h.take();
    assert_eq!(actions, vec![prepare(0, 0, None, Some(LoadKind::Resident))]);
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
    assert!(h.placed().is_empty(), "one request of four waits");
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
fn without_a_delay_a_free_slot_takes_one_request_and_a_batch_forms_while_it_works() {
    let mut h = Harness::with_delay(vec![spec("a", 4, 1, 64)], 1, Duration::ZERO);
    let first = h.submit("a");
    assert_eq!(
        h.placed(),
        vec![(0, 0, vec![first])],
        "an idle slot holding the tool takes a lone request at once"
    );
    let waiting: Vec<_> = (0..3).map(|_| h.submit("a")).collect();
    assert!(
        dispatches(&h.take()).is_empty(),
        "nothing goes while the only slot works"
    );
    let next = h.finish(0, BatchResult::Done(vec![None]));
    assert_eq!(
        dispatches(&next),
        vec![(1, 0, waiting)],
        "what queued during the batch goes together the moment the slot frees"
    );
}

#[test]
fn batch_size_is_capped_by_max_pending() {
    let mut h = Harness::new(vec![spec("a", 8, 1, 3)], 1);
    let ids: Vec<_> = (0..3).map(|_| h.submit("a")).collect();
    let d = h.placed();
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
    h.served("a");
    h.submit("b");
    let actions = h.take();
    assert_eq!(
        actions,
        vec![prepare(0, 1, Some(0), Some(LoadKind::Resident))]
    );
    // Back to a: still resident on that worker, so no load from disk this time.
    let d = dispatches(&h.prepare_ok(&actions));
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    h.submit("a");
    assert_eq!(h.take(), vec![prepare(0, 0, Some(1), None)]);
}

#[test]
fn a_slot_whose_tool_still_has_work_waiting_is_not_taken() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 1);
    h.submit("a");
    let d = h.placed();
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
    let loads = picked!(h.take(), Action::Prepare { load, .. } => *load);
    assert_eq!(
        loads,
        vec![Some(LoadKind::Resident), Some(LoadKind::Replica)]
    );
}
