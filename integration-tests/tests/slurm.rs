//! `nomad submit` on a real Slurm cluster: the two-node local cluster of `scripts/slurm-local`
//! (Debian's slurm-wlm and munge; `scripts/test` starts it). A job runs the collector, the
//! scheduler, the gateway, one CPU worker step per node and the driver; the tests read back what
//! a user would: the exit status, results.jsonl, the collector's otel/*.jsonl, job.out.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::process::clean;
use nomad_integration_tests::spans::{SpanRecord, check_rollout_traces, from_console};
use nomad_integration_tests::{Fleet, read_jsonl, wait_until};
use serde_json::Value;

/// One job at a time: the two nodes have two cores between them.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn slurm_conf() -> String {
    let conf = std::env::var("SLURM_CONF").unwrap_or_else(|_| "/tmp/nomad-slurm/slurm.conf".into());
    assert!(
        Path::new(&conf).is_file(),
        "no Slurm cluster: {conf} is missing; start one with scripts/slurm-local start \
         (scripts/test does, as root) and export the SLURM_CONF it prints"
    );
    conf
}

fn slurm(program: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(program)
        .args(args)
        .env("SLURM_CONF", slurm_conf())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `nomad submit ARGS` in `dir`; the cluster's jobs are visible to it.
async fn submit(dir: &Path, args: &[&str]) -> Output {
    clean("nomad")
        .arg("submit")
        .args(args)
        .args(["--models-dir", models_dir().to_str().unwrap()])
        .env("SLURM_CONF", slurm_conf())
        .current_dir(dir)
        .output()
        .await
        .unwrap()
}

/// Submits a job that must be accepted: its output, its job id and its run directory.
async fn accepted(dir: &Path, args: &[&str]) -> (Output, String, PathBuf) {
    let out = submit(dir, args).await;
    assert!(out.status.success(), "{}", text(&out));
    let job = job_id(&out);
    let run_dir = dir.join("runs").join(&job);
    (out, job, run_dir)
}

/// A job `args` submits, once its results file holds `results` lines: its id and run directory.
async fn underway(dir: &Path, args: &[&str], results: usize) -> (String, PathBuf) {
    let (_, job, run_dir) = accepted(dir, args).await;
    let path = run_dir.join("results.jsonl");
    wait_until(
        &format!("{results} results"),
        Duration::from_secs(180),
        || read_jsonl(&path).len() >= results,
    )
    .await;
    (job, run_dir)
}

fn spans(run_dir: &Path) -> Vec<SpanRecord> {
    let text = std::fs::read_to_string(run_dir.join("otel/traces.jsonl")).unwrap_or_default();
    from_console(&text)
}

fn text(out: &Output) -> String {
    format!(
        "exit {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn job_id(out: &Output) -> String {
    let id = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    assert!(
        !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()),
        "no job id on the first line of stdout: {}",
        text(out)
    );
    id
}

fn in_queue(job: &str) -> bool {
    !slurm("squeue", &["-h", "-j", job]).trim().is_empty()
}

/// Processes whose command line names `needle` (the run directory), other than this one.
fn processes_naming(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) {
                found.push(format!("{pid}: {cmd}"));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_job_on_two_nodes_is_one_trace_per_rollout_from_all_four_services() {
    let _cluster = CLUSTER.lock().await;
    let dir = Fleet::new_dir();
    let (out, job, run_dir) = accepted(&dir, &["--nodes", "2", "--demo", "--wait"]).await;

    let script = std::fs::read_to_string(run_dir.join("job.sbatch")).unwrap();
    assert!(script.contains("#SBATCH --nodes=2"), "{script}");
    let results = read_jsonl(&run_dir.join("results.jsonl"));
    assert_eq!(results.len(), 20, "{}", text(&out));
    assert!(results.iter().all(|r| r["status"] == "ok"), "{results:?}");
    // The run id is the job id.
    assert!(
        results.iter().all(|r| r["run_id"] == job.as_str()),
        "{results:?}"
    );

    let spans = spans(&run_dir);
    check_rollout_traces(&spans, &results, &job);
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service_name.as_str()).collect();
    assert_eq!(
        services,
        BTreeSet::from([
            "nomad/device-worker",
            "nomad/gateway",
            "nomad/head",
            "nomad/scheduler"
        ])
    );
    for s in &spans {
        assert_eq!(
            s.resource.get("slurm.job.id").map(String::as_str),
            Some(job.as_str())
        );
    }
    // Both nodes' workers registered and served: their spans say which node they ran on.
    let worker_nodes: BTreeSet<&str> = spans
        .iter()
        .filter(|s| s.service_name == "nomad/device-worker")
        .filter_map(|s| s.resource.get("slurm.node.name").map(String::as_str))
        .collect();
    assert_eq!(worker_nodes, BTreeSet::from(["n1", "n2"]));
    let metrics = read_jsonl(&run_dir.join("otel/metrics.jsonl"));
    assert!(
        metrics
            .iter()
            .any(|m| m["name"] == "nomad.tool.request.duration"),
        "the collector wrote no serving metrics"
    );

    // `nomad traces --from` reads the collector's files like a run directory.
    let traces = clean("nomad")
        .args(["traces", &job, "--json", "--from"])
        .arg(&run_dir)
        .output()
        .await
        .unwrap();
    assert!(traces.status.success(), "{}", text(&traces));
    let rollouts: Value = serde_json::from_slice(&traces.stdout).unwrap();
    assert_eq!(rollouts.as_array().map(Vec::len), Some(20));

    let status = clean("nomad")
        .args(["status", &job, "--runs-dir"])
        .arg(dir.join("runs"))
        .env("SLURM_CONF", slurm_conf())
        .output()
        .await
        .unwrap();
    let status_text = String::from_utf8_lossy(&status.stdout);
    assert!(
        status_text.contains("rollouts: 20 of 20 done, 0 failed"),
        "{}",
        text(&status)
    );
    assert!(processes_naming(run_dir.to_str().unwrap()).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_step_killed_mid_run_is_started_again_and_loses_no_request() {
    let _cluster = CLUSTER.lock().await;
    let dir = Fleet::new_dir();
    let (job, run_dir) = underway(&dir, &["--nodes", "2", "--demo", "--concurrency", "4"], 1).await;
    let step = slurm("squeue", &["-h", "-s", "-j", &job, "-o", "%i %j"])
        .lines()
        .find_map(|l| l.strip_suffix(" worker-n2").map(str::to_owned))
        .expect("a worker-n2 step");
    slurm("scancel", &["--signal=KILL", &step]);
    wait_until("the job's end", Duration::from_secs(180), || {
        !in_queue(&job)
    })
    .await;

    let results = read_jsonl(&run_dir.join("results.jsonl"));
    assert_eq!(results.len(), 20);
    assert!(
        results.iter().all(|r| r["status"] == "ok"),
        "a request was lost with the worker: {results:?}"
    );
    let driver: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("driver.json")).unwrap())
            .unwrap();
    assert_eq!(driver["status"], "ok");
    // The dead step was started again within the job, and the run went on.
    let output = std::fs::read_to_string(run_dir.join("job.out")).unwrap();
    assert!(
        output.contains("worker-n2 exited") && output.contains("starting it again"),
        "{output}"
    );
    let servers: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("servers.json")).unwrap())
            .unwrap();
    let worker = servers["servers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "worker-n2")
        .unwrap();
    assert_eq!(worker["restarts"], 1, "{servers}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scancel_stops_every_step_and_the_collector_keeps_what_was_flushed() {
    let _cluster = CLUSTER.lock().await;
    let dir = Fleet::new_dir();
    let (job, run_dir) = underway(&dir, &["--nodes", "2", "--demo", "--concurrency", "2"], 2).await;
    slurm("scancel", &[&job]);
    wait_until("the job's end", Duration::from_secs(120), || {
        !in_queue(&job)
    })
    .await;
    wait_until(
        "every step's process to end",
        Duration::from_secs(30),
        || processes_naming(run_dir.to_str().unwrap()).is_empty(),
    )
    .await;

    let driver: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("driver.json")).unwrap())
            .unwrap();
    assert_eq!(driver["status"], "cancelled");
    let collector = std::fs::read_to_string(run_dir.join("collector.log")).unwrap();
    assert!(collector.contains("nomad collect: stopped;"), "{collector}");
    // Every finished rollout's trace reached the collector: the head flushed at SIGTERM.
    let results = read_jsonl(&run_dir.join("results.jsonl"));
    let spans = spans(&run_dir);
    for result in &results {
        let id = result["rollout_id"].as_str().unwrap();
        assert!(
            spans
                .iter()
                .any(|s| s.name == "nomad.rollout" && s.attr("nomad.rollout.id") == Some(id)),
            "rollout {id} finished but its span is not in otel/traces.jsonl"
        );
    }
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service_name.as_str()).collect();
    assert!(services.len() == 4, "{services:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_submissions_are_refused_before_anything_is_submitted() {
    let dir = Fleet::new_dir();
    for (args, expected) in [
        (
            vec!["--nodes", "0", "--demo"],
            "--nodes must be at least 1 (got 0)",
        ),
        (
            vec!["--partition", "no-such-partition", "--demo"],
            "unknown partition \"no-such-partition\": sinfo lists debug",
        ),
        (vec!["--nodes", "2"], "--demo"),
        (
            vec!["--demo", "--sbatch-arg", "qos=high"],
            "is not one sbatch option",
        ),
    ] {
        let out = submit(&dir, &args).await;
        assert!(
            !out.status.success(),
            "{args:?} was accepted: {}",
            text(&out)
        );
        assert!(
            out.stdout.is_empty(),
            "{args:?} printed a job id: {}",
            text(&out)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    assert!(
        !dir.join("runs").exists(),
        "a refused submission made a run directory"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
