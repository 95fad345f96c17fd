//! One sandbox process seen from the gateway: started ahead (warm) or on demand (cold), checked,
//! handed exactly one run, then gone.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::process::Child;
use tokio::sync::{Mutex, OwnedSemaphorePermit};
use tokio::task::JoinHandle;

use super::bridge::{self, Decoder, Message, Response};
use super::cgroup::{Cgroups, RunCgroup, RunLimits};
use super::init::{self, Report, Spec};
use super::{Failure, Outcome, ToolHost, workspace};

/// How to start a sandbox process: the init's spec and the limits the gateway enforces itself.
pub struct Launch {
    pub spec: Spec,
    /// The gateway's private directory (host workspaces go under it when there are no
    /// namespaces).
    pub base: PathBuf,
    /// What a warm runner imports while it waits.
    pub preload: Vec<String>,
    pub stdout_limit: usize,
    pub stderr_limit: usize,
    pub result_limit: usize,
    pub budget: Budget,
}

/// Bridge calls one run may make: at once, and in all.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub in_flight: usize,
    pub total: u64,
}

impl Launch {
    /// Starts a process in `slot`, with its own cgroup where there are cgroups (`warm`: it
    /// preloads modules while it waits).
    pub fn start(
        &self,
        slot: OwnedSemaphorePermit,
        cgroups: Option<&Cgroups>,
        run_limits: RunLimits,
        warm: bool,
    ) -> std::io::Result<Started> {
        let mut spec = self.spec.clone();
        let cgroup = cgroups.map(|c| c.create(run_limits)).transpose()?;
        spec.cgroup = cgroup.as_ref().map(|c| c.path().to_owned());
        let workspace = if spec.namespaces {
            None
        } else {
            let dir = workspace::make_private_dir(&self.base, "run-", 0o700)?;
            if let Some((uid, gid)) = spec.drop_to {
                std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
            }
            spec.host_workspace = Some(dir.clone());
            Some(HostWorkspace(dir))
        };
        if warm {
            spec.args.push("--preload".into());
            spec.args.push(self.preload.join(","));
        }
        let resources = Resources {
            _slot: slot,
            _cgroup: cgroup,
            _workspace: workspace,
        };
        Started::spawn(&spec, resources, warm, self)
    }
}

/// What one run executes.
pub struct Job {
    pub mode: &'static str,
    /// Shown in tracebacks (and `__file__` of a script).
    pub filename: String,
    pub source: String,
    pub env: Vec<(String, String)>,
}

/// A started sandbox process, not yet given its run.
pub struct Started {
    child: Child,
    pgid: Option<i32>,
    bridge: UnixStream,
    decoder: Decoder,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
    /// What the init reported, once read.
    report: Option<Report>,
    resources: Resources,
    pub warm: bool,
}

/// What a sandbox process holds until it is gone; each part does its work when dropped.
pub struct Resources {
    /// Its place among `sandbox.max_concurrent` (given back).
    _slot: OwnedSemaphorePermit,
    /// The run's own cgroup (removed).
    _cgroup: Option<RunCgroup>,
    /// Without namespaces: the run's workspace on the host (removed).
    _workspace: Option<HostWorkspace>,
}

impl Started {
    /// Starts the init with `spec` (the gateway's own binary in `sandbox-init` mode; the bridge
    /// is its standard input, so the spawn needs no code between fork and exec).
    fn spawn(
        spec: &Spec,
        resources: Resources,
        warm: bool,
        launch: &Launch,
    ) -> std::io::Result<Self> {
        let (ours, theirs) = StdUnixStream::pair()?;
        let spec_json = serde_json::to_string(spec)?;
        let mut child = tokio::process::Command::new("/proc/self/exe")
            .arg(init::ARG)
            .arg(spec_json)
            .env_clear()
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        ours.set_nonblocking(true)?;
        let bridge = UnixStream::from_std(ours)?;
        let stdout = tokio::spawn(read_limited(child.stdout.take(), launch.stdout_limit));
        let stderr = tokio::spawn(read_limited(child.stderr.take(), launch.stderr_limit));
        Ok(Self {
            pgid: child.id().map(|p| p as i32),
            child,
            bridge,
            decoder: Decoder::default(),
            stdout,
            stderr,
            report: None,
            resources,
            warm,
        })
    }

