use super::*;

const LIMITS: Limits = Limits {
    ttl_ms: 1_000,
    max_tasks: 3,
    max_bytes: 10_000,
};

fn memory(limits: Limits) -> Store {
    Store::open(None, limits, 0).unwrap().0
}

fn completed(text: &str) -> Outcome {
    Outcome::Completed(serde_json::json!({"content": [{"type": "text", "text": text}]}).to_string())
}

#[test]
fn a_task_works_ends_and_is_removed_its_ttl_after_it_ended() {
    let mut store = memory(LIMITS);
    let (task, removed) = store.create("t1", "alice", "slow", 10).unwrap();
    assert_eq!(
        (task.status, removed),
        (Status::Working, Removed::default())
    );
    assert_eq!(task.ttl_ms(&LIMITS), 1_000);
    // Working longer than the TTL does not lose it: the TTL counts from its end.
    let got = store.get("t1", "alice", 5_000).unwrap().unwrap();
    assert_eq!(got.status, Status::Working);
    let (was_working, _) = store.finish("t1", completed("42"), 5_000).unwrap();
    assert!(was_working);
    let got = store.get("t1", "alice", 5_999).unwrap().unwrap();
    assert_eq!(got.status, Status::Completed);
    assert!(got.payload.as_deref().unwrap().contains("42"));
    assert_eq!(got.ttl_ms(&LIMITS), 5_990, "from creation to removal");
    assert_eq!(store.get("t1", "alice", 6_000).unwrap(), None, "expired");
    assert_eq!(store.sweep(6_000).unwrap(), 1);
    assert_eq!(store.held().unwrap(), (0, 0));
}

#[test]
fn another_owner_finds_nothing_and_cancels_nothing() {
    let mut store = memory(LIMITS);
    store.create("t1", "alice", "slow", 0).unwrap();
    assert_eq!(store.get("t1", "mallory", 1).unwrap(), None);
    assert_eq!(store.cancel("t1", "mallory", 1).unwrap(), None);
    assert_eq!(
        store.get("t1", "alice", 1).unwrap().unwrap().status,
        Status::Working
    );
    assert_eq!(store.get("nope", "alice", 1).unwrap(), None);
}

#[test]
fn a_cancelled_task_stays_cancelled_when_its_work_ends() {
    let mut store = memory(LIMITS);
    store.create("t1", "alice", "slow", 0).unwrap();
    assert_eq!(
        store.cancel("t1", "alice", 5).unwrap(),
        Some(Cancelled::Now)
    );
    let (was_working, _) = store.finish("t1", completed("late"), 6).unwrap();
    assert!(!was_working);
    let got = store.get("t1", "alice", 7).unwrap().unwrap();
    assert_eq!((got.status, got.payload), (Status::Cancelled, None));
    assert_eq!(
        store.cancel("t1", "alice", 8).unwrap(),
        Some(Cancelled::AlreadyEnded(Status::Cancelled))
    );
}

