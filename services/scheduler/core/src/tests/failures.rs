//! Out of memory, cancellation, rejections, lost workers, failed prepares, model errors.

use super::*;

#[test]
fn oom_halves_the_batch_8_4_2_1_and_requeues_at_the_front() {
    let mut h = Harness::new(vec![spec("a", 8, 1, 64)], 1);
    let ids: Vec<_> = (0..10).map(|_| h.submit("a")).collect();
    let mut d = h.placed();
    assert_eq!(d[0].2, ids[..8]);
    for (old, new) in [(8, 4), (4, 2), (2, 1)] {
        let after = h.finish(d[0].0, BatchResult::OutOfMemory("too big".into()));
        assert!(
            after.contains(&Action::BatchSizeChanged {
                tool: 0,
                old,
                new,
                cause: SizeChange::OutOfMemory
            }),
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
    h.prepared(); // two of four: waiting for the delay
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
    let d = h.placed();
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
    assert_eq!(
        h.try_submit("nope").map(|_| ()),
        Err(Rejection::UnknownTool)
    );
    h.submit("a");
    h.submit("a");
    assert_eq!(h.try_submit("a").map(|_| ()), Err(Rejection::QueueFull));
    h.core.close();
    assert_eq!(h.try_submit("a").map(|_| ()), Err(Rejection::ManagerClosed));
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
    let d = h.placed();
    assert_eq!(d.len(), 1);
}

#[test]
fn a_lost_workers_batch_is_requeued_one_request_per_batch_then_a_second_loss_fails() {
    let mut h = Harness::new(vec![spec("a", 2, 1, 64)], 1);
    let ids = [h.submit("a"), h.submit("a")];
    h.placed();
    h.core.worker_lost(0, "heartbeats stopped", h.now);
    assert!(completions(&h.take()).is_empty(), "requeued, not failed");
    h.core.worker_registered(1, h.now);
    let d = h.placed();
    assert_eq!(d[0].2, [ids[0]], "requeued at the front, each alone");
    h.core.worker_lost(1, "connection refused", h.now);
    let failed = completions(&h.take());
    assert_eq!(failed.len(), 1);
    assert!(
        matches!(&failed[0], (id, Outcome::Unavailable(m)) if *id == ids[0]
            && m.contains("heartbeats stopped; then connection refused")),
        "{failed:?}"
    );
    // Its neighbour was never on the second worker: it is still served, alone.
    h.core.worker_registered(2, h.now);
    let d = h.placed();
    assert_eq!(d[0].2, [ids[1]]);
    let done = h.finish(d[0].0, BatchResult::Done(vec![None]));
    assert_eq!(completions(&done), vec![(ids[1], Outcome::Ok)]);
}

/// A worker-killing input among eight: it fails alone, its seven neighbours are served.
#[test]
fn a_worker_killing_input_fails_alone_while_its_neighbours_succeed() {
    let mut h = Harness::new(vec![spec("a", 8, 3, 64)], 3);
    let ids: Vec<_> = (0..8).map(|_| h.submit("a")).collect();
    let poison = ids[3];
    let mut pending = h.prepared();
    let mut served = Vec::new();
    let mut failed = Vec::new();
    let mut next_worker = 10;
    for _ in 0..100 {
        let d = dispatches(&pending);
        if d.is_empty() {
            break;
        }
        pending = Vec::new();
        for (batch, slot, requests) in d {
            if requests.contains(&poison) {
                h.core
                    .worker_lost(slot, &format!("worker {slot} died"), h.now);
                // The dead worker comes back (its supervisor restarts it).
                h.core.worker_registered(next_worker, h.now);
                next_worker += 1;
            } else {
                h.core
                    .batch_finished(batch, BatchResult::Done(vec![None; requests.len()]), h.now);
            }
            let actions = h.take();
            for (id, outcome) in completions(&actions) {
                match outcome {
                    Outcome::Ok => served.push(id),
                    other => failed.push((id, other)),
                }
            }
            pending.extend(h.prepare_ok(&actions));
            pending.extend(actions);
        }
    }
    served.sort();
    let neighbours: Vec<_> = ids.iter().copied().filter(|&i| i != poison).collect();
    assert_eq!(served, neighbours);
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, poison);
    assert!(matches!(&failed[0].1, Outcome::Unavailable(m) if m.contains("two workers were lost")));
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
fn model_errors_fail_the_whole_batch_and_item_failures_only_their_request() {
    let mut h = Harness::new(vec![spec("a", 2, 1, 64)], 1);
    let ids = [h.submit("a"), h.submit("a")];
    let d = h.placed();
    let done = h.finish(
        d[0].0,
        BatchResult::Done(vec![
            Some(ItemFailure::InvalidInput("request 0: bad".into())),
            None,
        ]),
    );
    assert_eq!(
        completions(&done),
        vec![
            (ids[0], Outcome::InvalidInput("request 0: bad".into())),
            (ids[1], Outcome::Ok)
        ]
    );
    // A model that fails on one request alone fails that request, not its batch-mate.
    let ids = [h.submit("a"), h.submit("a")];
    let d = dispatches(&h.take());
    let done = h.finish(
        d[0].0,
        BatchResult::Done(vec![
            None,
            Some(ItemFailure::Failed("ValueError: no".into())),
        ]),
    );
    assert_eq!(
        completions(&done),
        vec![
            (ids[0], Outcome::Ok),
            (ids[1], Outcome::Failed("ValueError: no".into()))
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
    h.prepared();
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
