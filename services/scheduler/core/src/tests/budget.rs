//! Batch size that only goes down and then recovers, batches by byte and token budget, inputs
//! of similar size grouped, and failed prepares contained to their slot.

use super::*;

fn oom(h: &mut Harness, batch: BatchId) -> Vec<Action> {
    h.finish(batch, BatchResult::OutOfMemory("no room".into()))
}

fn size_changes(actions: &[Action]) -> Vec<(u32, u32, SizeChange)> {
    picked!(actions, Action::BatchSizeChanged { old, new, cause, .. } => (*old, *new, *cause))
}

#[test]
fn a_full_batch_of_16_out_of_memory_sets_8_and_a_stale_batch_never_raises_it() {
    // Two slots, so a second batch of 16 is in flight when the first runs out of memory.
    let mut h = Harness::new(vec![spec("a", 16, 2, 1000)], 2);
    let ids: Vec<_> = (0..40).map(|_| h.submit("a")).collect();
    let d = h.placed();
    assert_eq!((d[0].2.len(), d[1].2.len()), (16, 16));
    let after = oom(&mut h, d[0].0);
    assert_eq!(size_changes(&after), [(16, 8, SizeChange::OutOfMemory)]);
    let retried = dispatches(&after);
    assert_eq!(
        retried[0].2,
        ids[..8],
        "the failed batch's first 8, at the front"
    );
    // The stale batch of 16 fails after the reduction: min(8, 16) / 2 = 4, never 8 again.
    let after = oom(&mut h, d[1].0);
    assert_eq!(size_changes(&after), [(8, 4, SizeChange::OutOfMemory)]);
    // And one failing at size 4 with a stale length of 8 cannot raise it either.
    let after = oom(&mut h, retried[0].0);
    assert!(size_changes(&after).iter().all(|(old, new, _)| new < old));
    assert!(h.core.snapshot().tools[0].batch_size <= 4);
}

#[test]
fn fifty_good_batches_at_a_reduced_size_double_it_back_in_steps() {
    let mut spec = spec("a", 16, 1, 100_000);
    spec.oom_regrow_after = 50;
    let mut h = Harness::new(vec![spec], 1);
    for _ in 0..16 {
        h.submit("a");
    }
    let d = h.placed();
    let mut pending = oom(&mut h, d[0].0);
    assert_eq!(h.core.snapshot().tools[0].batch_size, 8);
    let mut changes = Vec::new();
    let mut good = 0;
    while h.core.snapshot().tools[0].batch_size < 16 {
        // Keep the queue full so every batch is a full one.
        for _ in 0..16 {
            h.submit("a");
        }
        pending.extend(h.take());
        let d = dispatches(&pending);
        assert!(
            !d.is_empty(),
            "nothing dispatched after {good} good batches"
        );
        let (batch, _, requests) = d[0].clone();
        pending = h.finish(batch, BatchResult::Done(vec![None; requests.len()]));
        changes.extend(size_changes(&pending));
        good += 1;
        assert!(good <= 200, "never grew back: {changes:?}");
    }
    assert_eq!(changes, [(8, 16, SizeChange::Regrown)]);
    assert_eq!(good, 50, "regrown after exactly 50 good batches at 8");

    // From 2 it takes two steps, 50 good batches each: 2 -> 4 -> 8.
    let mut spec = super::spec("b", 8, 1, 100_000);
    spec.oom_regrow_after = 3;
    let mut h = Harness::new(vec![spec], 1);
    for _ in 0..8 {
        h.submit("b");
    }
    let mut d = h.placed();
    for _ in 0..2 {
        let after = oom(&mut h, d[0].0);
        d = dispatches(&after);
    }
    assert_eq!(h.core.snapshot().tools[0].batch_size, 2);
    let mut steps = Vec::new();
    let mut pending = Vec::new();
    for _ in 0..20 {
        for _ in 0..8 {
            h.submit("b");
        }
        pending.extend(h.take());
        let next = dispatches(&pending);
        let (batch, _, requests) = next.first().cloned().unwrap_or_else(|| d[0].clone());
        pending = h.finish(batch, BatchResult::Done(vec![None; requests.len()]));
        steps.extend(size_changes(&pending));
    }
    assert_eq!(
        steps,
        [(2, 4, SizeChange::Regrown), (4, 8, SizeChange::Regrown)]
    );
}

#[test]
fn requests_beyond_the_byte_budget_wait_for_the_next_batch_in_order() {
    let mut spec = spec("a", 16, 1, 1000);
    spec.max_batch_bytes = 3 << 20;
    let mut h = Harness::new(vec![spec], 1);
    let mib = Cost {
        bytes: 1 << 20,
        tokens: 0,
    };
    let ids: Vec<_> = (0..7)
        .map(|_| h.submit_costing("a", mib).unwrap())
        .collect();
    let d = h.placed();
    assert_eq!(d[0].2, ids[..3], "three 1 MiB inputs fill a 3 MiB budget");
    let next = dispatches(&h.finish(d[0].0, BatchResult::Done(vec![None; 3])));
    assert_eq!(next[0].2, ids[3..6]);
    // One input bigger than the whole budget still runs, alone.
    let mut spec = super::spec("b", 16, 1, 1000);
    spec.max_batch_bytes = 1000;
    let mut h = Harness::new(vec![spec], 1);
    let big = h
        .submit_costing(
            "b",
            Cost {
                bytes: 5000,
                tokens: 0,
            },
        )
        .unwrap();
    let small = h.submit("b");
    let d = h.placed();
    assert_eq!(d[0].2, [big]);
    h.finish(d[0].0, BatchResult::Done(vec![None]));
    // The small one alone is a partial batch: it goes when the batch delay is up.
    let next = dispatches(&h.advance(DELAY));
    assert_eq!(next[0].2, [small]);
}

