//! Proving the sandbox works before it serves: a first run under every layer, and a first run
//! forked from the fork server, which is used only if it comes up as isolated.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::Semaphore;

use super::init::Report;
use super::process::{Job, Launch};
use super::{ToolHost, ToolSpec, cgroup, fork_server, memory};
use crate::tool_error::ToolError;

/// The fork server, when it starts and a run forked from it comes up at least as isolated as
/// `expected` and runs; else `None` (runs start an interpreter each), said in the log.
pub async fn start_fork_server(
    launch: &Launch,
    expected: &Report,
    run_limits: cgroup::RunLimits,
) -> Option<Arc<fork_server::ForkServer>> {
    let tried = async {
        let server = fork_server::ForkServer::start(&launch.spec, &launch.preload)
            .await
            .map_err(|e| format!("starting it: {e}"))?;
        let forking = Launch {
            fork_server: Some(fork_server::ForkServers::new(server.clone())),
            ..launch.clone()
        };
        let (report, forked) = self_test(&forking, None, run_limits).await?;
        if !forked {
            return Err("its test run was not forked from it".into());
        }
        if !report.as_strong_as(expected) {
            return Err(format!(
                "its runs come up with less isolation ({report:?}, expected {expected:?})"
            ));
        }
        Ok(server)
    };
    match tried.await {
        Ok(server) => {
            tracing::info!("sandbox runs are forked from a fork server with the runtime imported");
            Some(server)
        }
        Err(e) => {
            tracing::warn!("sandbox fork server not used, each run starts an interpreter: {e}");
            None
        }
    }
}

/// Starts one process cold, outside the pool, and runs `RESULT = 1` in it; its report, and
/// whether it was forked.
pub async fn self_test(
    launch: &Launch,
    cgroups: Option<&cgroup::Cgroups>,
    run_limits: cgroup::RunLimits,
) -> Result<(Report, bool), String> {
    let slot = Arc::new(Semaphore::new(1))
        .try_acquire_owned()
        .expect("a fresh semaphore");
    let mut process = launch
        .start(slot, cgroups, run_limits, false)
        .map_err(|e| format!("starting the sandbox: {e}"))?;
    let forked = process.fork_server().is_some();
    let report = match process.check(None, false).await {
        Ok(report) => report,
        Err(failure) => {
            let stderr = process.stderr_after_failure().await;
            return Err(format!("{} ({})", failure.describe(), stderr.trim()));
        }
    };
    let job = Job {
        mode: "code",
        filename: "<self-test>".into(),
        source: "RESULT = 1".into(),
        env: Vec::new(),
    };
    let started = Instant::now();
    // Counted against a budget of its own: no run is admitted yet.
    let mut memory = memory::Ledger::new(u64::MAX)
        .try_admit()
        .expect("an empty ledger admits a run");
    let outcome = process
        .run(
            job,
            &report,
            &NoTools,
            Duration::from_secs(30),
            launch,
            &mut memory,
        )
        .await;
    match (&outcome.failure, &outcome.result) {
        (None, Some(Value::Number(_))) => {
            tracing::debug!(
                seconds = started.elapsed().as_secs_f64(),
                "sandbox self-test"
            );
            Ok((report, forked))
        }
        (Some(f), _) => Err(format!(
            "{} (stderr: {})",
            f.describe(),
            outcome.stderr.trim()
        )),
        _ => Err(format!("unexpected result {:?}", outcome.result)),
    }
}

/// A host with no tools (the start-up self-test).
struct NoTools;

impl ToolHost for NoTools {
    fn servers(&self) -> Vec<String> {
        Vec::new()
    }

    async fn tools(&self, server: &str) -> Result<Vec<ToolSpec>, ToolError> {
        Err(ToolError::not_found(format!("no server {server:?}")))
    }

    async fn call(&self, server: &str, tool: &str, _arguments: Value) -> Result<Value, ToolError> {
        Err(ToolError::not_found(format!("no tool {server}.{tool}")))
    }
}
