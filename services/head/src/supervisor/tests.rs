//! The supervisor with real child processes (`sh`).

use super::*;

fn sh(name: &str, script: &str) -> ChildSpec {
    ChildSpec {
        stdio: false,
        name: name.into(),
        server_type: "test",
        program: "sh".into(),
        args: vec!["-c".into(), script.into()],
        env: vec![],
        ready_files: vec![],
        restart: true,
    }
}

/// A child's stdout joins its log; its console telemetry goes to its own `<name>.jsonl`,
/// which it writes (and rotates) itself.
#[tokio::test]
async fn a_child_is_told_its_own_telemetry_file_and_its_stdout_joins_its_log() {
    let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut sup = Supervisor::new(&dir, Restarts::never());
    sup.spawn(sh(
        "talker",
        "echo \"out $NOMAD_OTEL_CONSOLE_FILE\"; echo err >&2; exit 0",
    ))
    .unwrap();
    let exit = sup.next_exit().await;
    assert_eq!(exit.status.code(), Some(0));
    let log = std::fs::read_to_string(dir.join("talker.log")).unwrap();
    let expected = format!("out {}", dir.join("talker.jsonl").display());
    assert!(log.contains(&expected), "{log}");
    assert!(log.contains("err"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_dying_child_is_reported_with_its_log_and_the_rest_are_stopped() {
    let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut sup = Supervisor::new(&dir, Restarts::never());
    sup.spawn(sh("steady", "exec sleep 30")).unwrap();
    // Ignores SIGTERM: must be killed when the grace period ends.
    let trapped = dir.join("trapped");
    sup.spawn(sh(
        "stubborn",
        &format!(
            "trap '' TERM; touch {}; while :; do sleep 0.05; done",
            trapped.display()
        ),
    ))
    .unwrap();
    sup.spawn(sh("crasher", "echo 'bad weights' >&2; exit 3"))
        .unwrap();
    let exit = sup.next_exit().await;
    assert_eq!(exit.name, "crasher");
    assert_eq!(exit.status.code(), Some(3));
    let report = sup.report(&exit);
    assert!(report.contains("bad weights"), "{report}");
    let pids: Vec<u32> = sup.running().iter().map(|(_, pid)| *pid).collect();
    assert_eq!(pids.len(), 2);

    // Stopping before the shell has set its trap would test nothing.
    while !trapped.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let exits = sup.stop(Duration::from_millis(300)).await;
    assert_eq!(exits.len(), 3);
    assert!(sup.running().is_empty());
    let signal_of = |name: &str| {
        use std::os::unix::process::ExitStatusExt as _;
        exits
            .iter()
            .find(|e| e.name == name)
            .unwrap()
            .status
            .signal()
    };
    assert_eq!(signal_of("steady"), Some(libc::SIGTERM));
    assert_eq!(signal_of("stubborn"), Some(libc::SIGKILL));
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{pid} still runs"
        );
    }
    let active = sup.active.lock().unwrap();
    assert_eq!(active[0].1.load(Ordering::Relaxed), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn quick(max_restarts: u32) -> Restarts {
    RestartPolicy {
        restart: true,
        backoff_seconds: 0.01,
        max_backoff_seconds: 0.05,
        max_restarts,
        window_seconds: 60.0,
    }
    .checked()
    .unwrap()
}

fn servers_json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(SERVERS_FILE)).unwrap()).unwrap()
}

/// A child killed from outside comes back in its place (a new pid, its log kept and marked,
/// its index kept: the stop order is the start order reversed), counted in `servers.json`;
/// the others are untouched.
#[tokio::test]
async fn a_child_that_dies_is_started_again_in_its_place() {
    let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut sup = Supervisor::new(&dir, quick(3));
    let ready = dir.join("victim.addr");
    sup.spawn(sh("first", "exec sleep 30")).unwrap();
    let mut victim = sh(
        "victim",
        &format!(
            "echo life >&2; echo here > {}; exec sleep 30",
            ready.display()
        ),
    );
    victim.ready_files = vec![ready.clone()];
    sup.spawn(victim).unwrap();
    sup.spawn(sh("last", "exec sleep 30")).unwrap();
    let pid = |sup: &Supervisor, name: &str| {
        sup.running()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p)
    };
    while !ready.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first_life = pid(&sup, "victim").unwrap();
    signal(first_life, libc::SIGKILL);
    // The restart happens inside next_exit, which returns only for an exit that ends the
    // fleet: none here.
    let waited = tokio::time::timeout(Duration::from_secs(1), sup.next_exit()).await;
    assert!(
        waited.is_err(),
        "a restartable death ended the fleet: {waited:?}"
    );
    let second_life = pid(&sup, "victim").expect("started again");
    assert_ne!(second_life, first_life);
    let servers = servers_json(&dir);
    let victim = &servers["servers"][1];
    assert_eq!(victim["name"], "victim");
    assert_eq!(victim["restarts"], 1);
    assert_eq!(victim["pid"], second_life);
    assert!(
        victim["last_exit"].as_str().unwrap().contains("SIGKILL"),
        "{victim}"
    );
    let log = std::fs::read_to_string(dir.join("victim.log")).unwrap();
    assert_eq!(log.matches("life").count(), 2, "{log}");
    assert!(log.contains("started again after it exited"), "{log}");
    let exits = sup.stop(Duration::from_secs(2)).await;
    let order: Vec<&str> = exits.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(order, ["first", "victim", "last"]);
    assert!(sup.running().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A child that keeps dying is started again at most `max_restarts` times within the
/// window, with growing waits, and then ends the fleet; one that exits successfully is not
/// started again.
#[tokio::test]
async fn a_crash_loop_ends_the_fleet_and_a_clean_exit_is_not_restarted() {
    let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut sup = Supervisor::new(&dir, quick(2));
    sup.spawn(sh("crasher", "echo 'bad weights' >&2; exit 3"))
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(5), sup.next_exit())
        .await
        .expect("a crash loop ends");
    assert_eq!(exit.name, "crasher");
    assert_eq!(exit.status.code(), Some(3));
    assert_eq!(servers_json(&dir)["servers"][0]["restarts"], 2);
    let log = std::fs::read_to_string(dir.join("crasher.log")).unwrap();
    assert_eq!(log.matches("bad weights").count(), 3, "{log}");

    sup.spawn(sh("done", "exit 0")).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(5), sup.next_exit())
        .await
        .unwrap();
    assert_eq!((exit.name.as_str(), exit.status.code()), ("done", Some(0)));
    assert_eq!(servers_json(&dir)["servers"][1]["restarts"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
