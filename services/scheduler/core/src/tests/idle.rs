//! Idle eviction, disk unload, cache clearing.

use super::*;

#[test]
fn idle_eviction_takes_the_least_recently_used_slot_first() {
    let mut h = Harness::new(vec![spec("a", 1, 1, 8), spec("b", 1, 1, 8)], 2);
    h.submit("a");
    let a = dispatches(&{ h.prepared() });
    h.finish(a[0].0, BatchResult::Done(vec![None]));
    h.now += Duration::from_secs(3);
    h.submit("b");
    let b = dispatches(&{ h.prepared() });
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
    let d = h.placed();
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
    h.served("a");
    h.advance(IDLE);
    h.core.slot_freed(0, h.now);
    h.core.take_actions();
    // b takes the slot and keeps it busy; a queues behind it (1 slot only).
    h.submit("b");
    h.prepared();
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
    h.served("a");
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
