//! Child processes of `nomad up`: spawned with their output in the run directory, watched for
//! exit, and stopped in reverse start order (SIGTERM, then SIGKILL after the grace period).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::mpsc;

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
}

struct Running {
    name: String,
    pid: u32,
    log: PathBuf,
    status: Option<ExitStatus>,
}

/// A child's exit.
#[derive(Debug, Clone)]
pub struct Exit {
    pub name: String,
    pub status: ExitStatus,
}

/// Running children by server type.
pub type ActiveCounts = Arc<std::sync::Mutex<Vec<(&'static str, Arc<AtomicI64>)>>>;

pub struct Supervisor {
    dir: PathBuf,
    children: Vec<Running>,
    // One message per child, ever: the channel cannot grow past the fleet's size.
    exits_tx: mpsc::UnboundedSender<(usize, ExitStatus)>,
    exits_rx: mpsc::UnboundedReceiver<(usize, ExitStatus)>,
    /// Running children, by server type (read by the `nomad.servers.active` instrument).
    pub active: ActiveCounts,
}

impl Supervisor {
    pub fn new(dir: &Path) -> Self {
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        Self {
            dir: dir.to_owned(),
            children: Vec::new(),
            exits_tx,
            exits_rx,
            active: Default::default(),
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
        let telemetry = self.dir.join(format!("{}.jsonl", spec.name));
        let log = self.dir.join(format!("{}.log", spec.name));
        let stderr =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
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
        let index = self.children.len();
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
            let _ = tx.send((index, status));
        });
        self.children.push(Running {
            name: spec.name,
            pid,
            log,
            status: None,
        });
        Ok(index)
    }

    fn record(&mut self, (index, status): (usize, ExitStatus)) -> Exit {
        let child = &mut self.children[index];
        child.status = Some(status);
        Exit {
            name: child.name.clone(),
            status,
        }
    }

    /// `(name, pid)` of each running child.
    pub fn running(&self) -> Vec<(String, u32)> {
        self.children
            .iter()
            .filter(|c| c.status.is_none())
            .map(|c| (c.name.clone(), c.pid))
            .collect()
    }

    pub fn name(&self, index: usize) -> &str {
        &self.children[index].name
    }

    /// The next child to exit. Never resolves while every child is running.
    pub async fn next_exit(&mut self) -> Exit {
        match self.exits_rx.recv().await {
            Some(message) => self.record(message),
            // The sender lives in self: unreachable, but never report an exit that did not happen.
            None => std::future::pending().await,
        }
    }

    /// A child's exit with the last lines of its log, for the user.
    pub fn report(&self, exit: &Exit) -> String {
        let child = self
            .children
            .iter()
            .find(|c| c.name == exit.name)
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
            if let Ok(message) = self.exits_rx.try_recv() {
                let exit = self.record(message);
                anyhow::bail!("{}", self.report(&exit));
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} did not start listening within {timeout:?}; see {}",
                self.children[index].name,
                self.children[index].log.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Any exit already reported, without waiting.
    pub fn try_exit(&mut self) -> Option<Exit> {
        let message = self.exits_rx.try_recv().ok()?;
        Some(self.record(message))
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
            terminate(&self.children[index].name, self.children[index].pid);
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
                    name: c.name.clone(),
                    status,
                })
            })
            .collect()
    }
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill has no memory preconditions; the pid is a child we have not yet reaped, so
    // it cannot name another process.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(name: &str, script: &str) -> ChildSpec {
        ChildSpec {
            stdio: false,
            name: name.into(),
            server_type: "test",
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
        }
    }

    /// A child's stdout joins its log; its console telemetry goes to its own `<name>.jsonl`,
    /// which it writes (and rotates) itself.
    #[tokio::test]
    async fn a_child_is_told_its_own_telemetry_file_and_its_stdout_joins_its_log() {
        let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut sup = Supervisor::new(&dir);
        sup.spawn(sh(
            "talker",
            "echo \"out $NOMAD_OTEL_CONSOLE_FILE\"; echo err >&2; exit 0",
        ))
        .unwrap();
        let exit = sup.next_exit().await;
        assert_eq!(exit.status.code(), Some(0));
        let log = std::fs::read_to_string(dir.join("talker.log")).unwrap();
        let expected = format!("out {}", dir.join("talker.jsonl").display());
        assert!(log.contains(&expected), "{log}");
        assert!(log.contains("err"), "{log}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_dying_child_is_reported_with_its_log_and_the_rest_are_stopped() {
        let dir = std::env::temp_dir().join(format!("nomad-sup-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut sup = Supervisor::new(&dir);
        sup.spawn(sh("steady", "exec sleep 30")).unwrap();
        // Ignores SIGTERM: must be killed when the grace period ends.
        let trapped = dir.join("trapped");
        sup.spawn(sh(
            "stubborn",
            &format!(
                "trap '' TERM; touch {}; while :; do sleep 0.05; done",
                trapped.display()
            ),
        ))
        .unwrap();
        sup.spawn(sh("crasher", "echo 'bad weights' >&2; exit 3"))
            .unwrap();
        let exit = sup.next_exit().await;
        assert_eq!(exit.name, "crasher");
        assert_eq!(exit.status.code(), Some(3));
        let report = sup.report(&exit);
        assert!(report.contains("bad weights"), "{report}");
        let pids: Vec<u32> = sup.running().iter().map(|(_, pid)| *pid).collect();
        assert_eq!(pids.len(), 2);

        // Stopping before the shell has set its trap would test nothing.
        while !trapped.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let exits = sup.stop(Duration::from_millis(300)).await;
        assert_eq!(exits.len(), 3);
        assert!(sup.running().is_empty());
        let signal_of = |name: &str| {
            use std::os::unix::process::ExitStatusExt as _;
            exits
                .iter()
                .find(|e| e.name == name)
                .unwrap()
                .status
                .signal()
        };
        assert_eq!(signal_of("steady"), Some(libc::SIGTERM));
        assert_eq!(signal_of("stubborn"), Some(libc::SIGKILL));
        for pid in pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "{pid} still runs"
            );
        }
        let active = sup.active.lock().unwrap();
        assert_eq!(active[0].1.load(Ordering::Relaxed), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
