//! The fork server: one sandboxed interpreter (`zygote.py`) with the runtime imported, which
//! forks a child per run, so a run's start costs a fork, not a Python start-up and its imports.
//!
//! The zygote is started by `sandbox-init`, which takes the view's steps (namespaces, the
//! read-only root) and then starts the interpreter instead of a run. The interpreter loads
//! `nomad_jail` as a shared library and has each child take the run's steps there, the same code
//! a spawned run's init runs, so a forked run reports and is checked as any run is. The control
//! socket carries frames: the run's spec first, then `fork` (with the run's bridge, stdout and
//! stderr as SCM_RIGHTS) and `kill`; the zygote answers `exited`.
//!
//! [`ForkServers`] holds the one in use; a zygote that dies, or forks a run that does not come up
//! as isolated as promised, is let go and replaced (see `Pool::keep_fork_server`).

use crate::lock::lock;
use std::collections::HashMap;
use std::io::Write as _;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::json;
use tokio::sync::{Notify, oneshot};

use super::bridge;
use super::init::{self, Spec};

pub struct ForkServer {
    control: Mutex<UnixStream>,
    exits: Arc<Mutex<HashMap<u64, oneshot::Sender<i32>>>>,
    next: AtomicU64,
    alive: Arc<AtomicBool>,
    /// The zygote's init (killed with this handle; the zygote and every run it forked die with
    /// it, as the first process of their PID namespace).
    _zygote: tokio::process::Child,
}

#[derive(Deserialize)]
struct Exited {
    id: u64,
    code: i32,
}

impl ForkServer {
    /// Starts the zygote from `spec` (a run's spec; `args` are the runner's) and sends it the
    /// spec its children take.
    pub async fn start(spec: &Spec, preload: &[String]) -> std::io::Result<Arc<Self>> {
        let mut zygote_spec = spec.clone();
        zygote_spec.zygote = true;
        zygote_spec.cgroup = None;
        zygote_spec.args.push("--zygote".into());
        zygote_spec.args.push(preload.join(","));
        let (mut ours, mut command) = init::command(&zygote_spec)?;
        let mut zygote = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(stderr) = zygote.stderr.take() {
            tokio::spawn(log_lines(stderr));
        }
        // The init's report of the zygote's own view (its children report the runs').
        let reader = ours.try_clone()?;
        // Bounded: a read that never ends would hold the gateway's start-up (the zygote is
        // killed with its handle when this gives up).
        reader.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
        let report = tokio::task::spawn_blocking(move || {
            nomad_jail::frame::read_blocking(reader.as_fd(), nomad_jail::frame::CONTROL_MAX_FRAME)
        })
        .await
        .map_err(std::io::Error::other)??
        .ok_or_else(|| std::io::Error::other("the zygote ended before it was set up"))?;
        // The timeout is the socket's, shared by every handle: the exits reader waits unbounded.
        ours.set_read_timeout(None)?;
        let report: init::Report = serde_json::from_slice(&report)?;
        if !report.namespaces || !report.read_only_root {
            return Err(std::io::Error::other(
                "the zygote has no namespaces or no read-only view",
            ));
        }
        let mut run_spec = spec.clone();
        run_spec.cgroup = None;
        ours.write_all(&bridge::encode(&run_spec).map_err(std::io::Error::other)?)?;
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
                while let Ok(Some(body)) = nomad_jail::frame::read_blocking(
                    ours.as_fd(),
                    nomad_jail::frame::CONTROL_MAX_FRAME,
                ) {
                    if let Ok(exited) = serde_json::from_slice::<Exited>(&body)
                        && let Some(tx) = lock(&exits).remove(&exited.id)
                    {
                        let _ = tx.send(exited.code);
                    }
                }
                // Gone: every child it had is gone with it (they were in its PID namespace).
                tracing::warn!("the sandbox's fork server ended");
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
                // Its end of the socket is closed: it died, and the thread that reads it has not
                // said so yet. It is gone from now on, so this run and the next are spawned.
                if matches!(
                    e,
                    nix::errno::Errno::EPIPE
                        | nix::errno::Errno::ECONNRESET
                        | nix::errno::Errno::ENOTCONN
                ) {
                    self.alive.store(false, Ordering::Release);
                }
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

/// The fork server in use, if any. One that dies or turns out unsound is let go: its runs in
/// flight finish (it is killed when the last of them drops its handle), and
/// `Pool::keep_fork_server` starts another.
#[derive(Default)]
pub struct ForkServers {
    current: Mutex<Option<Arc<ForkServer>>>,
    /// Woken when the one in use is let go.
    pub lost: Notify,
    /// How many were started to replace one (the first is not counted).
    pub replaced: AtomicU64,
}

impl ForkServers {
    pub fn new(server: Arc<ForkServer>) -> Arc<Self> {
        Arc::new(Self {
            current: Mutex::new(Some(server)),
            ..Self::default()
        })
    }

    /// The fork server to fork from: the one in use while it is alive.
    pub fn current(&self) -> Option<Arc<ForkServer>> {
        let mut current = lock(&self.current);
        if current.as_ref().is_some_and(|s| !s.alive()) {
            *current = None;
            self.lost.notify_one();
        }
        current.clone()
    }

    /// `server` forked a run that did not come up sound (`why`): no more runs from it.
    pub fn unsound(&self, server: &Arc<ForkServer>, why: &str) {
        let mut current = lock(&self.current);
        if current.as_ref().is_some_and(|s| Arc::ptr_eq(s, server)) {
            tracing::error!(
                "the sandbox's fork server forked a run that did not come up sound ({why}); \
                 it is let go and replaced, and runs start an interpreter each meanwhile"
            );
            *current = None;
            self.lost.notify_one();
        }
    }

    pub fn install(&self, server: Arc<ForkServer>) {
        *lock(&self.current) = Some(server);
        self.replaced.fetch_add(1, Ordering::Relaxed);
    }
}

/// A run the fork server started: its exit status reported by it.
pub struct Forked {
    id: u64,
    exit: oneshot::Receiver<i32>,
    code: Option<i32>,
    server: Arc<ForkServer>,
}

impl Forked {
    /// Has the fork server kill the run's waiter (before the run reported, when no code of the
    /// run's has run yet; after, the gateway kills the run's first process itself).
    pub fn kill(&self) {
        if self.code.is_none() {
            self.server.kill(self.id);
        }
    }

    pub fn server(&self) -> &Arc<ForkServer> {
        &self.server
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
