//! A run's first process, as the gateway holds it: a pidfd that came with the run's report (the
//! process is PID 1 of the run's namespace). Killing it ends the run as a whole, whatever the
//! run did to its signals, session or death signal: the kernel kills everything else in the
//! namespace, and the pidfd turns readable only once that is done.

use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;

/// How long a killed run may take to be gone before the gateway says so and lets it go.
pub const GONE_WITHIN: Duration = Duration::from_secs(10);

pub struct FirstProcess {
    pidfd: AsyncFd<OwnedFd>,
    /// Its pid as the gateway sees it (for the memory watch's reads of `/proc`).
    pub pid: u32,
}

impl FirstProcess {
    /// Takes a pidfd received with a report; refuses anything that is not the pidfd of a live
    /// process.
    pub fn new(pidfd: OwnedFd) -> std::io::Result<Self> {
        let pid = pid_of(pidfd.as_raw_fd())?;
        // SAFETY: an OwnedFd is open, and stays the same descriptor until it is dropped with the
        // AsyncFd that owns it.
        let pidfd =
            unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
                .map_err(std::io::Error::from)?;
        Ok(Self { pidfd, pid })
    }

    /// SIGKILL, by the pidfd (no reuse of the pid can redirect it).
    pub fn kill(&self) -> std::io::Result<()> {
        // SAFETY: pidfd_send_signal on a pidfd this handle owns, with no siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_fd().as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0u32,
            )
        };
        match r {
            0 => Ok(()),
            // Gone already.
            _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }

    /// Completes once the process has exited, which for PID 1 of a namespace is once every
    /// other process in it is gone too.
    pub async fn gone(&self) {
        // A pidfd stays readable once the process has exited (the guard keeps it so).
        let _ = self.pidfd.readable().await;
    }
}

/// The pid of the process behind `pidfd`, from the `Pid:` line of its fdinfo (only a pidfd has
/// one; -1 once the process has exited).
fn pid_of(pidfd: RawFd) -> std::io::Result<u32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{pidfd}"))?;
    info.lines()
        .find_map(|line| line.strip_prefix("Pid:"))
        .and_then(|pid| pid.trim().parse::<i64>().ok())
        .filter(|pid| *pid > 0)
        .map(|pid| pid as u32)
        .ok_or_else(|| std::io::Error::other("not the pidfd of a live process"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_child_is_killed_through_its_pidfd_and_seen_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pidfd = nomad_jail::pidfd::open(child.id() as i32).unwrap();
        // SAFETY: a descriptor pidfd_open just returned.
        let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(pidfd) };
        let first = FirstProcess::new(pidfd).unwrap();
        assert_eq!(first.pid, child.id());
        let not_yet = tokio::time::timeout(Duration::from_millis(200), first.gone()).await;
        assert!(not_yet.is_err(), "a sleeping child is not gone");
        first.kill().unwrap();
        tokio::time::timeout(Duration::from_secs(5), first.gone())
            .await
            .expect("gone once killed");
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
    }

    #[test]
    fn a_descriptor_that_is_no_pidfd_is_refused() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let error = pid_of(a.as_raw_fd()).unwrap_err();
        assert!(error.to_string().contains("not the pidfd"), "{error}");
    }
}
