//! Process and device figures reported to the scheduler. A figure the backend cannot give is
//! left out, never invented.

use nomad_proto::v1::WorkerStats;

use crate::models::load::Backend;
use crate::store::ModelStore;

/// Bytes of the models placed on the device.
pub fn placed_bytes(store: &ModelStore) -> u64 {
    store
        .models()
        .iter()
        .filter(|m| m.on_device)
        .map(|m| m.bytes)
        .sum()
}

pub fn collect(store: &ModelStore, backend: &Backend, on_accelerator: bool) -> WorkerStats {
    let models = store.models();
    let placed = placed_bytes(store);
    // On CPU the "device memory" is the bytes of the models placed for execution. On CUDA it is
    // what the driver reports in use on the device (best effort: every process's allocations);
    // candle keeps no allocator cache, so nothing is "reserved", and utilization needs NVML.
    // The simulated device reports what an accelerator backend would.
    let (allocated, reserved, utilization) = match backend {
        Backend::Sim(device) => (
            Some(placed),
            Some(device.reserved(placed)),
            Some(device.utilization()),
        ),
        Backend::Candle if on_accelerator => (
            crate::device::memory_info(store.device()).map(|(free, total)| total - free),
            None,
            None,
        ),
        Backend::Candle => (Some(placed), None, None),
    };
    WorkerStats {
        memory_allocated_bytes: allocated,
        memory_reserved_bytes: reserved,
        utilization,
        process_rss_bytes: nomad_telemetry::process::rss_bytes(None),
        models,
    }
}
