//! The waiter: the parent of a PID namespace's first process, left outside that namespace. It
//! holds nothing of the run but the bridge, which it watches and never reads: when the
//! gateway's end closes (the gateway is gone, or has let the run go), it kills the first
//! process, and the kernel then kills everything else in the namespace, whatever it did to its
//! signals, session or death signal. It ends with the first process's status (128 + the signal
//! when killed), once the namespace is empty.

use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use crate::descriptors::{BRIDGE, close_from};
use crate::spec::SETUP_FAILED;

/// Waits for `child` and exits with its status; never returns.
pub fn wait_and_exit(child: Pid) -> ! {
    // SAFETY: closing this process's own descriptors (all but the bridge).
    unsafe { libc::syscall(libc::SYS_close_range, 0u32, (BRIDGE - 1) as u32, 0u32) };
    close_from(BRIDGE + 1);
    let pidfd = crate::pidfd::open(child.as_raw());
    loop {
        let mut fds = [
            libc::pollfd {
                fd: pidfd.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: BRIDGE,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd structures (a negative fd is ignored by poll).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            break;
        }
        if fds[0].revents != 0 {
            break;
        }
        if fds[1].revents != 0 {
            // SAFETY: `child` is this process's own child, not yet reaped: its pid is its own.
            unsafe { libc::kill(child.as_raw(), libc::SIGKILL) };
            break;
        }
    }
    let code = loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => break code,
            Ok(WaitStatus::Signaled(_, signal, _)) => break 128 + signal as i32,
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break SETUP_FAILED,
        }
    };
    // SAFETY: ends this process without running anything of the image it was forked from (a
    // fork server's waiter is a copy of an interpreter).
    unsafe { libc::_exit(code) }
}
