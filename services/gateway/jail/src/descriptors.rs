//! The descriptors a jail keeps: the bridge at 3, the run's stdout and stderr, `/dev/null` as
//! standard input, and nothing else of whoever started it (the gateway, or the fork server).

use std::os::fd::RawFd;

use crate::error::{Failed, last_os_error};

/// The bridge's descriptor in every jail.
pub const BRIDGE: RawFd = 3;

/// Puts `bridge`, `stdout` and `stderr` at 3, 1 and 2, `/dev/null` at 0, and closes the rest.
/// The three may be any descriptors (even each other's final places): each is first copied
/// above the ones being arranged.
pub fn arrange(bridge: RawFd, stdout: RawFd, stderr: RawFd) -> Result<(), Failed> {
    // SAFETY: plain descriptor calls on this process's own descriptors.
    unsafe {
        let mut high = [0; 3];
        for (slot, fd) in high.iter_mut().zip([bridge, stdout, stderr]) {
            *slot = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
            if *slot < 0 {
                return Err(last_os_error("keeping the run's descriptors"));
            }
        }
        for (fd, target) in high.into_iter().zip([BRIDGE, 1, 2]) {
            if libc::dup2(fd, target) < 0 {
                return Err(last_os_error("placing the run's descriptors"));
            }
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 || libc::dup2(null, 0) < 0 {
            return Err(last_os_error("/dev/null"));
        }
        close_from(BRIDGE + 1);
    }
    Ok(())
}

/// Closes every descriptor from `first` on.
pub fn close_from(first: RawFd) {
    // SAFETY: closing this process's own descriptors; nothing held past here uses them.
    unsafe { libc::syscall(libc::SYS_close_range, first as u32, u32::MAX, 0u32) };
}
