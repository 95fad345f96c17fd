//! Child processes of `nomad up`: spawned with their output in the run directory, watched for
//! exit, started again when one exits on its own (with backoff, until a crash loop), and stopped
//! in reverse start order (SIGTERM, then SIGKILL after the grace period).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::mpsc;

mod policy;

pub use policy::{RestartPolicy, Restarts};

/// One server to start.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// Unique in the fleet: names its files (`<name>.log`, `<name>.jsonl`).
    pub name: String,
    /// `nomad.servers.active` counts children by this.
    pub server_type: &'static str,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Set for the child; the caller has already left out what the user's env sets.
    pub env: Vec<(String, String)>,
    /// The child talks on the head's own stdin and stdout (an MCP server over stdio) instead of
    /// writing its stdout to `<name>.log`.
    pub stdio: bool,
    /// Files the child writes once it listens (its address files): removed before it is started
    /// again, so no one reads the last life's.
    pub ready_files: Vec<PathBuf>,
    /// Whether it may be started again (it comes back where the others find it).
    pub restart: bool,
}

struct Child {
    spec: ChildSpec,
    pid: u32,
    log: PathBuf,
    /// Set once this life has exited (and until the next one starts).
    status: Option<ExitStatus>,
    /// Which life of the child is running (exits of earlier ones are stale).
    generation: u64,
    /// When it was started again, within the policy's window.
    recent: VecDeque<Instant>,
    restarts: u32,
    last_exit: Option<String>,
}

/// A child's exit.
#[derive(Debug, Clone)]
pub struct Exit {
    pub name: String,
    pub status: ExitStatus,
}

