//! One sandbox process seen from the gateway: started ahead (warm) or on demand (cold), checked,
//! handed exactly one run, then gone.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::process::Child;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use super::bridge::{self, Decoder, Message};
use super::calls::{BridgeEnd, BridgeMemory, Budget, Done, serve};
use super::cgroup::{Cgroups, RunCgroup, RunLimits};
use super::first_process::{self, FirstProcess};
use super::fork_server::{ForkServer, ForkServers, Forked};
use super::init::{self, Report, Spec};
use super::memory::{self, Share};
use super::{Failure, Outcome, ToolHost, workspace};
use std::sync::Arc;

/// How to start a sandbox process: the init's spec and the limits the gateway enforces itself.
#[derive(Clone)]
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
    /// Largest tool call the run may send (`sandbox.max_call_bytes`).
    pub call_limit: usize,
    pub budget: Budget,
    /// What all runs' bridges may hold in the gateway at once.
    pub bridge_memory: BridgeMemory,
    /// Without a cgroup: the bytes all of a run's processes may hold together, which the
    /// gateway samples (see [`super::memory`]).
    pub memory_watch: Option<u64>,
    /// Runs are forked from the fork server in use when there is one (and runs have no cgroup
    /// of their own).
    pub fork_server: Option<Arc<ForkServers>>,
}

impl Launch {
    /// The largest frame the gateway takes from this run: a tool call, or the end of the run
    /// (RESULT, or an exception's message and traceback, each of which the runner cuts to these
    /// limits), with room for the framing. Anything larger ends the run before the gateway
    /// holds or parses it.
    pub fn frame_limit(&self) -> usize {
        self.call_limit
            .max(self.result_limit)
            .max(2 * self.stderr_limit)
            + (64 << 10)
    }

    /// What the runner is told of the limits: `call,result,text` in bytes.
    fn runner_limits(&self) -> String {
        format!(
            "{},{},{}",
            self.call_limit, self.result_limit, self.stderr_limit
        )
    }

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
        let fork_server = self.fork_server.as_ref().and_then(|s| s.current());
        match fork_server {
            Some(server) if resources._cgroup.is_none() && spec.namespaces => {
                match Started::fork(&server, resources, warm, self)? {
                    Ok(started) => Ok(started),
                    Err(resources) => {
                        // It died just now: let it be replaced, and start this run cold.
                        let _ = self.fork_server.as_ref().map(|s| s.current());
                        Started::spawn(&spec, resources, warm, self)
                    }
                }
            }
            _ => Started::spawn(&spec, resources, warm, self),
        }
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

/// The processes behind a run: its waiter (the init the gateway started, or the fork server's
/// child), and once the run has reported, its first process, by which the gateway ends it.
struct Proc {
    waiter: Waiter,
    first: Option<FirstProcess>,
}

enum Waiter {
    Spawned { child: Child, pgid: Option<i32> },
    Forked(Forked),
}

impl Proc {
    /// Kills the whole run: its first process, whose namespace the kernel then empties; before
    /// it has reported (no code of the run's has run yet), its waiter, whose death kills it. A
    /// spawned run's init and its process group go too (all there is to kill of a run without
    /// namespaces).
    fn kill(&mut self) {
        let killed = match &self.first {
            Some(first) => first
                .kill()
                .inspect_err(|e| tracing::error!(pid = first.pid, "killing a sandboxed run: {e}"))
                .is_ok(),
            None => false,
        };
        match &mut self.waiter {
            Waiter::Spawned { child, pgid } => kill(child, *pgid),
            Waiter::Forked(forked) if !killed => forked.kill(),
            Waiter::Forked(_) => {}
        }
    }

    /// The exit code, once the run has ended, its namespace empty (`None`: killed by a signal,
    /// or not known).
    async fn wait(&mut self) -> Option<i32> {
        if let Some(first) = &self.first {
            first.gone().await;
        }
        let code = match &mut self.waiter {
            Waiter::Spawned { child, .. } => child.wait().await.ok().and_then(|s| s.code()),
            Waiter::Forked(forked) => forked.wait().await,
        };
        // The waiters end with 128 + the signal that killed the run.
        code.filter(|c| *c < 128)
    }

    fn alive(&mut self) -> bool {
        match &mut self.waiter {
            Waiter::Spawned { child, .. } => matches!(child.try_wait(), Ok(None)),
            Waiter::Forked(forked) => forked.alive(),
        }
    }

