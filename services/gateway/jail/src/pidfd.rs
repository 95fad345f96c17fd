//! Process file descriptors: a handle on one process that no reuse of its pid can redirect.

use std::os::fd::{FromRawFd as _, OwnedFd, RawFd};

/// A pidfd of `pid` (as this process's PID namespace numbers it), or `None` where the kernel
/// has none (before Linux 5.3).
pub fn open(pid: i32) -> Option<RawFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    (fd >= 0).then_some(fd as RawFd)
}

/// A pidfd of the calling process.
pub fn own() -> std::io::Result<OwnedFd> {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    match open(pid) {
        // SAFETY: a descriptor pidfd_open just returned, owned by nobody else.
        Some(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        None => Err(std::io::Error::last_os_error()),
    }
}
