//! `nomad ps` and `nomad down` as a user runs them: a fleet `nomad up` started is listed with its
//! head and address, stopped by `nomad down` (the head and every server gone), and then listed
//! only with `--all`; the mistakes a user makes are refused naming what is there.

use std::time::Duration;

use nomad_integration_tests::Fleet;
use nomad_integration_tests::fleet::nomad_up;
use nomad_integration_tests::process::clean;
use serde_json::Value;

async fn nomad(args: &[&str]) -> (Option<i32>, String, String) {
    let out = clean("nomad").args(args).output().await.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ps_lists_a_running_fleet_and_down_stops_it() {
    let dir = Fleet::new_dir();
    let runs = dir.join("runs");
    let runs = runs.to_str().unwrap();
    let (mut up, fleet_json) = nomad_up(&dir, "listed").await;
    let fleet: Value =
        serde_json::from_str(&std::fs::read_to_string(&fleet_json).unwrap()).unwrap();

    let (code, stdout, stderr) = nomad(&["ps", "--runs-dir", runs, "--json"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let listed: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1, "{stdout}");
    assert_eq!(listed[0]["run_id"], "listed");
    assert_eq!(listed[0]["state"], "running");
    assert_eq!(listed[0]["head_pid"], u64::from(up.id().unwrap()));
    assert_eq!(listed[0]["mcp"], fleet["gateway_mcp"]);
    let (_, table, _) = nomad(&["ps", "--runs-dir", runs]).await;
    assert!(
        table.starts_with("RUN ") && table.contains("listed") && table.contains("running"),
        "{table}"
    );

    // `nomad status` knows a fleet as it knows a Slurm job: by its run id, or `latest`.
    let (code, stdout, stderr) = nomad(&["status", "latest", "--runs-dir", runs]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.starts_with(&format!(
            "run listed: fleet running (head pid {})",
            up.id().unwrap()
        )) && stdout.contains(fleet["gateway_mcp"].as_str().unwrap()),
        "{stdout}"
    );
    let (code, _, stderr) = nomad(&["status", "nope", "--runs-dir", runs]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("\"nope\" is neither a fleet's run id under")
            && stderr.contains("runs there: listed"),
        "{stderr}"
    );

    // A run id that is not there is refused naming the one that is.
    let (code, _, stderr) = nomad(&["down", "nope", "--runs-dir", runs]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("no fleet \"nope\"") && stderr.contains("running: listed"),
        "{stderr}"
    );

    let listed = fleet["servers"]
        .as_array()
        .expect("fleet.json lists its servers");
    let servers: Vec<u64> = listed.iter().map(|s| s["pid"].as_u64().unwrap()).collect();
    let (code, stdout, stderr) = nomad(&["down", "--runs-dir", runs]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout.trim(), "stopped fleet listed");
    let status = tokio::time::timeout(Duration::from_secs(10), up.wait())
        .await
        .expect("nomad up has exited once down returns")
        .unwrap();
    assert!(status.success(), "the head stopped cleanly: {status}");
    for pid in servers {
        assert!(!alive(pid), "server {pid} outlived the fleet");
    }

    let (_, stdout, stderr) = nomad(&["ps", "--runs-dir", runs]).await;
    assert!(
        stdout.is_empty() && stderr.contains("no fleets running"),
        "{stdout}{stderr}"
    );
    let (_, stdout, _) = nomad(&["ps", "--runs-dir", runs, "--all", "--json"]).await;
    let stopped: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(stopped["state"], "stopped");
    let (code, _, stderr) = nomad(&["down", "--runs-dir", runs]).await;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("no fleet is running under"), "{stderr}");
    let (code, _, stderr) = nomad(&["down", "listed", "--runs-dir", runs]).await;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("fleet listed is not running"), "{stderr}");
    let (code, stdout, _) = nomad(&["status", "listed", "--runs-dir", runs]).await;
    assert_eq!(code, Some(0));
    assert!(stdout.starts_with("run listed: fleet stopped"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