    /// Kills a process that failed its check and returns what it wrote on stderr (the init's
    /// own message, when its set-up failed).
    pub async fn stderr_after_failure(mut self) -> String {
        kill(&mut self.child, self.pgid);
        let _ = self.child.wait().await;
        tokio::time::timeout(Duration::from_secs(2), self.stderr)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default()
    }

    /// Whether the process is still there (a warm one could have been killed while waiting).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The init's report (read once), checked against what the gateway promised; with
    /// `until_ready`, also waits for the runner to say its imports are done.
    pub async fn check(
        &mut self,
        expected: Option<&Report>,
        until_ready: bool,
    ) -> Result<Report, Failure> {
        if self.report.is_none() {
            let report: Report = self.read_frame().await?.ok_or_else(setup_failure)?;
            if let Some(expected) = expected
                && !report.as_strong_as(expected)
            {
                return Err(Failure::Spawn(format!(
                    "the sandbox came up with less isolation than at start-up ({report:?}, \
                     expected {expected:?}); refusing to run code in it"
                )));
            }
            self.report = Some(report);
        }
        if until_ready {
            loop {
                let message: Message = self.read_frame().await?.ok_or_else(setup_failure)?;
                if message.method == "ready" {
                    break;
                }
            }
        }
        Ok(self.report.clone().expect("read above"))
    }

    async fn read_frame<T: serde::de::DeserializeOwned>(&mut self) -> Result<Option<T>, Failure> {
        let mut buffer = [0u8; 4096];
        loop {
            if let Some(frame) = self
                .decoder
                .next_as()
                .map_err(|e| Failure::Bridge(e.to_string()))?
            {
                return Ok(Some(frame));
            }
            match self.bridge.read(&mut buffer).await {
                Ok(0) | Err(_) => return Ok(None),
                Ok(n) => self.decoder.push(&buffer[..n]),
            }
        }
    }

    /// Runs `job`, serving its tool calls from `host`, for at most `timeout`.
    pub async fn run(
        mut self,
        job: Job,
        expected: &Report,
        host: &impl ToolHost,
        timeout: Duration,
        launch: &Launch,
    ) -> Outcome {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let prepared = tokio::time::timeout_at(deadline, self.send(job, expected)).await;
        // From here on the parts are used separately; the slot, cgroup and workspace are dropped
        // only at the end, when the process is gone.
        let Started {
            mut child,
            pgid,
            bridge,
            decoder,
            stdout,
            stderr,
            resources: _resources,
            warm,
            ..
        } = self;
        let mut outcome = Outcome {
            result: None,
            failure: None,
            stdout: String::new(),
            stderr: String::new(),
            returncode: None,
            tool_calls: 0,
            duration: Duration::ZERO,
            warm,
        };
        let mut end = BridgeEnd::default();
        let served = match prepared {
            Ok(Ok(())) => {
                let serving = serve(bridge, decoder, host, launch.budget, &mut end);
                let waited = tokio::time::timeout_at(deadline, async {
                    tokio::pin!(serving);
                    tokio::select! {
                        () = &mut serving => child.wait().await,
                        status = child.wait() => {
                            // Gone: what it sent is buffered. A descendant that kept the bridge
                            // open (possible only without a PID namespace) is not waited for.
                            let _ = tokio::time::timeout(Duration::from_millis(500), serving).await;
                            status
                        }
                    }
                })
                .await;
                waited.ok()
            }
            Ok(Err(failure)) => {
                outcome.failure = Some(failure);
                None
            }
            Err(_) => None,
        };
        kill(&mut child, pgid);
        let _ = child.wait().await;
        match served {
            Some(status) => {
                outcome.returncode = status.ok().and_then(|s| s.code());
                outcome.tool_calls = end.tool_calls;
                outcome.failure = match end.done {
                    Some(Done { error: Some(e), .. }) => Some(Failure::Exception {
                        kind: e.kind,
                        message: e.message,
                        traceback: e.traceback,
                    }),
                    Some(Done { result, .. }) => {
                        let bytes = serde_json::to_vec(&result).map_or(0, |v| v.len());
                        if bytes > launch.result_limit {
                            Some(Failure::ResultTooLarge {
                                bytes,
                                limit: launch.result_limit,
                            })
                        } else {
                            outcome.result = Some(result);
                            None
                        }
                    }
                    None if outcome.returncode == Some(init::SETUP_FAILED) => Some(setup_failure()),
                    None => Some(end.error.map_or(Failure::NoResult, Failure::Bridge)),
                };
            }
            None if outcome.failure.is_none() => {
                outcome.failure = Some(Failure::Timeout {
                    seconds: timeout.as_secs_f64(),
                });
            }
            None => {}
        }
        // The pipes close when the process group is gone; never wait on a stray holder forever.
        let collect = |handle: JoinHandle<String>| async move {
            tokio::time::timeout(Duration::from_secs(2), handle)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default()
        };
        outcome.stdout = collect(stdout).await;
        outcome.stderr = collect(stderr).await;
        outcome.duration = started.elapsed();
        outcome
    }

