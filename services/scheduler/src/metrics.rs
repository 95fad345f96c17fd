//! The scheduler's instruments, built from the shared definition table, and the observable
//! gauges that read the driver's published snapshot and the workers' reports.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nomad_telemetry::KeyValue;
use nomad_telemetry::metrics as defs;
use opentelemetry::metrics::{Counter, Histogram, ObservableGauge, ObservableUpDownCounter};

use nomad_proto::v1::WorkerStats;
use nomad_scheduler_core::{SlotId, SlotSnapshot, Snapshot, ToolSnapshot};
use nomad_telemetry::metrics::MetricDef;

use crate::workers::{WorkerRegistry, worker_of};

/// The lanes of worker `generation` (one slot for a GPU worker).
fn lanes_of(slots: &[SlotSnapshot], generation: SlotId) -> impl Iterator<Item = &SlotSnapshot> {
    slots
        .iter()
        .filter(move |s| worker_of(s.slot) == generation)
}

pub struct Metrics {
    pub requests: Counter<u64>,
    pub request_errors: Counter<u64>,
    pub request_cancellations: Counter<u64>,
    pub request_rejections: Counter<u64>,
    pub request_duration: Histogram<f64>,
    pub request_queue_wait: Histogram<f64>,
    pub batch_duration: Histogram<f64>,
    pub batch_size: Histogram<u64>,
    pub batch_oom_reductions: Counter<u64>,
    pub batch_regrowths: Counter<u64>,
    pub generate_time_to_first_token: Histogram<f64>,
    pub generate_tokens: Counter<u64>,
    pub device_load_duration: Histogram<f64>,
    pub device_offloads: Counter<u64>,
    pub device_idle_evictions: Counter<u64>,
    pub disk_loads: Counter<u64>,
    pub disk_load_duration: Histogram<f64>,
    pub disk_unloads: Counter<u64>,
    pub cache_clears: Counter<u64>,
    pub cache_clear_duration: Histogram<f64>,
    /// The last seconds of requests and batches, for `Snapshot`.
    pub recent: Arc<crate::recent::Recent>,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            requests: defs::TOOL_REQUESTS.u64_counter(),
            request_errors: defs::TOOL_REQUEST_ERRORS.u64_counter(),
            request_cancellations: defs::TOOL_REQUEST_CANCELLATIONS.u64_counter(),
            request_rejections: defs::TOOL_REQUEST_REJECTIONS.u64_counter(),
            request_duration: defs::TOOL_REQUEST_DURATION.f64_histogram(),
            request_queue_wait: defs::TOOL_REQUEST_QUEUE_WAIT.f64_histogram(),
            batch_duration: defs::TOOL_BATCH_DURATION.f64_histogram(),
            batch_size: defs::TOOL_BATCH_SIZE.u64_histogram(),
            batch_oom_reductions: defs::TOOL_BATCH_OOM_REDUCTIONS.u64_counter(),
            batch_regrowths: defs::TOOL_BATCH_REGROWTHS.u64_counter(),
            generate_time_to_first_token: defs::TOOL_GENERATE_TIME_TO_FIRST_TOKEN.f64_histogram(),
            generate_tokens: defs::TOOL_GENERATE_TOKENS.u64_counter(),
            device_load_duration: defs::TOOL_DEVICE_LOAD_DURATION.f64_histogram(),
            device_offloads: defs::TOOL_DEVICE_OFFLOADS.u64_counter(),
            device_idle_evictions: defs::TOOL_DEVICE_IDLE_EVICTIONS.u64_counter(),
            disk_loads: defs::TOOL_DISK_LOADS.u64_counter(),
            disk_load_duration: defs::TOOL_DISK_LOAD_DURATION.f64_histogram(),
            disk_unloads: defs::TOOL_DISK_UNLOADS.u64_counter(),
            cache_clears: defs::DEVICE_CACHE_CLEARS.u64_counter(),
            cache_clear_duration: defs::DEVICE_CACHE_CLEAR_DURATION.f64_histogram(),
            recent: Default::default(),
        }
    }
}

/// What the gauges read, published by the driver: the core's snapshot and each slot's device.
#[derive(Default)]
pub struct Published {
    pub core: Snapshot,
    pub devices: HashMap<SlotId, Vec<KeyValue>>,
}