#[test]
fn the_token_budget_and_grouping_keep_long_inputs_from_padding_short_ones() {
    let mut spec = spec("a", 4, 1, 1000);
    spec.max_batch_tokens = 1000;
    spec.group_by_size = true;
    let mut h = Harness::new(vec![spec], 1);
    let cost = |tokens| Cost { bytes: 10, tokens };
    // Queued while no worker is ready: a long one between short ones, three batches' worth.
    let sizes = [8, 200, 8, 8, 200, 8, 8, 8, 8, 8, 8, 8];
    let ids: Vec<_> = sizes
        .iter()
        .map(|&t| h.submit_costing("a", cost(t)).unwrap())
        .collect();
    let d = h.placed();
    // The front (short) request's batch is all short inputs.
    assert_eq!(d[0].2, [ids[0], ids[2], ids[3], ids[5]]);
    let next = dispatches(&h.finish(d[0].0, BatchResult::Done(vec![None; 4])));
    // Now the long one is at the front: it goes, with the other long one beside it.
    assert_eq!(next[0].2[..2], [ids[1], ids[4]]);
    // Without enough queued for grouping, the order is plain FIFO within the token budget.
    let mut spec = super::spec("b", 8, 1, 1000);
    spec.max_batch_tokens = 300;
    let mut h = Harness::new(vec![spec], 1);
    let ids: Vec<_> = [100, 150, 100, 10]
        .iter()
        .map(|&t| h.submit_costing("b", cost(t)).unwrap())
        .collect();
    let d = h.placed();
    assert_eq!(d[0].2, ids[..2], "100 + 150 fit, the next 100 would not");
}

#[test]
fn a_failed_prepare_on_one_of_two_slots_leaves_the_tool_served_by_the_other() {
    let mut h = Harness::new(vec![spec("a", 1, 2, 64)], 2);
    let ids: Vec<_> = (0..4).map(|_| h.submit("a")).collect();
    let prepares = prepares(&h.take());
    assert_eq!(prepares.len(), 2, "both slots take the tool");
    let (bad, good) = (prepares[0].0, prepares[1].0);
    h.core
        .prepare_finished(bad, 0, Err("weights are corrupt".into()), h.now);
    let after = h.take();
    assert!(
        completions(&after).is_empty(),
        "the other slot can serve: {after:?}"
    );
    assert!(
        prepares_of(&after).is_empty(),
        "the bad slot is not retried at once"
    );
    h.core.prepare_finished(good, 0, Ok(()), h.now);
    let mut served = Vec::new();
    let mut actions = h.take();
    for _ in 0..8 {
        let d = dispatches(&actions);
        let Some((batch, slot, requests)) = d.first().cloned() else {
            break;
        };
        assert_eq!(slot, good, "only the good slot serves");
        served.extend(requests);
        actions = h.finish(batch, BatchResult::Done(vec![None]));
    }
    assert_eq!(served, ids);
    // After its backoff, the bad slot is tried again for new work.
    for _ in 0..3 {
        h.submit("a");
    }
    let later = h.advance(Duration::from_secs(2));
    let retried: Vec<_> = h
        .take()
        .into_iter()
        .chain(later)
        .filter_map(|a| match a {
            Action::Prepare { slot, .. } => Some(slot),
            _ => None,
        })
        .collect();
    assert!(retried.contains(&bad), "the bad slot was never retried");
    // When no other slot can serve, the waiting requests fail with the worker's words.
    h.core
        .prepare_finished(bad, 0, Err("weights are still corrupt".into()), h.now);
    assert!(
        !completions(&h.take())
            .iter()
            .any(|(_, o)| matches!(o, Outcome::Unavailable(m) if m.contains("still corrupt"))),
        "the good slot still holds the tool"
    );
}

fn prepares_of(actions: &[Action]) -> Vec<SlotId> {
    picked!(actions, Action::Prepare { slot, .. } => *slot)
}

#[test]
fn a_batch_size_set_once_the_model_says_it_forms_the_next_batches() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 1000)], 1);
    let first: Vec<_> = (0..3).map(|_| h.submit("a")).collect();
    let d = h.placed();
    assert_eq!(d[0].2, first[..1], "one at a time before the size is known");
    h.core.set_batch_size(0, 4);
    assert_eq!(h.core.snapshot().tools[0].batch_size, 4);
    let more: Vec<_> = (0..3).map(|_| h.submit("a")).collect();
    let next = dispatches(&h.finish(d[0].0, BatchResult::Done(vec![None])));
    assert_eq!(next[0].2, [&first[1..], &more[..2]].concat());
}
