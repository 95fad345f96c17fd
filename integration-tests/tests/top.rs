//! `nomad top` in a real terminal (tmux) against a live `nomad up` fleet under load: its screen
//! shows the tools, a non-zero request rate and the run's rollouts, and `q` quits it.

use std::process::Stdio;
use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::nomad_up;
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{binary, clean, refused_saying};
use nomad_integration_tests::unique_run_id;
use nomad_integration_tests::{Fleet, wait_until};

fn tmux(args: &[&str]) -> std::process::Output {
    std::process::Command::new("tmux")
        .args(args)
        .output()
        .expect("tmux (apt-get install tmux)")
}

/// The embed row's requests per second on a `nomad top` screen.
fn embed_rate(screen: &str) -> Option<f64> {
    let row = screen
        .lines()
        .find(|l| l.trim_start_matches('│').starts_with("embed "))?;
    let cells: Vec<&str> = row.trim_matches('│').split_whitespace().collect();
    cells.get(5)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_a_live_fleet_under_load_and_quits_on_q() {
    let dir = Fleet::new_dir();
    let run_id = unique_run_id("it-top");
    let (mut up, fleet) = nomad_up(&dir, &run_id).await;
    let run_dir = dir.join("runs").join(&run_id);

    // Without a fleet or a scheduler, it says what it needs.
    let bare = clean("nomad").arg("top").output().await.unwrap();
    assert!(!bare.status.success());
    assert!(String::from_utf8_lossy(&bare.stderr).contains("--fleet"));

    let session = format!("nomad-top-{}", std::process::id());
    let command = format!(
        "{} top --fleet {} --interval 0.5",
        binary("nomad").display(),
        fleet.display()
    );
    let started = tmux(&[
        "new-session",
        "-d",
        "-s",
        &session,
        "-x",
        "130",
        "-y",
        "45",
        &command,
    ]);
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );

    // Load: the demo's tasks, twice over, through the fleet.
    let demo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/head/demo");
    let tasks = std::fs::read_to_string(demo.join("tasks.jsonl")).unwrap();
    let doubled = dir.join("tasks.jsonl");
    std::fs::write(
        &doubled,
        tasks.clone()
            + &tasks
                .replace("\"id\": \"", "\"id\": \"again-")
                .replace("\"id\":\"", "\"id\":\"again-"),
    )
    .unwrap();
    let mut run = clean("nomad")
        .args(["run", "--fleet"])
        .arg(&fleet)
        .arg("--tasks")
        .arg(&doubled)
        .arg("--template")
        .arg(demo.join("agent.py"))
        .arg("--out")
        .arg(run_dir.join("results.jsonl"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let mut best_rate = 0.0f64;
    let mut screen = String::new();
    let mut saw_rollouts = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline && !(best_rate > 0.0 && saw_rollouts) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let captured = tmux(&["capture-pane", "-p", "-t", &session]);
        screen = String::from_utf8_lossy(&captured.stdout).into_owned();
        best_rate = best_rate.max(embed_rate(&screen).unwrap_or(0.0));
        saw_rollouts |= screen
            .lines()
            .any(|l| l.contains("rollouts: ") && !l.contains("rollouts: 0 done"));
    }
    assert!(screen.contains(&format!("run {run_id}")), "{screen}");
    assert!(screen.contains("generate"), "{screen}");
    assert!(screen.contains("worker-0"), "{screen}");
    assert!(screen.contains("sandbox: "), "{screen}");
    assert!(
        best_rate > 0.0,
        "no request rate shown under load:\n{screen}"
    );
    assert!(saw_rollouts, "no rollouts shown:\n{screen}");
    assert!(run.wait().await.unwrap().success());

    // `q` quits: the session's only window closes with it.
    tmux(&["send-keys", "-t", &session, "q"]);
    wait_until(
        "nomad top did not quit on q",
        Duration::from_secs(10),
        || !tmux(&["has-session", "-t", &session]).status.success(),
    )
    .await;
    send_signal(up.id().unwrap(), libc::SIGTERM);
    assert!(up.wait().await.unwrap().success());

    // The fleet is gone (its fleet.json stays): both commands say so and fail.
    let tasks = dir.join("stopped-tasks.jsonl");
    std::fs::write(
        &tasks,
        "{\"id\": \"t\", \"tool\": \"embed\", \"arguments\": {\"text\": \"x\"}}\n",
    )
    .unwrap();
    for args in [
        vec!["top", "--once", "--fleet"],
        vec!["run", "--tasks", tasks.to_str().unwrap(), "--fleet"],
    ] {
        refused_saying(
            clean("nomad").args(&args).arg(&fleet),
            &[&format!("fleet {run_id} is not running")],
        )
        .await;
    }
    std::fs::remove_dir_all(&dir).ok();
}