    /// PID 1 of the run's namespace as the gateway sees it (for the memory watch).
    fn pid(&self) -> Option<u32> {
        self.first.as_ref().map(|f| f.pid)
    }
}

/// A started sandbox process, not yet given its run.
pub struct Started {
    process: Proc,
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
    /// is its standard input, so the spawn needs no code between fork and exec). The spec is the
    /// bridge's first frame, not an argument: a command line is anyone's to read in `ps`.
    fn spawn(
        spec: &Spec,
        resources: Resources,
        warm: bool,
        launch: &Launch,
    ) -> std::io::Result<Self> {
        let (ours, mut command) = init::command(spec)?;
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdout = tokio::spawn(read_limited(child.stdout.take(), launch.stdout_limit));
        let stderr = tokio::spawn(read_limited(child.stderr.take(), launch.stderr_limit));
        let process = Proc {
            waiter: Waiter::Spawned {
                pgid: child.id().map(|p| p as i32),
                child,
            },
            first: None,
        };
        Self::new(process, ours, (stdout, stderr), resources, warm, launch)
    }

    /// Asks the fork server for a child with a new bridge and output pipes of its own.
    /// A run forked by `server`; `Ok(Err(resources))` when the server turned out to be gone
    /// (the caller starts the run another way).
    fn fork(
        server: &Arc<ForkServer>,
        resources: Resources,
        warm: bool,
        launch: &Launch,
    ) -> std::io::Result<Result<Self, Resources>> {
        use std::os::fd::AsFd as _;
        let (ours, theirs) = StdUnixStream::pair()?;
        let (out_read, out_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (err_read, err_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let forked = match server.fork([theirs.as_fd(), out_write.as_fd(), err_write.as_fd()]) {
            Ok(forked) => forked,
            Err(e) if !server.alive() => {
                tracing::warn!("the sandbox's fork server is gone ({e}); this run starts cold");
                return Ok(Err(resources));
            }
            Err(e) => return Err(e),
        };
        drop((theirs, out_write, err_write));
        let pipe = |fd: OwnedFd| tokio::net::unix::pipe::Receiver::from_owned_fd(fd);
        let stdout = tokio::spawn(read_limited(Some(pipe(out_read)?), launch.stdout_limit));
        let stderr = tokio::spawn(read_limited(Some(pipe(err_read)?), launch.stderr_limit));
        let process = Proc {
            waiter: Waiter::Forked(forked),
            first: None,
        };
        Self::new(process, ours, (stdout, stderr), resources, warm, launch).map(Ok)
    }

    /// A started process with its bridge (made non-blocking here) and output readers.
    fn new(
        process: Proc,
        bridge: StdUnixStream,
        (stdout, stderr): (JoinHandle<String>, JoinHandle<String>),
        resources: Resources,
        warm: bool,
        launch: &Launch,
    ) -> std::io::Result<Self> {
        bridge.set_nonblocking(true)?;
        Ok(Self {
            process,
            bridge: UnixStream::from_std(bridge)?,
            decoder: bridge::decoder(launch.frame_limit()),
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
        self.process.kill();
        let _ = self.process.wait().await;
        tokio::time::timeout(Duration::from_secs(2), self.stderr)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default()
    }

    /// Kills a process that will not be used, once it is gone gives back its slot.
    pub async fn abandon(mut self) -> OwnedSemaphorePermit {
        self.process.kill();
        let _ = tokio::time::timeout(first_process::GONE_WITHIN, self.process.wait()).await;
        self.resources._slot
    }

    /// Whether the process is still there (a warm one could have been killed while waiting).
    pub fn alive(&mut self) -> bool {
        self.process.alive()
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
            if self.process.first.is_none() {
                return Err(Failure::Spawn(
                    "the sandbox reported without a pidfd of its first process, so the gateway \
                     could not end the run as a whole; refusing to run code in it"
                        .into(),
                ));
            }
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
                if message.method == bridge::Method::Ready {
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
                .map_err(|e| Failure::Bridge(bridge::refused(&e)))?
            {
                return Ok(Some(frame));
            }
            match self.read_some(&mut buffer).await {
                Ok(0) | Err(_) => return Ok(None),
                Ok(n) => self.decoder.push(&buffer[..n]),
            }
        }
    }

    /// Reads what the bridge holds. Until the report is in, with the descriptor that comes with
    /// it: a pidfd of the run's first process.
    async fn read_some(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let Self {
            process, bridge, ..
        } = self;
        if process.first.is_some() {
            return bridge.read(buffer).await;
        }
        let (n, pidfd) = bridge
            .async_io(tokio::io::Interest::READABLE, || {
                recv_with_fd(bridge.as_raw_fd(), buffer)
            })
            .await?;
        if let Some(pidfd) = pidfd {
            process.first = Some(FirstProcess::new(pidfd)?);
        }
        Ok(n)
    }

    /// The fork server this process was forked from, if it was.
    pub fn fork_server(&self) -> Option<&Arc<ForkServer>> {
        match &self.process.waiter {
            Waiter::Forked(forked) => Some(forked.server()),
            Waiter::Spawned { .. } => None,
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
        memory: &mut Share,
    ) -> Outcome {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let prepared = tokio::time::timeout_at(deadline, self.send(job, expected, launch)).await;
        // From here on the parts are used separately; the slot, cgroup and workspace are dropped
        // only at the end, when the process is gone.
        let Started {
            mut process,
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
            queue_wait: Duration::ZERO,
        };
        let mut end = BridgeEnd::default();
        let mut over_memory = None;
        let served = match prepared {
            Ok(Ok(())) => {
                let serving = serve(
                    bridge,
                    decoder,
                    host,
                    launch.budget,
                    &launch.bridge_memory,
                    &mut end,
                );
                let pid = process.pid();
                let own_tmpfs = launch.spec.namespaces;
                // Sampled always, for the runs' budget; a limit only where no cgroup is one.
                let watch = async move {
                    match pid {
                        Some(pid) => {
                            memory::watch(pid, own_tmpfs, launch.memory_watch, memory).await
                        }
                        None => std::future::pending().await,
                    }
                };
                let waited = tokio::time::timeout_at(deadline, async {
                    tokio::pin!(serving);
                    tokio::select! {
                        () = &mut serving => process.wait().await,
                        status = process.wait() => {
                            // Gone: what it sent is buffered. A descendant that kept the bridge
                            // open (possible only without a PID namespace) is not waited for.
                            let _ = tokio::time::timeout(Duration::from_millis(500), serving).await;
                            status
                        }
                        held = watch => {
                            over_memory = Some(held);
                            process.kill();
                            process.wait().await
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
        // Whatever the run did, it is counted (its slot, its memory) until it is gone.
        process.kill();
        if tokio::time::timeout(first_process::GONE_WITHIN, process.wait())
            .await
            .is_err()
        {
            tracing::error!(
                pid = process.pid(),
                "a killed sandboxed run was not gone within {} s; its slot is let go",
                first_process::GONE_WITHIN.as_secs()
            );
        }
        match served {
            Some(status) => {
                outcome.returncode = status;
                outcome.tool_calls = end.tool_calls;
                outcome.failure = match end.done {
                    // An exception's text is the run's own, bounded as its stderr is.
                    Some(Done { error: Some(e), .. }) => Some(Failure::Exception {
                        kind: clip(e.kind, 256),
                        message: clip(e.message, launch.stderr_limit),
                        traceback: clip(e.traceback, launch.stderr_limit),
                    }),
                    // The runner did not send a RESULT over the limit, only its size.
                    Some(Done {
                        result_bytes: Some(bytes),
                        ..
                    }) if bytes > launch.result_limit => Some(Failure::ResultTooLarge {
                        bytes,
                        limit: launch.result_limit,
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
                if let (Some(bytes), Some(limit)) = (over_memory, launch.memory_watch) {
                    outcome.result = None;
                    outcome.failure = Some(Failure::Memory { bytes, limit });
                }
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
    async fn send(&mut self, job: Job, expected: &Report, launch: &Launch) -> Result<(), Failure> {
        self.check(Some(expected), false).await?;
        let limits = launch.runner_limits();
        let mut fields = vec![
            job.mode,
            job.filename.as_str(),
            job.source.as_str(),
            limits.as_str(),
        ];
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

/// One read of the bridge, and the first descriptor that came with it (any others are closed).
fn recv_with_fd(
    fd: std::os::fd::RawFd,
    buffer: &mut [u8],
) -> std::io::Result<(usize, Option<OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::FromRawFd as _;
    let mut iov = [std::io::IoSliceMut::new(buffer)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    let message = recvmsg::<()>(
        fd,
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut received = Vec::new();
    for cmsg in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            // SAFETY: descriptors the kernel just installed in this process for this message.
            received.extend(
                fds.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((message.bytes, received.into_iter().next()))
}

/// Kills the init's whole process group (its waiter, whose death takes the view's PID namespace,
/// and so the run's, down with it).
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

/// `text` cut to at most `limit` bytes at a character boundary, saying how much there was.
fn clip(text: String, limit: usize) -> String {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}… ({} bytes in all, cut at {limit})",
        &text[..end],
        text.len()
    )
}
