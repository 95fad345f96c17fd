//! Process and device figures reported to the scheduler. A figure the backend cannot give is
//! left out, never invented.

use nomad_proto::v1::WorkerStats;

use crate::store::ModelStore;

/// Resident set size of this process from `/proc/self/statm` (Linux only).
pub fn process_rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages * p)
}

pub fn collect(store: &ModelStore, on_accelerator: bool) -> WorkerStats {
    let models = store.models();
    // On CPU the "device memory" is the bytes of the models placed for execution; an
    // accelerator's allocator figures come with its backend (not measured here).
    let allocated =
        (!on_accelerator).then(|| models.iter().filter(|m| m.on_device).map(|m| m.bytes).sum());
    WorkerStats {
        memory_allocated_bytes: allocated,
        memory_reserved_bytes: None,
        utilization: None,
        process_rss_bytes: process_rss_bytes(),
        models,
    }
}