    /// Checks the isolation, then sends the run.
    async fn send(&mut self, job: Job, expected: &Report) -> Result<(), Failure> {
        self.check(Some(expected), false).await?;
        let mut fields = vec![job.mode, job.filename.as_str(), job.source.as_str()];
        for (k, v) in &job.env {
            fields.extend([k.as_str(), v.as_str()]);
        }
        let frame = bridge::encode_run(fields).map_err(|e| Failure::Spawn(e.to_string()))?;
        self.bridge
            .write_all(&frame)
            .await
            .map_err(|e| Failure::Bridge(format!("sending the run: {e}")))
    }
}

/// Kills the whole process group; with namespaces the init is the waiter, whose death takes the
/// PID namespace down with it.
fn kill(child: &mut Child, pgid: Option<i32>) {
    if let Some(pgid) = pgid {
        // SAFETY: kill(2) on the process group of our own child (its init called setsid).
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let _ = child.start_kill();
}

fn setup_failure() -> Failure {
    Failure::Spawn("the sandbox process ended before it was ready (see stderr)".into())
}

/// Reads to the end, keeping the first `limit` bytes (and saying how much was dropped).
async fn read_limited(stream: Option<impl AsyncRead + Unpin>, limit: usize) -> String {
    let Some(mut stream) = stream else {
        return String::new();
    };
    let mut kept = Vec::new();
    let mut total = 0usize;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total += n;
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
    let mut text = String::from_utf8_lossy(&kept).into_owned();
    if total > kept.len() {
        text.push_str(&format!(
            "\n[... {} more bytes dropped: output limit {limit}]",
            total - kept.len()
        ));
    }
    text
}

#[derive(Debug, Deserialize)]
struct DoneError {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    traceback: String,
}

#[derive(Debug, Deserialize)]
struct Done {
    #[serde(default)]
    result: Value,
    #[serde(default)]
    error: Option<DoneError>,
}

#[derive(Debug, Default)]
struct BridgeEnd {
    done: Option<Done>,
    tool_calls: u32,
    /// A protocol violation that ended the bridge.
    error: Option<String>,
}

/// Serves the runner's requests until it closes the bridge. At most `max_calls_in_flight` calls
/// run at once: frames past that stay undecoded in the buffer, and the runner's writes block
/// once the socket fills.
async fn serve(
    stream: UnixStream,
    mut decoder: Decoder,
    host: &impl ToolHost,
    budget: Budget,
    end: &mut BridgeEnd,
) {
    use futures::StreamExt as _;
    let (mut reader, writer) = stream.into_split();
    let writer = Arc::new(Mutex::new(writer));
    let mut buffer = vec![0u8; 64 << 10];
    let mut calls = futures::stream::FuturesUnordered::new();
    let mut total_calls = 0u64;
    let mut eof = false;
    loop {
        // Take every frame the budget allows before reading more.
        while calls.len() < budget.in_flight {
            let message = match decoder.next_frame() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    end.error = Some(e.to_string());
                    eof = true;
                    break;
                }
            };
            match message.method.as_str() {
                "done" => {
                    end.done = serde_json::from_value(message.params).ok();
                    continue;
                }
                "ready" => continue,
                _ => {}
            }
            let Some(id) = message.id else { continue };
            let budget_left = total_calls < budget.total;
            total_calls += 1;
            if message.method == "call_tool" {
                end.tool_calls = end.tool_calls.saturating_add(1);
            }
            let writer = writer.clone();
            let max = budget.total;
            calls.push(async move {
                let response = if budget_left {
                    handle(host, id, &message.method, message.params).await
                } else {
                    Response::error(
                        id,
                        format!(
                            "this run has used its {max} bridge calls (sandbox.max_tool_calls)"
                        ),
                    )
                };
                if let Ok(frame) = bridge::encode(&response)
                    .or_else(|e| bridge::encode(&Response::error(id, e.to_string())))
                {
                    let _ = writer.lock().await.write_all(&frame).await;
                }
            });
        }
        if eof && calls.is_empty() {
            break;
        }
        tokio::select! {
            read = reader.read(&mut buffer), if !eof && calls.len() < budget.in_flight => {
                match read {
                    Ok(0) | Err(_) => eof = true,
                    Ok(n) => decoder.push(&buffer[..n]),
                }
            }
            Some(()) = calls.next(), if !calls.is_empty() => {}
        }
    }
}