/// Running children by server type.
pub type ActiveCounts = Arc<std::sync::Mutex<Vec<(&'static str, Arc<AtomicI64>)>>>;

/// `(name, pid)` of every running child, kept current across restarts (the memory profiler
/// reads it).
pub type Servers = Arc<std::sync::Mutex<Vec<(String, u32)>>>;

pub struct Supervisor {
    dir: PathBuf,
    children: Vec<Child>,
    policy: Restarts,
    // At most one message per life of a child: lives are bounded by the restart policy.
    exits_tx: mpsc::UnboundedSender<(usize, u64, ExitStatus)>,
    exits_rx: mpsc::UnboundedReceiver<(usize, u64, ExitStatus)>,
    /// Running children, by server type (read by the `nomad.servers.active` instrument).
    pub active: ActiveCounts,
    pub servers: Servers,
    restarts: opentelemetry::metrics::Counter<u64>,
}

impl Supervisor {
    pub fn new(dir: &Path, policy: Restarts) -> Self {
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        Self {
            dir: dir.to_owned(),
            children: Vec::new(),
            policy,
            exits_tx,
            exits_rx,
            active: Default::default(),
            servers: Default::default(),
            restarts: nomad_telemetry::metrics::SERVERS_RESTARTS.u64_counter(),
        }
    }

    fn active_counter(&self, server_type: &'static str) -> Arc<AtomicI64> {
        let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, c)) = active.iter().find(|(t, _)| *t == server_type) {
            return c.clone();
        }
        let counter = Arc::new(AtomicI64::new(0));
        active.push((server_type, counter.clone()));
        counter
    }

    /// Starts `spec` with its console telemetry in `<name>.jsonl` (which the child writes and
    /// rotates itself) and its stdout and stderr in `<name>.log`; returns its index.
    pub fn spawn(&mut self, spec: ChildSpec) -> anyhow::Result<usize> {
        let index = self.children.len();
        let log = self.dir.join(format!("{}.log", spec.name));
        let pid = self.start(&spec, index, 0, false)?;
        self.children.push(Child {
            spec,
            pid,
            log,
            status: None,
            generation: 0,
            recent: VecDeque::new(),
            restarts: 0,
            last_exit: None,
        });
        self.publish();
        Ok(index)
    }

    /// Starts one life of `spec` as child `index`; a later life appends to the log.
    fn start(
        &self,
        spec: &ChildSpec,
        index: usize,
        generation: u64,
        again: bool,
    ) -> anyhow::Result<u32> {
        let telemetry = self.dir.join(format!("{}.jsonl", spec.name));
        let log = self.dir.join(format!("{}.log", spec.name));
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(again)
            .truncate(!again)
            .open(&log)
            .with_context(|| format!("creating {}", log.display()))?;
        let mut command = tokio::process::Command::new(&spec.program);
        let (stdin, stdout) = if spec.stdio {
            (Stdio::inherit(), Stdio::inherit())
        } else {
            let stdout = stderr
                .try_clone()
                .with_context(|| format!("sharing {}", log.display()))?;
            (Stdio::null(), Stdio::from(stdout))
        };
        command
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            // Each child's own file: one path for all would mix and rotate them together.
            .env(nomad_telemetry::fields::CONSOLE_FILE.variable, &telemetry)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(stderr)
            // Its own process group: a terminal's Ctrl-C reaches the head alone, which then
            // stops the fleet in order.
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                // A head that dies without stopping the fleet (SIGKILL) takes the fleet with it.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {} ({})", spec.name, spec.program.display()))?;
        let pid = child.id().context("a just-started child has a pid")?;
        let counter = self.active_counter(spec.server_type);
        counter.fetch_add(1, Ordering::Relaxed);
        let tx = self.exits_tx.clone();
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(status) => status,
                // Waiting can only fail if the child was already reaped; report it as killed.
                Err(_) => std::os::unix::process::ExitStatusExt::from_raw(libc::SIGKILL),
            };
            counter.fetch_sub(1, Ordering::Relaxed);
            let _ = tx.send((index, generation, status));
        });
        Ok(pid)
    }

    /// Records an exit; `None` for one of an earlier life.
    fn record(&mut self, (index, generation, status): (usize, u64, ExitStatus)) -> Option<Exit> {
        let child = &mut self.children[index];
        if generation != child.generation {
            return None;
        }
        child.status = Some(status);
        child.last_exit = Some(status.to_string());
        self.publish();
        let child = &self.children[index];
        Some(Exit {
            name: child.spec.name.clone(),
            status,
        })
    }

    /// `(name, pid)` of each running child.
    pub fn running(&self) -> Vec<(String, u32)> {
        self.children
            .iter()
            .filter(|c| c.status.is_none())
            .map(|c| (c.spec.name.clone(), c.pid))
            .collect()
    }

    pub fn name(&self, index: usize) -> &str {
        &self.children[index].spec.name
    }

    /// The next exit the fleet must stop for. A child that exits on its own with a failure is
    /// started again after its backoff while the policy allows, each restart logged, counted in
    /// `nomad.servers.restarts` and written to `servers.json`; a crash loop, an exit with
    /// restarts off, and a child that exits successfully (an MCP session over stdio that ended)
    /// are returned. Never resolves while every child is running or being restarted.
    pub async fn next_exit(&mut self) -> Exit {
        loop {
            let Some(message) = self.exits_rx.recv().await else {
                // The sender lives in self: unreachable, but never report an exit that did not
                // happen.
                return std::future::pending().await;
            };
            let index = message.0;
            let Some(exit) = self.record(message) else {
                continue;
            };
            if exit.status.success() || !self.policy.restart || !self.children[index].spec.restart {
                return exit;
            }
            let now = Instant::now();
            let policy = self.policy;
            let child = &mut self.children[index];
            while child
                .recent
                .front()
                .is_some_and(|t| now.duration_since(*t) > policy.window)
            {
                child.recent.pop_front();
            }
            if child.recent.len() >= policy.max_restarts as usize {
                eprintln!(
                    "nomad: {} exited ({}) after {} restarts within {} s \
                     (supervise.max_restarts, supervise.window_seconds): a crash loop; not \
                     starting it again",
                    exit.name,
                    exit.status,
                    child.recent.len(),
                    policy.window.as_secs()
                );
                return exit;
            }
            let backoff = policy
                .backoff
                .saturating_mul(1 << child.recent.len().min(16))
                .min(policy.max_backoff);
            eprintln!(
                "nomad: {} exited ({}); starting it again in {:.1} s (restart {} within {} s)",
                exit.name,
                exit.status,
                backoff.as_secs_f64(),
                child.recent.len() + 1,
                policy.window.as_secs()
            );
            tokio::time::sleep(backoff).await;
            if let Err(e) = self.restart(index) {
                eprintln!("nomad: starting {} again: {e:#}", exit.name);
                return exit;
            }
        }
    }

    /// Starts child `index` again with its spec, in the same place (its stop order is kept).
    fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        let child = &self.children[index];
        for file in &child.spec.ready_files {
            let _ = std::fs::remove_file(file);
        }
        let generation = child.generation + 1;
        let log = child.log.clone();
        {
            use std::io::Write as _;
            let mut note = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(&log)?;
            writeln!(
                note,
                "--- nomad: started again after it exited ({}) ---",
                child.last_exit.as_deref().unwrap_or("?")
            )?;
        }
        let pid = self.start(&child.spec.clone(), index, generation, true)?;
        let child = &mut self.children[index];
        child.pid = pid;
        child.status = None;
        child.generation = generation;
        child.recent.push_back(Instant::now());
        child.restarts += 1;
        self.restarts.add(
            1,
            &[
                opentelemetry::KeyValue::new("server.type", child.spec.server_type),
                opentelemetry::KeyValue::new("nomad.server.name", child.spec.name.clone()),
            ],
        );
        self.publish();
        Ok(())
    }

    /// The running children's pids for the profiler, and `servers.json` (each server's pid,
    /// restarts and last exit) for `nomad status`, `nomad top` and the report: written whole,
    /// then renamed.
    fn publish(&self) {
        *self.servers.lock().unwrap_or_else(|e| e.into_inner()) = self.running();
        let servers: Vec<serde_json::Value> = self
            .children
            .iter()
            .map(|c| {
                serde_json::json!({
                    "name": c.spec.name,
                    "type": c.spec.server_type,
                    "pid": c.status.is_none().then_some(c.pid),
                    "restarts": c.restarts,
                    "last_exit": c.last_exit,
                })
            })
            .collect();
        let path = self.dir.join(SERVERS_FILE);
        let partial = self.dir.join(format!("{SERVERS_FILE}.partial"));
        let text = format!("{:#}\n", serde_json::json!({ "servers": servers }));
        let _ = std::fs::write(&partial, text).and_then(|()| std::fs::rename(&partial, &path));
    }

    /// A child's exit with the last lines of its log, for the user.
    pub fn report(&self, exit: &Exit) -> String {
        let child = self
            .children
            .iter()
            .find(|c| c.spec.name == exit.name)
            .expect("exits name our children");
        let text = std::fs::read_to_string(&child.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(20)..];
        let mut out = format!("{} exited ({})", exit.name, exit.status);
        if tail.is_empty() {
            out.push_str(&format!("; its log {} is empty", child.log.display()));
        } else {
            out.push_str(&format!("; last lines of {}:\n", child.log.display()));
            for line in tail {
                out.push_str("  | ");
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// Waits until `path` holds text (an address file) while child `index` runs.
    pub async fn wait_for_file(
        &mut self,
        index: usize,
        path: &Path,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(text) = std::fs::read_to_string(path)
                && !text.trim().is_empty()
            {
                return Ok(text.trim().to_owned());
            }
            if let Some(exit) = self.try_exit() {
                anyhow::bail!("{}", self.report(&exit));
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} did not start listening within {timeout:?}; see {}",
                self.children[index].spec.name,
                self.children[index].log.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Any exit already reported, without waiting (and without restarting: at start-up an
    /// exit is the fleet's failure to start).
    pub fn try_exit(&mut self) -> Option<Exit> {
        while let Ok(message) = self.exits_rx.try_recv() {
            if let Some(exit) = self.record(message) {
                return Some(exit);
            }
        }
        None
    }

    /// Stops every running child, the last started first (the gateway before the workers it
    /// calls, the scheduler last): SIGTERM, then SIGKILL if it is still running after `grace`.
    /// Returns each child's exit.
    pub async fn stop(&mut self, grace: Duration) -> Vec<Exit> {
        self.stop_with(grace, |_, pid| signal(pid, libc::SIGTERM))
            .await
    }

    /// [`Self::stop`] with `terminate(name, pid)` asking each child to stop in place of SIGTERM
    /// (a Slurm step is signalled through Slurm); SIGKILL still follows the grace period.
    pub async fn stop_with(&mut self, grace: Duration, terminate: impl Fn(&str, u32)) -> Vec<Exit> {
        for index in (0..self.children.len()).rev() {
            if self.children[index].status.is_some() {
                continue;
            }
            terminate(&self.children[index].spec.name, self.children[index].pid);
            let deadline = tokio::time::Instant::now() + grace;
            let mut killed = false;
            while self.children[index].status.is_none() {
                match tokio::time::timeout_at(deadline, self.exits_rx.recv()).await {
                    Ok(Some(message)) => {
                        self.record(message);
                    }
                    Ok(None) => break,
                    Err(_) if !killed => {
                        signal(self.children[index].pid, libc::SIGKILL);
                        killed = true;
                    }
                    // SIGKILL cannot be ignored; only a process stuck in the kernel outlives it.
                    Err(_) => {
                        if let Some(message) = self.exits_rx.recv().await {
                            self.record(message);
                        }
                    }
                }
            }
        }
        self.children
            .iter()
            .filter_map(|c| {
                c.status.map(|status| Exit {
                    name: c.spec.name.clone(),
                    status,
                })
            })
            .collect()
    }
}

/// Each server's pid, restarts and last exit, in the run directory.
pub const SERVERS_FILE: &str = "servers.json";

/// What `servers.json` in `run_dir` says of restarts, in a line (`nomad status`, `nomad top`):
/// `None` when there is no such file.
pub fn restarts_line(run_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(run_dir.join(SERVERS_FILE)).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let restarted: Vec<String> = json["servers"]
        .as_array()?
        .iter()
        .filter(|s| s["restarts"].as_u64().is_some_and(|n| n > 0))
        .map(|s| {
            format!(
                "{} {} (last exit: {})",
                s["name"].as_str().unwrap_or("?"),
                s["restarts"],
                s["last_exit"].as_str().unwrap_or("?")
            )
        })
        .collect();
    Some(if restarted.is_empty() {
        "restarts: none".to_owned()
    } else {
        format!("restarts: {}", restarted.join(", "))
    })
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill has no memory preconditions; the pid is a child we have not yet reaped, so
    // it cannot name another process.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

#[cfg(test)]
mod tests;
