//! What the gateway decides for a jail ([`Spec`]) and what a jail reports back ([`Report`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Exit status of a failed set-up (the init's and a forked run's alike).
pub const SETUP_FAILED: i32 = 125;
/// Where the runner's directory is mounted inside the view.
pub const RUNTIME_DIR: &str = "/nomad";
/// The run's working directory inside the view.
pub const WORKSPACE: &str = "/workspace";
/// Where a run mounts its own tmpfs before binding its parts into place (an empty directory of
/// the view, hidden again once the binds are made).
pub const SCRATCH: &str = "/nomad-run";
/// The least niceness every run has (0 is the default, 19 the lowest priority).
pub const RUN_NICENESS: i32 = 10;
/// The file name of this crate's shared library, which the fork server's interpreter loads
/// from [`RUNTIME_DIR`].
pub const LIBRARY: &str = "libnomad_jail.so";

/// Resource limits of one run (per process; a cgroup, where there is one, bounds the whole run).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Limits {
    pub address_space_bytes: u64,
    pub cpu_seconds: u64,
    pub processes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
}

/// One thing the view holds besides the root tmpfs's own directories.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    /// A read-only bind of the host's `path` at the same path.
    ReadOnly { path: PathBuf },
    /// A symbolic link at `path` pointing to `target` (as on the host: `/bin -> usr/bin`).
    Symlink { path: PathBuf, target: PathBuf },
}

/// Everything a jail needs, decided by the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    pub python: PathBuf,
    /// Arguments after the interpreter.
    pub args: Vec<String>,
    /// The host directory the gateway keeps the runner in (bound at [`RUNTIME_DIR`]).
    pub runtime: PathBuf,
    /// An empty host directory the private root is mounted on (inside the new mount namespace
    /// only; the host never sees the mount).
    pub mount_point: PathBuf,
    pub view: Vec<Entry>,
    /// Size of each run's private tmpfs, which holds its `/workspace`, `/tmp` and `/dev/shm`.
    pub disk_bytes: u64,
    /// Inodes of that tmpfs (files and directories).
    pub max_files: u64,
    pub limits: Limits,
    /// Become this (uid, gid) first: the gateway runs as root.
    pub drop_to: Option<(u32, u32)>,
    /// Namespaces and the filesystem view. Off only with `allow_unisolated`, where the kernel
    /// refuses them; then `host_workspace` is the working directory.
    pub namespaces: bool,
    /// Mount each PID namespace's own `/proc` (off where the kernel refuses it, as in a
    /// container that masks parts of its `/proc`).
    pub proc: bool,
    pub host_workspace: Option<PathBuf>,
    /// A cgroup v2 directory made for this run.
    pub cgroup: Option<PathBuf>,
    pub seccomp: bool,
    pub landlock: bool,
    /// Start the fork server: the view only, then the interpreter, which forks each run and
    /// has the run's own steps ([`crate::Jail::enter_run`]) done in the child.
    #[serde(default)]
    pub zygote: bool,
}

/// What a jail put in force, sent as the bridge's first frame (with a pidfd of the run's first
/// process, for the gateway to end the run by).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Report {
    pub namespaces: bool,
    pub proc: bool,
    /// The view's root (and so `/etc`, `/dev` and every directory the run did not get for
    /// itself) is a read-only mount: nothing a run changes there outlives it.
    #[serde(default)]
    pub read_only_root: bool,
    /// The Landlock ABI enforced (0: none).
    pub landlock_abi: u32,
    pub landlock_fully_enforced: bool,
    pub seccomp: bool,
    pub no_new_privs: bool,
    pub capabilities_dropped: bool,
    pub cgroup: bool,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups still held (the kernel keeps them in an unprivileged user
    /// namespace; nothing they own is in the view).
    pub supplementary_groups: usize,
}

impl Report {
    /// Whether every protection of `other` holds here too.
    pub fn as_strong_as(&self, other: &Report) -> bool {
        let implies = |here: bool, there: bool| here || !there;
        implies(self.namespaces, other.namespaces)
            && implies(self.proc, other.proc)
            && implies(self.read_only_root, other.read_only_root)
            && self.landlock_abi >= other.landlock_abi
            && implies(self.landlock_fully_enforced, other.landlock_fully_enforced)
            && implies(self.seccomp, other.seccomp)
            && implies(self.no_new_privs, other.no_new_privs)
            && implies(self.capabilities_dropped, other.capabilities_dropped)
            && implies(self.cgroup, other.cgroup)
            && self.uid == other.uid
            && self.supplementary_groups <= other.supplementary_groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_missing_any_layer_is_weaker() {
        let full = Report {
            namespaces: true,
            proc: true,
            read_only_root: true,
            landlock_abi: 6,
            landlock_fully_enforced: true,
            seccomp: true,
            no_new_privs: true,
            capabilities_dropped: true,
            cgroup: false,
            uid: 65534,
            gid: 65534,
            supplementary_groups: 0,
        };
        assert!(full.as_strong_as(&full));
        let weaker = [
            Report {
                read_only_root: false,
                ..full.clone()
            },
            Report {
                seccomp: false,
                ..full.clone()
            },
            Report {
                landlock_abi: 5,
                ..full.clone()
            },
            Report {
                uid: 0,
                ..full.clone()
            },
            Report {
                supplementary_groups: 1,
                ..full.clone()
            },
        ];
        for report in weaker {
            assert!(!report.as_strong_as(&full), "{report:?}");
        }
    }
}
