//! Namespaces: entering new ones, mapping the user, and the fork that makes a PID namespace's
//! first process (its parent stays outside as the [`crate::waiter`]).

use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::Signal;
use nix::unistd::{ForkResult, fork};

use crate::error::{Failed, Step as _};

/// The namespaces of the view: the fork server's, or a spawned run's outer ones.
pub const VIEW: CloneFlags = CloneFlags::CLONE_NEWUSER
    .union(CloneFlags::CLONE_NEWNS)
    .union(CloneFlags::CLONE_NEWNET)
    .union(CloneFlags::CLONE_NEWPID)
    .union(CloneFlags::CLONE_NEWIPC)
    .union(CloneFlags::CLONE_NEWUTS)
    .union(CloneFlags::CLONE_NEWCGROUP);

/// The namespaces each run gets for itself inside the view: its mounts (its own tmpfs and
/// `/proc`), processes, network (abstract sockets included), System V IPC and host name.
pub const RUN: CloneFlags = CloneFlags::CLONE_NEWNS
    .union(CloneFlags::CLONE_NEWNET)
    .union(CloneFlags::CLONE_NEWPID)
    .union(CloneFlags::CLONE_NEWIPC)
    .union(CloneFlags::CLONE_NEWUTS);

/// Enters new namespaces of `flags`.
pub fn enter(flags: CloneFlags) -> Result<(), Failed> {
    unshare(flags).step("creating namespaces")
}

/// Maps `inside` (uid, gid) of the user namespace just entered to `outside` of its parent.
pub fn map_ids(inside: (u32, u32), outside: (u32, u32)) -> Result<(), Failed> {
    std::fs::write("/proc/self/setgroups", "deny").step("setgroups")?;
    std::fs::write(
        "/proc/self/uid_map",
        format!("{} {} 1", inside.0, outside.0),
    )
    .step("uid_map")?;
    std::fs::write(
        "/proc/self/gid_map",
        format!("{} {} 1", inside.1, outside.1),
    )
    .step("gid_map")
}

/// The ids that root of this user namespace is outside it (its one mapped id): the sandbox
/// user's, which every run takes.
pub fn outer_ids() -> Result<(u32, u32), Failed> {
    let read = |path: &str| -> Result<u32, Failed> {
        let map = std::fs::read_to_string(path).step(path)?;
        let mut fields = map.split_whitespace();
        match (fields.next(), fields.next()) {
            (Some("0"), Some(outer)) => outer.parse().step(path),
            _ => Err(Failed(format!("{path}: root is not mapped ({map:?})"))),
        }
    };
    Ok((read("/proc/self/uid_map")?, read("/proc/self/gid_map")?))
}

/// Forks; returns in the child, the first process (PID 1) of the PID namespace entered last,
/// which dies with its parent. The parent becomes the waiter and never returns.
pub fn fork_first_process() -> Result<(), Failed> {
    // SAFETY: the caller has a single thread (the init, or a fork server's child).
    match unsafe { fork() }.step("fork")? {
        ForkResult::Child => nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).step("pdeathsig"),
        ForkResult::Parent { child } => crate::waiter::wait_and_exit(child),
    }
}