async fn handle(host: &impl ToolHost, id: u64, method: &str, params: Value) -> Response {
    let text = |key: &str| {
        params
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    match method {
        "list_servers" => Response::ok(id, serde_json::json!(host.servers())),
        "list_tools" => match host.tools(&text("server")).await {
            Ok(tools) => Response::ok(id, serde_json::to_value(tools).unwrap_or_default()),
            Err(e) => Response::error(id, e),
        },
        "call_tool" => {
            let arguments = params
                .get("arguments")
                .cloned()
                .unwrap_or(Value::Object(Default::default()));
            match host.call(&text("server"), &text("tool"), arguments).await {
                Ok(value) => Response::ok(id, value),
                Err(e) => Response::error(id, e),
            }
        }
        other => Response::error(id, format!("unknown bridge method {other:?}")),
    }
}

/// The host workspace of a run without namespaces: removed off the async runtime once the run is
/// over, with permissions restored first so no `chmod 000` keeps it.
pub struct HostWorkspace(pub PathBuf);

impl Drop for HostWorkspace {
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.0);
        let remove = move || super::workspace::remove_tree(&path);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts calls in flight; each takes 20 ms.
    #[derive(Default)]
    struct Slow {
        now: AtomicUsize,
        most: AtomicUsize,
        calls: AtomicUsize,
    }

    impl ToolHost for Slow {
        fn servers(&self) -> Vec<String> {
            vec!["s".into()]
        }

        async fn tools(&self, _server: &str) -> Result<Vec<super::super::ToolSpec>, String> {
            Ok(Vec::new())
        }

        async fn call(
            &self,
            _server: &str,
            _tool: &str,
            arguments: Value,
        ) -> Result<Value, String> {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            Ok(arguments)
        }
    }

    #[tokio::test]
    async fn frames_past_the_in_flight_budget_wait_and_the_total_budget_refuses() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        // 40 calls written at once, so every frame is in the first reads.
        let mut frames = Vec::new();
        for id in 1..=40u64 {
            frames.extend(
                bridge::encode(&serde_json::json!({
                    "id": id, "method": "call_tool",
                    "params": {"server": "s", "tool": "t", "arguments": {"n": id}}
                }))
                .unwrap(),
            );
        }
        theirs.write_all(&frames).await.unwrap();
        let host = Slow::default();
        let budget = Budget {
            in_flight: 4,
            total: 30,
        };
        let mut end = BridgeEnd::default();
        let reader = tokio::spawn(async move {
            let mut decoder = Decoder::default();
            let mut replies = Vec::new();
            let mut buffer = [0u8; 4096];
            while replies.len() < 40 {
                let n = theirs.read(&mut buffer).await.unwrap();
                decoder.push(&buffer[..n]);
                while let Some(reply) = decoder.next_as::<Value>().unwrap() {
                    replies.push(reply);
                }
            }
            replies
        });
        let served = serve(ours, Decoder::default(), &host, budget, &mut end);
        let (_, replies) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(10), served),
            reader
        );
        let replies = replies.unwrap();
        assert!(
            host.most.load(Ordering::SeqCst) <= 4,
            "{} at once",
            host.most.load(Ordering::SeqCst)
        );
        assert_eq!(
            host.calls.load(Ordering::SeqCst),
            30,
            "the host served past the total budget"
        );
        let refused = replies
            .iter()
            .filter(|r| {
                r["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("sandbox.max_tool_calls"))
            })
            .count();
        assert_eq!(refused, 10);
        assert_eq!(end.tool_calls, 40);
    }
}