#[test]
fn a_full_store_evicts_finished_tasks_oldest_first_then_refuses_by_name() {
    let mut store = memory(LIMITS);
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        store.create(id, "alice", "slow", i as u64).unwrap();
    }
    match store.create("d", "alice", "slow", 3) {
        Err(e @ StoreError::TooManyTasks { held: 3, max: 3 }) => {
            assert!(
                e.to_string().contains("gateway.tasks.max_tasks is 3"),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    store.finish("b", completed("b"), 4).unwrap();
    store.finish("a", completed("a"), 5).unwrap();
    let (_, removed) = store.create("d", "alice", "slow", 6).unwrap();
    assert_eq!(removed.evicted, 1);
    assert_eq!(store.get("b", "alice", 6).unwrap(), None, "b ended first");
    assert!(store.get("a", "alice", 6).unwrap().is_some());
}

#[test]
fn an_outcome_over_the_byte_budget_is_a_failure_saying_so() {
    let limits = Limits {
        max_bytes: 2_000,
        ..LIMITS
    };
    let mut store = memory(limits);
    store.create("small", "alice", "t", 0).unwrap();
    store
        .finish("small", completed(&"x".repeat(900)), 1)
        .unwrap();
    store.create("big", "alice", "t", 2).unwrap();
    // 1,000 bytes fit once `small` is evicted.
    let (_, removed) = store
        .finish("big", completed(&"y".repeat(1_000)), 3)
        .unwrap();
    assert_eq!(removed.evicted, 1);
    assert_eq!(
        store.get("big", "alice", 3).unwrap().unwrap().status,
        Status::Completed
    );
    store.create("huge", "alice", "t", 4).unwrap();
    let (_, removed) = store
        .finish("huge", completed(&"z".repeat(5_000)), 5)
        .unwrap();
    // Nothing is evicted for an outcome that could never fit.
    assert_eq!(removed.evicted, 0);
    assert!(store.get("big", "alice", 5).unwrap().is_some());
    let got = store.get("huge", "alice", 5).unwrap().unwrap();
    assert_eq!(got.status, Status::Failed);
    let message = got.message.unwrap();
    assert!(
        message.contains("gateway.tasks.max_bytes is 2000"),
        "{message}"
    );
    let error: serde_json::Value = serde_json::from_str(&got.payload.unwrap()).unwrap();
    assert_eq!(error["code"], -32603);
    // Working tasks alone filling the budget refuse a new one by name.
    let tiny = Limits {
        max_bytes: ROW_BYTES * 2,
        ..LIMITS
    };
    let mut store = memory(tiny);
    store.create("a", "alice", "t", 0).unwrap();
    store.create("b", "alice", "t", 0).unwrap();
    let refused = store.create("c", "alice", "t", 0).unwrap_err();
    assert!(
        matches!(
            refused,
            StoreError::TooManyTasks { .. } | StoreError::TooManyBytes { .. }
        ),
        "{refused:?}"
    );
}

#[test]
fn a_task_a_stop_cut_off_is_failed_saying_so_and_finished_ones_are_kept() {
    let dir = std::env::temp_dir().join(format!("nomad-tasks-{}", uuid::Uuid::new_v4()));
    let path = dir.join("tasks.sqlite");
    {
        let (mut store, cut_off) = Store::open(Some(&path), LIMITS, 0).unwrap();
        assert_eq!(cut_off, 0);
        store.create("done", "alice", "t", 1).unwrap();
        store.finish("done", completed("kept"), 2).unwrap();
        store.create("cut", "alice", "t", 3).unwrap();
        // A second gateway cannot take the store while this one holds it.
        match Store::open(Some(&path), LIMITS, 4) {
            Err(e @ StoreError::InUse { .. }) => {
                assert!(e.to_string().contains("gateway.tasks.path"), "{e}")
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("two gateways opened one store"),
        }
    }
    let (store, cut_off) = Store::open(Some(&path), LIMITS, 10).unwrap();
    assert_eq!(cut_off, 1);
    let cut = store.get("cut", "alice", 10).unwrap().unwrap();
    assert_eq!(cut.status, Status::Failed);
    assert_eq!(cut.message.as_deref(), Some(STOPPED));
    let done = store.get("done", "alice", 10).unwrap().unwrap();
    assert_eq!(done.status, Status::Completed);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_linked_result_is_read_by_its_owner_until_it_expires_and_shares_the_budget() {
    let mut store = memory(Limits {
        max_tasks: 2,
        ..LIMITS
    });
    store
        .put_result("nomad://results/a", "alice", "application/json", "[1,2]", 0)
        .unwrap();
    assert_eq!(
        store.result("nomad://results/a", "alice", 1).unwrap(),
        Some(("application/json".into(), "[1,2]".into()))
    );
    assert_eq!(
        store.result("nomad://results/a", "mallory", 1).unwrap(),
        None
    );
    // A new task makes room by evicting the result, as it would a finished task.
    store.create("t1", "alice", "slow", 2).unwrap();
    let (_, removed) = store.create("t2", "alice", "slow", 3).unwrap();
    assert_eq!(removed.evicted, 1);
    assert_eq!(store.result("nomad://results/a", "alice", 3).unwrap(), None);
    store.finish("t1", completed("x"), 4).unwrap();
    store
        .put_result("nomad://results/b", "alice", "text/plain", "long", 5)
        .unwrap();
    assert!(
        store
            .result("nomad://results/b", "alice", 1_004)
            .unwrap()
            .is_some()
    );
    assert_eq!(
        store.result("nomad://results/b", "alice", 1_005).unwrap(),
        None,
        "expired"
    );
}
