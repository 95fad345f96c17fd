//! Lanes: a CPU worker serving several tools at once, one lane each.

use super::*;

/// One worker with two lanes (slots 0 and 1 of group 0).
fn two_lanes(tools: Vec<ToolSpec>) -> Harness {
    let mut h = Harness::with_delay(tools, 0, Duration::ZERO);
    h.core.lane_registered(0, 0, h.now);
    h.core.lane_registered(1, 0, h.now);
    h
}

#[test]
fn a_second_tool_runs_on_another_lane_while_the_first_is_busy() {
    let mut h = two_lanes(vec![spec("generate", 1, 1, 8), spec("embed", 4, 1, 8)]);
    let long = h.submit("generate");
    let actions = h.take();
    let prepared = prepares(&actions);
    assert_eq!(prepared.len(), 1);
    let generate_lane = prepared[0].0;
    assert_eq!(dispatches(&h.prepare_ok(&actions)).len(), 1, "{long} runs");
    // While generate's batch runs, embed is prepared on the other lane and dispatched there,
    // without waiting for it (and without taking generate's lane from it).
    let quick = h.submit("embed");
    let actions = h.take();
    assert_eq!(
        prepares(&actions),
        vec![(1 - generate_lane, 1, None)],
        "embed takes the free lane"
    );
    let d = dispatches(&h.prepare_ok(&actions));
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].1, d[0].2.clone()), (1 - generate_lane, vec![quick]));
}

#[test]
fn a_tool_is_never_on_two_lanes_of_one_worker() {
    // Two devices allowed and a deep queue: a replica would be taken on a second GPU, but two
    // lanes of one worker share its one copy, so the second lane stays free.
    let mut h = two_lanes(vec![spec("embed", 1, 2, 64)]);
    let first = h.submit("embed");
    let actions = h.take();
    assert_eq!(prepares(&actions).len(), 1);
    h.prepare_ok(&actions);
    for _ in 0..8 {
        h.submit("embed");
    }
    assert!(
        prepares(&h.take()).is_empty(),
        "no second lane for the tool ({first} runs)"
    );
    // A worker of its own (another group) does take the replica.
    h.core.worker_registered(7, h.now);
    assert_eq!(prepares(&h.core.take_actions()), vec![(7, 0, None)]);
}
