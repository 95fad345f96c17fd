//! Per-process resource limits and the run's CPU priority.

use nix::sys::resource::{Resource, setrlimit};

use crate::error::{Failed, Step as _};
use crate::spec::{Limits, RUN_NICENESS};

pub fn apply(limits: &Limits) -> Result<(), Failed> {
    for (resource, value, name) in [
        (Resource::RLIMIT_AS, limits.address_space_bytes, "RLIMIT_AS"),
        (Resource::RLIMIT_CPU, limits.cpu_seconds, "RLIMIT_CPU"),
        (
            Resource::RLIMIT_FSIZE,
            limits.file_size_bytes,
            "RLIMIT_FSIZE",
        ),
        (Resource::RLIMIT_NOFILE, limits.open_files, "RLIMIT_NOFILE"),
        (Resource::RLIMIT_CORE, 0, "RLIMIT_CORE"),
        // After the user namespace exists: its count is this run's alone.
        (Resource::RLIMIT_NPROC, limits.processes, "RLIMIT_NPROC"),
    ] {
        setrlimit(resource, value, value).step(name)?;
    }
    // Runs yield the CPU to the fleet's own services (the gateway, the scheduler, the model
    // workers): hundreds of runs at once must not starve what serves them. Lowering one's own
    // priority needs no privilege, and a run cannot raise it back (that needs CAP_SYS_NICE).
    // A gateway already nicer than that (started under `nice -n 19`) keeps its niceness: going
    // back up to 10 would need the privilege the sandbox has dropped.
    // SAFETY: getpriority and setpriority have no memory preconditions. (A failed getpriority
    // reads as -1, and the niceness is then set as usual.)
    let current = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if current < RUN_NICENESS
        && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, RUN_NICENESS) } != 0
    {
        return Err(std::io::Error::last_os_error()).step("setpriority");
    }
    Ok(())
}
