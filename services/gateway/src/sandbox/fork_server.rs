//! The fork server: one sandboxed interpreter (`zygote.py`) with the runtime imported, which
//! forks a child per run into namespaces of its own, so a run's start costs a fork, not a Python
//! start-up and its imports.
//!
//! The zygote is started by `sandbox-init` as a run is (namespaces, the filesystem view), but
//! as root of its own user namespace and with no other restriction: each child puts the run's in
//! force itself and reports them, and the gateway checks that report as it checks any run's.
//! The control socket carries JSON frames: the gateway's settings first, then `fork` (with the
//! run's bridge, stdout and stderr as SCM_RIGHTS) and `kill`; the zygote answers `exited`.

use std::collections::HashMap;
use std::io::Write as _;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::json;
use tokio::sync::oneshot;

use super::bridge;
use super::init::{self, Spec};

/// What the zygote tells each child (the run's limits and what to enforce).
fn settings(spec: &Spec) -> std::io::Result<serde_json::Value> {
    let (read, write) = init::landlock_paths(spec);
    let seccomp = if spec.seccomp {
        super::seccomp::programs()
            .map_err(std::io::Error::other)?
            .iter()
            .map(|program| {
                program
                    .iter()
                    .flat_map(|f| {
                        let mut raw = Vec::with_capacity(8);
                        raw.extend(f.code.to_le_bytes());
                        raw.extend([f.jt, f.jf]);
                        raw.extend(f.k.to_le_bytes());
                        raw
                    })
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(json!({
        "disk_bytes": spec.disk_bytes,
        "max_files": spec.max_files,
        "limits": spec.limits,
        "read": read,
        "write": write,
        "landlock": spec.landlock,
        "seccomp": seccomp,
        "proc": spec.proc,
        "niceness": init::RUN_NICENESS,
    }))
}

pub struct ForkServer {
    control: Mutex<UnixStream>,
    exits: Arc<Mutex<HashMap<u64, oneshot::Sender<i32>>>>,
    next: AtomicU64,
    alive: Arc<AtomicBool>,
    _zygote: tokio::process::Child,
}

#[derive(Deserialize)]
struct Exited {
    id: u64,
    code: i32,
}

impl ForkServer {
    /// Starts the zygote from `spec` (a run's spec; `args` are the runner's) and sends it its
    /// settings.
    pub async fn start(spec: &Spec, preload: &[String]) -> std::io::Result<Arc<Self>> {
        let mut spec = spec.clone();
        spec.zygote = true;
        spec.cgroup = None;
        spec.args.push("--zygote".into());
        spec.args.push(preload.join(","));
        let (mut ours, mut command) = init::command(&spec)?;
        let mut zygote = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(stderr) = zygote.stderr.take() {
            tokio::spawn(log_lines(stderr));
        }
        // The init's report of the zygote's own namespaces (its children report the run's).
        let reader = ours.try_clone()?;
        // Bounded: a read that never ends would hold the gateway's start-up (the zygote is
        // killed with its handle when this gives up).
        reader.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
        let report = tokio::task::spawn_blocking(move || read_frame(&reader))
            .await
            .map_err(std::io::Error::other)??
            .ok_or_else(|| std::io::Error::other("the zygote ended before it was set up"))?;
        // The timeout is the socket's, shared by every handle: the exits reader waits unbounded.
        ours.set_read_timeout(None)?;
        let report: init::Report = serde_json::from_slice(&report)?;
        if !report.namespaces {
            return Err(std::io::Error::other("the zygote has no namespaces"));
        }
        let settings = bridge::encode(&settings(&spec)?).map_err(std::io::Error::other)?;
        ours.write_all(&settings)?;
        let server = Arc::new(Self {
            control: Mutex::new(ours.try_clone()?),
            exits: Arc::default(),
            next: AtomicU64::new(1),
            alive: Arc::new(AtomicBool::new(true)),
            _zygote: zygote,
        });
        let (exits, alive) = (server.exits.clone(), server.alive.clone());
        std::thread::Builder::new()
            .name("nomad-zygote".into())
            .spawn(move || {
                while let Ok(Some(body)) = read_frame(&ours) {
                    if let Ok(exited) = serde_json::from_slice::<Exited>(&body)
                        && let Some(tx) = lock(&exits).remove(&exited.id)
                    {
                        let _ = tx.send(exited.code);
                    }
                }
                // Gone: every child it had is gone with it (their waiters die with it).
                tracing::warn!(
                    "the sandbox's fork server ended; from now on each run starts an interpreter"
                );
                alive.store(false, Ordering::Release);
                lock(&exits).clear();
            })?;
        Ok(server)
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Asks for a child with `fds` (bridge, stdout, stderr) as its descriptors.
    pub fn fork(self: &Arc<Self>, fds: [BorrowedFd<'_>; 3]) -> std::io::Result<Forked> {
        if !self.alive() {
            return Err(std::io::Error::other("the sandbox's fork server is gone"));
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.exits).insert(id, tx);
        let frame =
            bridge::encode(&json!({"method": "fork", "id": id})).map_err(std::io::Error::other)?;
        let raw = fds.map(|f| f.as_raw_fd());
        let control = lock(&self.control);
        let sent = nix::sys::socket::sendmsg::<()>(
            control.as_fd().as_raw_fd(),
            &[std::io::IoSlice::new(&frame)],
            &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        );
        match sent {
            Ok(n) if n == frame.len() => {}
            Ok(_) => return Err(std::io::Error::other("a fork request was cut short")),
            Err(e) => {
                lock(&self.exits).remove(&id);
                return Err(std::io::Error::from(e));
            }
        }
        Ok(Forked {
            id,
            exit: rx,
            code: None,
            server: self.clone(),
        })
    }

    fn kill(&self, id: u64) {
        if let Ok(frame) = bridge::encode(&json!({"method": "kill", "id": id})) {
            let _ = lock(&self.control).write_all(&frame);
        }
    }
}

/// A run the fork server started: killed through it, its exit status reported by it.
pub struct Forked {
    id: u64,
    exit: oneshot::Receiver<i32>,
    code: Option<i32>,
    server: Arc<ForkServer>,
}

impl Forked {
    /// Kills the run's waiter, whose death kills the run's PID 1 and so its whole namespace.
    pub fn kill(&self) {
        if self.code.is_none() {
            self.server.kill(self.id);
        }
    }

    pub fn alive(&mut self) -> bool {
        if self.code.is_some() {
            return false;
        }
        match self.exit.try_recv() {
            Ok(code) => {
                self.code = Some(code);
                false
            }
            Err(oneshot::error::TryRecvError::Empty) => true,
            Err(oneshot::error::TryRecvError::Closed) => false,
        }
    }

    /// The run's exit status, once it has ended (`None`: the fork server went away first).
    pub async fn wait(&mut self) -> Option<i32> {
        if self.code.is_none() {
            self.code = (&mut self.exit).await.ok();
        }
        self.code
    }
}

impl Drop for Forked {
    fn drop(&mut self) {
        self.kill();
        lock(&self.server.exits).remove(&self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One length-prefixed frame, blocking; `None` at end of stream.
fn read_frame(stream: &UnixStream) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read as _;
    let mut stream = stream;
    let mut head = [0u8; 4];
    match stream.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let length = u32::from_be_bytes(head) as usize;
    if length > 1 << 20 {
        return Err(std::io::Error::other(format!(
            "the zygote sent a frame of {length} bytes"
        )));
    }
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body)?;
    Ok(Some(body))
}

async fn log_lines(stderr: tokio::process::ChildStderr) {
    use tokio::io::AsyncBufReadExt as _;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::warn!(
            "sandbox fork server: {}",
            line.chars().take(2000).collect::<String>()
        );
    }
}
