//! Per-run cgroups (v2), where the gateway has a delegated cgroup: Docker and Kubernetes give
//! a container one, systemd gives one to a unit with `Delegate=yes`. Each run gets a child with
//! `memory.max`, `pids.max` and `cpu.max`, so the limits hold for the whole run, not per process.
//! Elsewhere the per-process rlimits are what applies, and start-up says so.

use std::io;
use std::path::{Path, PathBuf};

/// Limits of one run's cgroup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunLimits {
    pub memory_bytes: u64,
    pub processes: u64,
    pub cpu_cores: f64,
}

/// The delegated cgroup runs are made under.
#[derive(Debug)]
pub struct Cgroups {
    dir: PathBuf,
}

/// `0::/some/path` in `/proc/self/cgroup`: this process's cgroup v2 path.
/// The `memory.max` of the cgroup this process is in (a container's memory limit), when it
/// has one.
pub fn own_memory_max() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let dir = cgroup2_mount(&mountinfo)?.join(own_path(&own)?.trim_start_matches('/'));
    // "max" when unlimited: no number, no limit.
    std::fs::read_to_string(dir.join("memory.max"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn own_path(proc_self_cgroup: &str) -> Option<&str> {
    proc_self_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
}

/// Where cgroup2 is mounted, from `/proc/self/mountinfo` (field 5 is the mount point; the type
/// follows the ` - ` separator).
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2")
            .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

impl Cgroups {
    /// The delegated cgroup, or why there is none.
    pub fn detect() -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let own = own_path(&own).ok_or("no cgroup v2 membership in /proc/self/cgroup")?;
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
        let mount = cgroup2_mount(&mountinfo).ok_or("cgroup2 is not mounted")?;
        let dir = mount.join(own.trim_start_matches('/'));
        let controllers = std::fs::read_to_string(dir.join("cgroup.controllers"))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        for needed in ["memory", "pids"] {
            if !controllers.split_whitespace().any(|c| c == needed) {
                return Err(format!(
                    "the {needed} controller is not available in {} (controllers: {:?})",
                    dir.display(),
                    controllers.trim()
                ));
            }
        }
        let cgroups = Cgroups { dir };
        cgroups.delegate().map_err(|e| {
            format!(
                "cgroup {} is not delegated to this user: {e}",
                cgroups.dir.display()
            )
        })?;
        Ok(cgroups)
    }

    /// Moves this process into a `gateway` leaf (a cgroup with processes cannot hand controllers
    /// to children) and enables the controllers for the runs beside it. A cgroup this process
    /// shares with others (a login session, a supervisor) is not its to rearrange: refused.
    fn delegate(&self) -> io::Result<()> {
        let me = std::process::id().to_string();
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs"))?;
        if procs.split_whitespace().any(|pid| pid != me) {
            return Err(io::Error::other(
                "other processes share it (a session or a supervisor's cgroup)",
            ));
        }
        if !procs.trim().is_empty() {
            let leaf = self.dir.join("gateway");
            match std::fs::create_dir(&leaf) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            std::fs::write(leaf.join("cgroup.procs"), &me)?;
        }
        let available = std::fs::read_to_string(self.dir.join("cgroup.controllers"))?;
        let wanted: Vec<String> = ["memory", "pids", "cpu"]
            .into_iter()
            .filter(|c| available.split_whitespace().any(|a| a == *c))
            .map(|c| format!("+{c}"))
            .collect();
        std::fs::write(self.dir.join("cgroup.subtree_control"), wanted.join(" "))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh cgroup for one run.
    pub fn create(&self, limits: RunLimits) -> io::Result<RunCgroup> {
        let path = self
            .dir
            .join(format!("run-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&path)?;
        let cgroup = RunCgroup { path };
        let write = |file: &str, value: String| std::fs::write(cgroup.path.join(file), value);
        write("memory.max", limits.memory_bytes.to_string())?;
        // Swap would let a run go past memory.max; the file is missing without swap accounting.
        let _ = write("memory.swap.max", "0".into());
        // An out-of-memory kill takes the whole run, not one of its processes.
        let _ = write("memory.oom.group", "1".into());
        write("pids.max", limits.processes.to_string())?;
        let period = 100_000u64;
        let quota = (limits.cpu_cores * period as f64).round().max(1000.0) as u64;
        let _ = write("cpu.max", format!("{quota} {period}"));
        Ok(cgroup)
    }
}

/// One run's cgroup; removed (off the async runtime) when dropped.
#[derive(Debug)]
pub struct RunCgroup {
    path: PathBuf,
}

impl RunCgroup {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunCgroup {
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.path);
        // The kernel refuses rmdir until the last process is reaped; a few tries cover that.
        let remove = move || {
            for _ in 0..50 {
                match std::fs::remove_dir(&path) {
                    Ok(()) => return,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
                }
            }
            tracing::warn!("could not remove the run cgroup {}", path.display());
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_v2_path_and_the_cgroup2_mount() {
        // A hybrid host (as in CI): v1 hierarchies, and cgroup2 at /sys/fs/cgroup/unified.
        let cgroup = "4:memory:/job\n1:cpu:/\n0::/user.slice/gateway.service\n";
        assert_eq!(own_path(cgroup), Some("/user.slice/gateway.service"));
        assert_eq!(own_path("4:memory:/job\n"), None);
        let mountinfo = "\
35 25 0:30 / /sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755
40 35 0:35 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory
46 35 0:41 / /sys/fs/cgroup/unified rw,relatime shared:20 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            cgroup2_mount("40 35 0:35 / /x rw - cgroup cgroup rw\n"),
            None
        );
    }
}
