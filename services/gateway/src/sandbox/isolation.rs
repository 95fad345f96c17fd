//! What isolation holds, in the words the start-up log, `Status` and the isolation gauge use.

use std::path::PathBuf;

use super::init::Report;

/// The isolation in force, as the sandbox's init reported it at start-up (every later process
/// must report at least as much).
#[derive(Debug, Clone)]
pub struct Isolation {
    pub report: Report,
    /// Where the per-run cgroups live, or why there are none.
    pub cgroup: Result<PathBuf, String>,
}

impl Isolation {
    /// Each layer and whether it holds (the `layer` attribute of
    /// `nomad.gateway.sandbox.isolation`).
    pub fn layers(&self) -> Vec<(&'static str, bool)> {
        let r = &self.report;
        vec![
            ("user_namespace", r.namespaces),
            ("mount_namespace", r.namespaces),
            ("network_namespace", r.namespaces),
            ("pid_namespace", r.namespaces),
            ("ipc_namespace", r.namespaces),
            ("read_only_root", r.read_only_root),
            ("seccomp", r.seccomp),
            ("landlock", r.landlock_abi > 0),
            ("no_new_privs", r.no_new_privs),
            ("capabilities_dropped", r.capabilities_dropped),
            ("unprivileged_user", r.uid != 0),
            ("cgroup", r.cgroup),
            ("rlimits", true),
        ]
    }

    /// What is lost where a layer does not hold, in words.
    pub fn lost(&self) -> Vec<&'static str> {
        let r = &self.report;
        let mut lost = Vec::new();
        if !r.namespaces {
            lost.push(
                "no namespaces: the code sees the host's filesystem (Landlock limits reads and \
                 writes), its processes and named Unix sockets, and shares the host's network \
                 namespace (seccomp still refuses non-Unix sockets)",
            );
        }
        if !r.seccomp {
            lost.push(
                "no seccomp filter: namespaces, mounts, bpf, io_uring, ptrace and every socket \
                 family stay reachable to the code",
            );
        }
        if r.landlock_abi == 0 {
            lost.push("no Landlock: the second wall around the filesystem view is missing");
        }
        if !r.cgroup {
            lost.push(
                "no cgroup: memory, processes and CPU are limited per process (rlimits), not \
                 for the whole run",
            );
        }
        lost
    }
}
