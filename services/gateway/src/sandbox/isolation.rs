//! Isolation of the sandbox process (Linux). Everything is prepared in the gateway before
//! `fork`; the child then makes only async-signal-safe system calls (`dup2`, `setsid`,
//! `setrlimit`, `setuid`, `unshare`, `fork`, `prctl`, Landlock) before `exec`.
//!
//! Layers:
//! - resource limits: address space, CPU seconds, processes, file size, open files;
//! - a new session, so a timeout kills the whole process group;
//! - privileges dropped to an unprivileged user when the gateway runs as root (so the process
//!   limit applies: the kernel exempts root from it);
//! - new user, network and PID namespaces: no network at all (a fresh namespace's loopback is
//!   down), and the runner is PID 1 of its own namespace, so killing it kills every descendant,
//!   even one that left the process group;
//! - Landlock: reads limited to what Python needs, writes to the run's workspace only, TCP
//!   bind/connect denied, signals and abstract Unix sockets scoped to the sandbox.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const SYS_LANDLOCK_CREATE_RULESET: libc::c_long = 444;
const SYS_LANDLOCK_ADD_RULE: libc::c_long = 445;
const SYS_LANDLOCK_RESTRICT_SELF: libc::c_long = 446;
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: u32 = 1;

const FS_EXECUTE: u64 = 1 << 0;
const FS_WRITE_FILE: u64 = 1 << 1;
const FS_READ_FILE: u64 = 1 << 2;
const FS_READ_DIR: u64 = 1 << 3;
/// Every filesystem right up to ABI 1 (bits 0-12); later ABIs add REFER (13), TRUNCATE (14),
/// IOCTL_DEV (15).
const FS_ABI1: u64 = (1 << 13) - 1;
const NET_BIND_TCP: u64 = 1 << 0;
const NET_CONNECT_TCP: u64 = 1 << 1;
const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
const SCOPE_SIGNAL: u64 = 1 << 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The Landlock ABI this kernel offers (0: none).
pub fn landlock_abi() -> u32 {
    // SAFETY: the version query takes no pointers.
    let v = unsafe {
        libc::syscall(
            SYS_LANDLOCK_CREATE_RULESET,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if v < 0 { 0 } else { v as u32 }
}

fn fs_rights(abi: u32) -> u64 {
    let mut rights = FS_ABI1;
    if abi >= 2 {
        rights |= 1 << 13;
    }
    if abi >= 3 {
        rights |= 1 << 14;
    }
    if abi >= 5 {
        rights |= 1 << 15;
    }
    rights
}

/// Rights that make sense on a single file (not a directory).
fn file_rights(abi: u32) -> u64 {
    let mut rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE;
    if abi >= 3 {
        rights |= 1 << 14;
    }
    if abi >= 5 {
        rights |= 1 << 15;
    }
    rights
}

/// A Landlock ruleset built in the gateway, applied by the child just before `exec`.
#[derive(Debug)]
pub struct Ruleset {
    fd: OwnedFd,
    pub abi: u32,
}

impl AsRawFd for Ruleset {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Ruleset {
    /// Reads (and executes) under `read_only`, everything under `read_write`, nothing else;
    /// no TCP (ABI 4+); no signals or abstract sockets outside the sandbox (ABI 6+).
    pub fn new(read_only: &[&Path], read_write: &[&Path]) -> io::Result<Self> {
        let abi = landlock_abi();
        if abi == 0 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "Landlock is not available in this kernel",
            ));
        }
        let handled = fs_rights(abi);
        let attr = RulesetAttr {
            handled_access_fs: handled,
            handled_access_net: if abi >= 4 {
                NET_BIND_TCP | NET_CONNECT_TCP
            } else {
                0
            },
            scoped: if abi >= 6 {
                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
            } else {
                0
            },
        };
        // SAFETY: attr is a valid ruleset attribute of the size passed.
        let fd = unsafe {
            libc::syscall(
                SYS_LANDLOCK_CREATE_RULESET,
                &attr as *const RulesetAttr,
                std::mem::size_of::<RulesetAttr>(),
                0u32,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel returned a fresh file descriptor we now own.
        let ruleset = Ruleset {
            fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) },
            abi,
        };
        for path in read_only {
            ruleset.allow(path, FS_READ_FILE | FS_READ_DIR | FS_EXECUTE)?;
        }
        for path in read_write {
            ruleset.allow(path, handled)?;
        }
        Ok(ruleset)
    }

    /// Allows `rights` beneath `path` (a missing path is skipped: nothing to allow).
    fn allow(&self, path: &Path, rights: u64) -> io::Result<()> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with NUL"))?;
        // SAFETY: c is a valid NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(e)
            };
        }
        // SAFETY: open returned a file descriptor we own.
        let parent = unsafe { OwnedFd::from_raw_fd(fd) };
        let is_dir = std::fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false);
        let rights = if is_dir {
            rights
        } else {
            rights & file_rights(self.abi)
        };
        let attr = PathBeneathAttr {
            allowed_access: rights,
            parent_fd: parent.as_raw_fd(),
        };
        // SAFETY: attr is a valid path-beneath rule referring to an open descriptor.
        let r = unsafe {
            libc::syscall(
                SYS_LANDLOCK_ADD_RULE,
                self.fd.as_raw_fd(),
                LANDLOCK_RULE_PATH_BENEATH,
                &attr as *const PathBeneathAttr,
                0u32,
            )
        };
        if r < 0 {
            return Err(io::Error::other(format!(
                "Landlock rule for {}: {}",
                path.display(),
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }
}

/// Resource limits of one sandbox run.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub address_space_bytes: u64,
    pub cpu_seconds: u64,
    pub processes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
}

/// What the child does before `exec`. All fields are plain values or descriptors prepared in the
/// parent, which keeps them open until the spawn is done.
#[derive(Debug, Clone, Copy)]
pub struct ChildSetup {
    /// The sandbox's end of the bridge; becomes descriptor 3.
    pub bridge_fd: RawFd,
    pub limits: Limits,
    /// Drop to this (uid, gid) first (the gateway runs as root).
    pub drop_to: Option<(u32, u32)>,
    /// New user, network and PID namespaces.
    pub namespaces: bool,
    /// The Landlock ruleset's descriptor.
    pub landlock: Option<RawFd>,
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn limit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let rlim = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit with a valid struct.
    check(unsafe { libc::setrlimit(resource, &rlim) })
}

impl ChildSetup {
    /// Runs in the forked child, before `exec`.
    ///
    /// # Safety
    /// Only between `fork` and `exec` (from `Command::pre_exec`): it makes only
    /// async-signal-safe calls and may fork and exit the calling process.
    pub unsafe fn apply(&self) -> io::Result<()> {
        // SAFETY (whole body): plain system calls on values prepared before the fork.
        unsafe {
            if self.bridge_fd == 3 {
                check(libc::fcntl(3, libc::F_SETFD, 0))?;
            } else {
                check(libc::dup2(self.bridge_fd, 3))?;
            }
            check(libc::setsid())?;
            limit(libc::RLIMIT_AS, self.limits.address_space_bytes)?;
            limit(libc::RLIMIT_CPU, self.limits.cpu_seconds)?;
            limit(libc::RLIMIT_FSIZE, self.limits.file_size_bytes)?;
            limit(libc::RLIMIT_NOFILE, self.limits.open_files)?;
            limit(libc::RLIMIT_CORE, 0)?;
            if let Some((uid, gid)) = self.drop_to {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(gid))?;
                check(libc::setuid(uid))?;
            }
            if self.namespaces {
                check(libc::unshare(
                    libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::CLONE_NEWPID,
                ))?;
                // After the namespace exists: a new user namespace caps its parent level at the
                // creator's limit, so setting it before would count every sandbox's processes
                // together and let one fork bomb starve the others. Now it counts this one's.
                limit(libc::RLIMIT_NPROC, self.limits.processes)?;
                // The runner must be PID 1 of the new namespace: fork once more and let this
                // process only wait and pass on the exit status.
                match libc::fork() {
                    -1 => return Err(io::Error::last_os_error()),
                    0 => {
                        // Die with the waiter, so a kill of the process group reaches the runner.
                        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
                    }
                    child => {
                        // Close everything but stdio: above all std's exec-status pipe, which
                        // would otherwise keep `spawn` waiting for the whole run.
                        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
                        let mut status = 0;
                        loop {
                            if libc::waitpid(child, &mut status, 0) == child {
                                break;
                            }
                            if *libc::__errno_location() != libc::EINTR {
                                libc::_exit(127);
                            }
                        }
                        let code = if libc::WIFEXITED(status) {
                            libc::WEXITSTATUS(status)
                        } else {
                            128 + libc::WTERMSIG(status)
                        };
                        libc::_exit(code);
                    }
                }
            }
            if !self.namespaces {
                limit(libc::RLIMIT_NPROC, self.limits.processes)?;
            }
            if let Some(ruleset) = self.landlock {
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                let r = libc::syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0u32);
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }
}