/// The observable instruments; they report for as long as this value lives.
pub struct Gauges {
    _up_down: Vec<ObservableUpDownCounter<i64>>,
    _gauges: Vec<ObservableGauge<f64>>,
}

fn read<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Each worker (its first lane's slot) with its device's attributes.
fn devices(published: &Published) -> impl Iterator<Item = (SlotId, &Vec<KeyValue>)> {
    published
        .core
        .slots
        .iter()
        .filter(|s| worker_of(s.slot) == s.slot)
        .filter_map(|s| published.devices.get(&s.slot).map(|d| (s.slot, d)))
}

/// A gauge of one figure per tool, read from the published snapshot.
fn per_tool(
    def: &MetricDef,
    published: &Arc<Mutex<Published>>,
    figure: impl Fn(&ToolSnapshot) -> i64 + Send + Sync + 'static,
) -> ObservableUpDownCounter<i64> {
    let p = published.clone();
    def.i64_observable_up_down_counter(move |o| {
        for t in &read(&p).core.tools {
            o.observe(figure(t), &[KeyValue::new("tool", t.name.clone())]);
        }
    })
}

/// A gauge of one figure per worker, from its heartbeats: a figure a worker does not report is
/// left out, never shown as zero.
fn per_device(
    def: &MetricDef,
    registry: &Arc<WorkerRegistry>,
    figure: impl Fn(&WorkerStats) -> Option<f64> + Send + Sync + 'static,
) -> ObservableGauge<f64> {
    let r = registry.clone();
    def.f64_observable_gauge(move |o| {
        for (attributes, stats) in r.stats() {
            if let Some(v) = figure(&stats) {
                o.observe(v, &attributes);
            }
        }
    })
}

/// Registers every observable instrument of the model-serving table. Callbacks run on the
/// metric reader's thread and only read published state.
pub fn gauges(published: Arc<Mutex<Published>>, registry: Arc<WorkerRegistry>) -> Gauges {
    let queue = per_tool(&defs::TOOL_QUEUE_LENGTH, &published, |t| {
        t.queue_length as i64
    });
    let inflight = per_tool(&defs::TOOL_INFLIGHT_REQUESTS, &published, |t| {
        i64::from(t.inflight)
    });
    let configured = per_tool(&defs::TOOL_BATCH_CONFIGURED_SIZE, &published, |t| {
        i64::from(t.batch_size)
    });
    let p = published.clone();
    let pending = defs::TOOL_PENDING_TOOLS.i64_observable_up_down_counter(move |o| {
        o.observe(read(&p).core.pending_tools as i64, &[]);
    });
    let resident = per_tool(&defs::TOOL_RESIDENT, &published, |t| i64::from(t.resident));
    let p = published.clone();
    let loaded = defs::DEVICE_TOOL_LOADED.i64_observable_up_down_counter(move |o| {
        let published = read(&p);
        // Once per worker: a CPU worker's lanes together say what it holds.
        for (worker, device) in devices(&published) {
            let lanes = || lanes_of(&published.core.slots, worker);
            for t in &published.core.tools {
                let mut attributes = device.clone();
                attributes.push(KeyValue::new("tool", t.name.clone()));
                let on = lanes().any(|l| l.on_device.as_deref() == Some(t.name.as_str()));
                o.observe(i64::from(on), &attributes);
            }
        }
    });
    let p = published;
    let busy = defs::DEVICE_SLOT_BUSY.f64_observable_gauge(move |o| {
        let published = read(&p);
        for (worker, device) in devices(&published) {
            let busy = lanes_of(&published.core.slots, worker).any(|l| l.busy);
            o.observe(if busy { 1.0 } else { 0.0 }, device);
        }
    });
    let allocated = per_device(&defs::DEVICE_MEMORY_ALLOCATED, &registry, |s| {
        s.memory_allocated_bytes.map(|v| v as f64)
    });
    let reserved = per_device(&defs::DEVICE_MEMORY_RESERVED, &registry, |s| {
        s.memory_reserved_bytes.map(|v| v as f64)
    });
    let utilization = per_device(&defs::DEVICE_UTILIZATION, &registry, |s| s.utilization);
    Gauges {
        _up_down: vec![queue, inflight, configured, pending, resident, loaded],
        _gauges: vec![busy, allocated, reserved, utilization],
    }
}
