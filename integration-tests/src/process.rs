//! Nomad's binaries as child processes: found where the test command built them, started clean
//! of the caller's settings, waited on until they listen, and their refusals read.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// The workspace's built binary `name`. The test command builds them first
/// (`cargo build --workspace --bins`).
pub fn binary(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps, the service binaries one level up; a
    // harness binary (nomad-bench) lives beside them.
    let exe = std::env::current_exe().expect("current_exe");
    let here = exe.parent().expect("exe dir");
    let candidates = [
        here.join(name),
        here.parent().expect("target dir").join(name),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} is missing beside {}: build the services first with \
                 `cargo build --workspace --bins` (add --release for nomad-bench)",
                here.display()
            )
        })
}

/// A command for the Nomad binary `name` with none of the caller's settings that a Nomad
/// process reads (`OTEL_*`, `NOMAD_*`, `SLURM_JOB_ID`), logging at info.
pub fn clean(name: &str) -> Command {
    clean_at(&binary(name))
}

/// [`clean`] for the program at `program`.
pub(crate) fn clean_at(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars() {
        if key.starts_with("OTEL_") || key.starts_with("NOMAD_") || key == "SLURM_JOB_ID" {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUST_LOG", "info");
    cmd
}

/// Waits until `path` holds something (an address a service wrote); panics with the log when
/// the process exits first or 30 s pass.
pub async fn wait_for_file(path: &Path, child: &mut Child, what: &str, log: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && !text.trim().is_empty()
        {
            return text.trim().to_owned();
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{what} exited ({status}) before listening:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "{what} did not start in 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `nomad up --config CONFIG --runs-dir RUNS` with its run id set (its run directory is
/// `RUNS/RUN_ID`), a clean command to add to.
pub fn up_command(config: &Path, runs: &Path, run_id: &str) -> Command {
    let mut command = clean("nomad");
    command
        .arg("up")
        .arg("--config")
        .arg(config)
        .arg("--runs-dir")
        .arg(runs)
        .env("NOMAD_OTEL_RUN_ID", run_id);
    command
}

/// Spawns `command` (`nomad up` or `nomad serve`, its run id set) in the background, stdout
/// discarded and stderr written to `log` (`None`: piped, for the test to read), and waits at most
/// `within` until its run directory `run_dir` holds a `fleet.json` that parses; the child and
/// that file. Panics, with the log where there is one, when the command exits first.
pub async fn start_fleet(
    command: &mut Command,
    run_dir: &Path,
    log: Option<&Path>,
    within: Duration,
) -> (Child, serde_json::Value) {
    command.stdout(std::process::Stdio::null());
    match log {
        Some(log) => command.stderr(std::fs::File::create(log).unwrap()),
        None => command.stderr(std::process::Stdio::piped()),
    };
    let mut child = command.kill_on_drop(true).spawn().unwrap();
    let said = || log.map(|log| std::fs::read_to_string(log).unwrap_or_default());
    let path = run_dir.join("fleet.json");
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(&path)
            && let Ok(fleet) = serde_json::from_str(&text)
        {
            return (child, fleet);
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the fleet exited ({status}) before it was ready:\n{}",
                said().unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the fleet did not start in {within:?}:\n{}",
            said().unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `command` to its end and asserts that it succeeded (else shows its stderr); its output.
pub async fn succeeded(command: &mut Command) -> std::process::Output {
    let output = command.output().await.unwrap();
    assert!(
        output.status.success(),
        "{:?} failed ({}): {}",
        command.as_std().get_program(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// [`succeeded`] for a blocking command.
pub fn succeeded_blocking(command: &mut std::process::Command) -> std::process::Output {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{:?} failed ({}): {}",
        command.get_program(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Sends `signal` to process `pid` (one the test started); one already gone is no error.
pub fn send_signal(pid: impl TryInto<libc::pid_t>, signal: libc::c_int) {
    let Ok(pid) = pid.try_into() else {
        panic!("not a process id")
    };
    // SAFETY: kill(2) takes two integers and touches none of this process's memory.
    unsafe { libc::kill(pid, signal) };
}

/// Waits at most `within` for `child` to exit, panicking with `what` when it does not: its
/// output (what it wrote to piped streams).
pub async fn exited(child: Child, within: Duration, what: &str) -> std::process::Output {
    tokio::time::timeout(within, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {within:?}"))
        .unwrap()
}

/// Starts `command` with its stdout and stderr piped (read at its end), killed if dropped.
pub fn spawn_piped(command: &mut Command) -> Child {
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{:?}: {e}", command.as_std().get_program()))
}

/// Runs `command` to its end and asserts that it failed saying each of `needles` on stderr.
pub async fn refused_saying(command: &mut Command, needles: &[&str]) {
    let output = command.output().await.unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "succeeded: {said}");
    for needle in needles {
        assert!(said.contains(needle), "{needle:?} not in: {said}");
    }
}

/// Starts `command` listening on `listen`, its address written to `<dir>/<stem>.addr` and its
/// stderr to `<dir>/<stem>.stderr` (stdout too when `stdout` is set: `<stem>.stdout`), and waits
/// until it listens: the child and its address.
pub async fn listening(
    mut command: Command,
    listen: &str,
    dir: &Path,
    stem: &str,
    stdout: bool,
) -> (Child, String) {
    let addr_file = dir.join(format!("{stem}.addr"));
    let log = dir.join(format!("{stem}.stderr"));
    if stdout {
        command.stdout(std::fs::File::create(dir.join(format!("{stem}.stdout"))).unwrap());
    }
    let mut child = command
        .args(["--listen", listen, "--addr-file"])
        .arg(&addr_file)
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr = wait_for_file(&addr_file, &mut child, stem, &log).await;
    (child, addr)
}
