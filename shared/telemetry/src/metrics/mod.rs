//! The one metric definition table. Instruments are built from it, and `docs/metrics.md` is
//! generated from it (a test fails when the committed file drifts).
//!
//! The model-serving and gateway tables are a contract: the same names, types and units as the
//! original Nomad's.

mod instruments;

pub use instruments::meter;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstrumentKind {
    Counter,
    Histogram,
    ObservableCounter,
    ObservableUpDownCounter,
    ObservableGauge,
}

impl InstrumentKind {
    pub fn doc_name(self) -> &'static str {
        match self {
            InstrumentKind::Counter => "counter",
            InstrumentKind::Histogram => "histogram",
            InstrumentKind::ObservableCounter => "observable counter",
            InstrumentKind::ObservableUpDownCounter => "observable up/down counter",
            InstrumentKind::ObservableGauge => "observable gauge",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: InstrumentKind,
    pub unit: &'static str,
    pub description: &'static str,
}

const fn def(
    name: &'static str,
    kind: InstrumentKind,
    unit: &'static str,
    description: &'static str,
) -> MetricDef {
    MetricDef {
        name,
        kind,
        unit,
        description,
    }
}

use InstrumentKind::{
    Counter as C, Histogram as H, ObservableCounter as OC, ObservableGauge as G,
    ObservableUpDownCounter as U,
};

pub const TOOL_REQUESTS: MetricDef = def(
    "nomad.tool.requests",
    C,
    "{request}",
    "Tool requests accepted by the Torch tool manager.",
);
pub const TOOL_REQUEST_ERRORS: MetricDef = def(
    "nomad.tool.request_errors",
    C,
    "{request}",
    "Tool requests completed with an execution error.",
);
pub const TOOL_REQUEST_CANCELLATIONS: MetricDef = def(
    "nomad.tool.request_cancellations",
    C,
    "{request}",
    "Tool requests cancelled while pending or executing.",
);
pub const TOOL_REQUEST_REJECTIONS: MetricDef = def(
    "nomad.tool.request_rejections",
    C,
    "{request}",
    "Tool requests rejected before enqueueing.",
);
pub const TOOL_REQUEST_DURATION: MetricDef = def(
    "nomad.tool.request.duration",
    H,
    "s",
    "End-to-end tool request duration, including queue wait.",
);
pub const TOOL_REQUEST_QUEUE_WAIT: MetricDef = def(
    "nomad.tool.request.queue_wait",
    H,
    "s",
    "Time a tool request waits before batch execution starts.",
);
pub const TOOL_BATCH_DURATION: MetricDef = def(
    "nomad.tool.batch.duration",
    H,
    "s",
    "Wall time spent executing one model batch.",
);
pub const TOOL_BATCH_SIZE: MetricDef = def(
    "nomad.tool.batch.size",
    H,
    "{request}",
    "Number of requests included in an executed model batch.",
);
pub const TOOL_BATCH_OOM_REDUCTIONS: MetricDef = def(
    "nomad.tool.batch.oom_reductions",
    C,
    "{event}",
    "Batch size reductions caused by out-of-memory errors.",
);
pub const TOOL_DEVICE_LOAD_DURATION: MetricDef = def(
    "nomad.tool.device.load_duration",
    H,
    "s",
    "Time spent moving a tool onto a device.",
);
pub const TOOL_DEVICE_OFFLOADS: MetricDef = def(
    "nomad.tool.device.offloads",
    C,
    "{event}",
    "Tool offload operations to CPU.",
);
pub const TOOL_DEVICE_IDLE_EVICTIONS: MetricDef = def(
    "nomad.tool.device.idle_evictions",
    C,
    "{event}",
    "Device allocations removed after a tool idle timeout.",
);
pub const TOOL_DISK_LOADS: MetricDef = def(
    "nomad.tool.disk.loads",
    C,
    "{event}",
    "Tool load attempts from a registered source.",
);
pub const TOOL_DISK_LOAD_DURATION: MetricDef = def(
    "nomad.tool.disk.load_duration",
    H,
    "s",
    "Wall time spent loading a tool from a registered source.",
);
pub const TOOL_DISK_UNLOADS: MetricDef = def(
    "nomad.tool.disk.unloads",
    C,
    "{event}",
    "Resident CPU tool instances unloaded after a disk idle timeout.",
);
pub const DEVICE_CACHE_CLEARS: MetricDef = def(
    "nomad.device.cache_clears",
    C,
    "{event}",
    "Accelerator cache clear attempts after server idle periods.",
);
pub const DEVICE_CACHE_CLEAR_DURATION: MetricDef = def(
    "nomad.device.cache_clear.duration",
    H,
    "s",
    "Wall time spent clearing unused accelerator cache.",
);
pub const TOOL_QUEUE_LENGTH: MetricDef = def(
    "nomad.tool.queue.length",
    U,
    "{request}",
    "Pending requests per managed tool.",
);
pub const TOOL_INFLIGHT_REQUESTS: MetricDef = def(
    "nomad.tool.inflight.requests",
    U,
    "{request}",
    "Requests currently assigned to executing batches.",
);
pub const TOOL_BATCH_CONFIGURED_SIZE: MetricDef = def(
    "nomad.tool.batch.configured_size",
    U,
    "{request}",
    "Current effective batch size per managed tool.",
);
pub const TOOL_PENDING_TOOLS: MetricDef = def(
    "nomad.tool.pending_tools",
    U,
    "{tool}",
    "Number of tools waiting for scheduler dispatch.",
);
pub const DEVICE_SLOT_BUSY: MetricDef = def(
    "nomad.device.slot.busy",
    G,
    "1",
    "Whether a managed device slot is busy.",
);
pub const DEVICE_TOOL_LOADED: MetricDef = def(
    "nomad.device.tool.loaded",
    U,
    "1",
    "Whether a tool is resident on a managed device slot.",
);
pub const TOOL_RESIDENT: MetricDef = def(
    "nomad.tool.resident",
    U,
    "1",
    "Whether a managed tool has a resident CPU instance.",
);
pub const DEVICE_MEMORY_ALLOCATED: MetricDef = def(
    "nomad.device.memory.allocated",
    G,
    "By",
    "Best-effort accelerator memory currently allocated.",
);
pub const DEVICE_MEMORY_RESERVED: MetricDef = def(
    "nomad.device.memory.reserved",
    G,
    "By",
    "Best-effort accelerator memory currently reserved by the backend.",
);
pub const DEVICE_UTILIZATION: MetricDef = def(
    "nomad.device.utilization",
    G,
    "1",
    "Backend-reported device utilization ratio when available.",
);

pub const GATEWAY_REQUESTS: MetricDef = def(
    "nomad.gateway.requests",
    C,
    "{request}",
    "Code-mode gateway requests received.",
);
pub const GATEWAY_REQUEST_DURATION: MetricDef = def(
    "nomad.gateway.request.duration",
    H,
    "s",
    "Code-mode gateway request duration.",
);
pub const GATEWAY_SANDBOX_DURATION: MetricDef = def(
    "nomad.gateway.sandbox.duration",
    H,
    "s",
    "Sandbox subprocess execution duration.",
);
pub const GATEWAY_UPSTREAM_TOOL_CALLS: MetricDef = def(
    "nomad.gateway.upstream_tool.calls",
    C,
    "{call}",
    "Upstream MCP tool calls made through the code-mode gateway.",
);
pub const GATEWAY_UPSTREAM_TOOL_DURATION: MetricDef = def(
    "nomad.gateway.upstream_tool.duration",
    H,
    "s",
    "Duration of upstream MCP tool calls made through the gateway.",
);

pub const PROCESS_CPU_TIME: MetricDef = def(
    "process.cpu.time",
    OC,
    "s",
    "CPU seconds this process has used, by cpu.mode (user, system).",
);
pub const PROCESS_MEMORY_USAGE: MetricDef = def(
    "process.memory.usage",
    U,
    "By",
    "Resident memory of this process.",
);
pub const PROCESS_THREAD_COUNT: MetricDef = def(
    "process.thread.count",
    U,
    "{thread}",
    "Threads of this process.",
);
pub const PROCESS_FD_COUNT: MetricDef = def(
    "process.unix.file_descriptor.count",
    U,
    "{file_descriptor}",
    "Open file descriptors of this process.",
);
pub const SERVER_REQUESTS_IN_FLIGHT: MetricDef = def(
    "nomad.server.requests.in_flight",
    U,
    "{request}",
    "gRPC requests this server is handling now.",
);
pub const RUNTIME_LAG: MetricDef = def(
    "nomad.runtime.lag",
    H,
    "s",
    "How late a fixed-interval sleep on the async runtime wakes: scheduling delay.",
);
pub const RUNTIME_BUSY_RATIO: MetricDef = def(
    "nomad.runtime.busy_ratio",
    G,
    "1",
    "Share of the runtime workers' time spent running tasks since the last export.",
);
pub const RUNTIME_GLOBAL_QUEUE_DEPTH: MetricDef = def(
    "nomad.runtime.global_queue.depth",
    U,
    "{task}",
    "Tasks waiting in the runtime's global queue.",
);
pub const RUNTIME_TASKS_ALIVE: MetricDef = def(
    "nomad.runtime.tasks.alive",
    U,
    "{task}",
    "Tasks alive on the runtime (only with runtime_task_count).",
);

pub const SERVER_MEMORY_USAGE: MetricDef = def(
    "nomad.server.memory.usage",
    G,
    "By",
    "Memory of a server's whole process tree, by memory.type (rss, pss).",
);
pub const SERVER_MEMORY_SAMPLED_PEAK: MetricDef = def(
    "nomad.server.memory.sampled_peak",
    G,
    "By",
    "Highest sampled memory of a server's process tree, by memory.type.",
);
pub const SERVER_PROCESSES: MetricDef = def(
    "nomad.server.processes",
    G,
    "{process}",
    "Processes in a server's process tree.",
);
pub const HOST_MEMORY_USAGE: MetricDef = def(
    "nomad.host.memory.usage",
    G,
    "By",
    "Host memory in use (total minus available).",
);
pub const HOST_MEMORY_AVAILABLE: MetricDef = def(
    "nomad.host.memory.available",
    G,
    "By",
    "Host memory available for new work.",
);
pub const HOST_MEMORY_TOTAL: MetricDef =
    def("nomad.host.memory.total", G, "By", "Host memory in all.");
pub const HOST_MEMORY_SAMPLED_PEAK: MetricDef = def(
    "nomad.host.memory.sampled_peak",
    G,
    "By",
    "Highest sampled host memory in use.",
);

pub const ROLLOUT_DURATION: MetricDef = def(
    "nomad.rollout.duration",
    H,
    "s",
    "Wall time of one rollout: agent step and verification, by status.",
);
pub const VERIFY_DURATION: MetricDef = def(
    "nomad.verify.duration",
    H,
    "s",
    "Wall time of one rollout's verification, by verify kind and outcome (passed, failed, error).",
);
pub const SERVERS_ACTIVE: MetricDef = def(
    "nomad.servers.active",
    U,
    "{server}",
    "Servers of the fleet that are running, by server type.",
);
pub const SERVERS_RESTARTS: MetricDef = def(
    "nomad.servers.restarts",
    C,
    "{restart}",
    "Servers of the fleet started again after they exited on their own, by server name and type.",
);

/// The model-serving table, in the original's order.
pub const MODEL_SERVING: &[MetricDef] = &[
    TOOL_REQUESTS,
    TOOL_REQUEST_ERRORS,
    TOOL_REQUEST_CANCELLATIONS,
    TOOL_REQUEST_REJECTIONS,
    TOOL_REQUEST_DURATION,
    TOOL_REQUEST_QUEUE_WAIT,
    TOOL_BATCH_DURATION,
    TOOL_BATCH_SIZE,
    TOOL_BATCH_OOM_REDUCTIONS,
    TOOL_DEVICE_LOAD_DURATION,
    TOOL_DEVICE_OFFLOADS,
    TOOL_DEVICE_IDLE_EVICTIONS,
    TOOL_DISK_LOADS,
    TOOL_DISK_LOAD_DURATION,
    TOOL_DISK_UNLOADS,
    DEVICE_CACHE_CLEARS,
    DEVICE_CACHE_CLEAR_DURATION,
    TOOL_QUEUE_LENGTH,
    TOOL_INFLIGHT_REQUESTS,
    TOOL_BATCH_CONFIGURED_SIZE,
    TOOL_PENDING_TOOLS,
    DEVICE_SLOT_BUSY,
    DEVICE_TOOL_LOADED,
    TOOL_RESIDENT,
    DEVICE_MEMORY_ALLOCATED,
    DEVICE_MEMORY_RESERVED,
    DEVICE_UTILIZATION,
];

pub const TOOL_BATCH_REGROWTHS: MetricDef = def(
    "nomad.tool.batch.regrowths",
    C,
    "{event}",
    "Batch sizes doubled back toward the configured size after good batches at an out-of-memory-reduced size.",
);

pub const TOOL_GENERATE_TIME_TO_FIRST_TOKEN: MetricDef = def(
    "nomad.tool.generate.time_to_first_token",
    H,
    "s",
    "From a generation request reaching its worker to its first generated token (waiting for a place in the decode loop and prefill), by `tool`.",
);
pub const TOOL_GENERATE_TOKENS: MetricDef = def(
    "nomad.tool.generate.tokens",
    C,
    "{token}",
    "Tokens of finished generations, by `tool` and `phase` (`prefill`: prompt tokens computed, not those copied from a kept prefix cache; `decode`: generated tokens).",
);

pub const GATEWAY_SANDBOX_ISOLATION: MetricDef = def(
    "nomad.gateway.sandbox.isolation",
    G,
    "1",
    "Whether an isolation layer of the sandbox is in force (1) or not (0), by `layer`.",
);
pub const GATEWAY_SANDBOX_RUNS_ACTIVE: MetricDef = def(
    "nomad.gateway.sandbox.runs.active",
    U,
    "{run}",
    "Sandboxed runs executing now.",
);
pub const GATEWAY_SANDBOX_RUNS_QUEUED: MetricDef = def(
    "nomad.gateway.sandbox.runs.queued",
    U,
    "{run}",
    "Runs waiting for a sandbox slot (at most `sandbox.max_queued`).",
);
pub const GATEWAY_SANDBOX_WARM: MetricDef = def(
    "nomad.gateway.sandbox.warm",
    U,
    "{runner}",
    "Sandbox runners started ahead, isolated and waiting for a run.",
);
pub const GATEWAY_SANDBOX_MEMORY_USAGE: MetricDef = def(
    "nomad.gateway.sandbox.memory.usage",
    U,
    "By",
    "Memory the running runs hold together (each run's processes' PSS, sampled; a run not yet sampled counts 32 MiB).",
);
pub const GATEWAY_SANDBOX_MEMORY_LIMIT: MetricDef = def(
    "nomad.gateway.sandbox.memory.limit",
    U,
    "By",
    "What all runs may hold together (`sandbox.memory_budget_bytes`): admission waits while a run would not fit.",
);
pub const GATEWAY_SANDBOX_STARTS: MetricDef = def(
    "nomad.gateway.sandbox.starts",
    C,
    "{run}",
    "Sandboxed runs started, by `start` (warm: a runner from the pool; cold: one started for it).",
);
pub const GATEWAY_SANDBOX_REJECTIONS: MetricDef = def(
    "nomad.gateway.sandbox.rejections",
    C,
    "{run}",
    "Runs refused before starting, by `reason` (queue_full, no_slot, no_memory, spawn).",
);
pub const GATEWAY_SANDBOX_QUEUE_WAIT: MetricDef = def(
    "nomad.gateway.sandbox.queue_wait",
    H,
    "s",
    "Time a run waited for admission (memory and a slot), by `outcome` (admitted, queue_full, no_slot, no_memory, spawn).",
);

pub const GATEWAY_TASKS_CREATED: MetricDef = def(
    "nomad.gateway.tasks.created",
    C,
    "{task}",
    "MCP tasks stored and started (a `tools/call` answered with a task handle), by `tool`.",
);
pub const GATEWAY_TASKS_FINISHED: MetricDef = def(
    "nomad.gateway.tasks.finished",
    C,
    "{task}",
    "MCP tasks that ended, by `outcome` (completed, failed, cancelled; a task a stop cut off counts as failed).",
);
pub const GATEWAY_TASKS_REJECTED: MetricDef = def(
    "nomad.gateway.tasks.rejected",
    C,
    "{task}",
    "`tools/call`s refused a task, by `tool` and `reason` (full: `gateway.tasks.max_tasks` or `max_bytes` held by working tasks; store: the store failed).",
);
pub const GATEWAY_TASKS_REMOVED: MetricDef = def(
    "nomad.gateway.tasks.removed",
    C,
    "{task}",
    "Finished MCP tasks removed from the store, by `reason` (expired: `gateway.tasks.ttl_seconds` after they ended; evicted: room made for a newer task).",
);

/// The gateway table, in the original's order.
pub const GATEWAY: &[MetricDef] = &[
    GATEWAY_REQUESTS,
    GATEWAY_REQUEST_DURATION,
    GATEWAY_SANDBOX_DURATION,
    GATEWAY_UPSTREAM_TOOL_CALLS,
    GATEWAY_UPSTREAM_TOOL_DURATION,
];

/// The scheduler beyond the original's table.
pub const SCHEDULER: &[MetricDef] = &[
    TOOL_BATCH_REGROWTHS,
    TOOL_GENERATE_TIME_TO_FIRST_TOKEN,
    TOOL_GENERATE_TOKENS,
];

/// The gateway's sandbox: isolation in force, admission and the warm pool.
pub const SANDBOX: &[MetricDef] = &[
    GATEWAY_SANDBOX_ISOLATION,
    GATEWAY_SANDBOX_RUNS_ACTIVE,
    GATEWAY_SANDBOX_RUNS_QUEUED,
    GATEWAY_SANDBOX_WARM,
    GATEWAY_SANDBOX_MEMORY_USAGE,
    GATEWAY_SANDBOX_MEMORY_LIMIT,
    GATEWAY_SANDBOX_STARTS,
    GATEWAY_SANDBOX_REJECTIONS,
    GATEWAY_SANDBOX_QUEUE_WAIT,
];

/// The gateway's MCP tasks: their life in the store.
pub const TASKS: &[MetricDef] = &[
    GATEWAY_TASKS_CREATED,
    GATEWAY_TASKS_FINISHED,
    GATEWAY_TASKS_REJECTED,
    GATEWAY_TASKS_REMOVED,
];

/// Every service, while metrics are exported.
pub const PROCESS: &[MetricDef] = &[
    PROCESS_CPU_TIME,
    PROCESS_MEMORY_USAGE,
    PROCESS_THREAD_COUNT,
    PROCESS_FD_COUNT,
    SERVER_REQUESTS_IN_FLIGHT,
    RUNTIME_LAG,
    RUNTIME_BUSY_RATIO,
    RUNTIME_GLOBAL_QUEUE_DEPTH,
    RUNTIME_TASKS_ALIVE,
];

/// The head, for the fleet it started (memory_profiling).
pub const MEMORY: &[MetricDef] = &[
    SERVER_MEMORY_USAGE,
    SERVER_MEMORY_SAMPLED_PEAK,
    SERVER_PROCESSES,
    HOST_MEMORY_USAGE,
    HOST_MEMORY_AVAILABLE,
    HOST_MEMORY_TOTAL,
    HOST_MEMORY_SAMPLED_PEAK,
];

/// The head, for runs.
pub const RUN: &[MetricDef] = &[
    ROLLOUT_DURATION,
    VERIFY_DURATION,
    SERVERS_ACTIVE,
    SERVERS_RESTARTS,
];

/// Every table, with its docs heading and intro.
pub const TABLES: &[(&str, &str, &[MetricDef])] = &[
    (
        "Model-serving metrics",
        "Recorded by the scheduler (the tool manager) from its own state and the workers' reports.",
        MODEL_SERVING,
    ),
    (
        "Gateway metrics",
        "The gateway metrics cover MCP entrypoints, sandbox execution, and upstream MCP tool calls.",
        GATEWAY,
    ),
    (
        "Scheduler metrics",
        "Recorded by the scheduler beside the model-serving table: batch regrowth, with the same \
         attributes as `nomad.tool.batch.oom_reductions` (`tool`, `old_batch_size`, \
         `new_batch_size`), and generation's time to first token and token counts, from what the \
         worker reports with each answer.",
        SCHEDULER,
    ),
    (
        "Sandbox metrics",
        "The gateway's sandbox: which isolation layers hold (`layer`: user_namespace, \
         mount_namespace, network_namespace, pid_namespace, ipc_namespace, seccomp, landlock, \
         no_new_privs, capabilities_dropped, unprivileged_user, cgroup, rlimits), admission \
         (`sandbox.memory_budget_bytes`, `sandbox.max_concurrent`, `sandbox.max_queued`) and \
         the warm pool.",
        SANDBOX,
    ),
    (
        "Task metrics",
        "The gateway's MCP tasks (docs/tasks.md): each created task ends once, as completed, \
         failed or cancelled, and is removed when it expires or is evicted; a call refused a \
         task is counted by why.",
        TASKS,
    ),
    (
        "Process and runtime metrics",
        "Every service exports these while metrics are on. The async-runtime figures come from \
         Tokio's stable runtime metrics; a request only touches an atomic counter.",
        PROCESS,
    ),
    (
        "Memory metrics",
        "The head samples the fleet it started (`memory_profiling.enabled`): each server's whole \
         process tree from /proc (`smaps_rollup` for RSS and PSS, `statm` for RSS when that is \
         missing; PSS is left out for a tree when any member lacks it), and the host. Attributes: \
         `server`, `memory.type` (rss, pss).",
        MEMORY,
    ),
    (
        "Run metrics",
        "The head records these for `nomad run` and `nomad up`.",
        RUN,
    ),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_are_unique_across_tables() {
        let mut seen = HashSet::new();
        for (_, _, defs) in TABLES {
            for d in *defs {
                assert!(seen.insert(d.name), "{} defined twice", d.name);
            }
        }
    }

    #[test]
    fn contract_tables_have_the_originals_row_counts_and_units() {
        assert_eq!(MODEL_SERVING.len(), 27);
        assert_eq!(GATEWAY.len(), 5);
        for d in MODEL_SERVING.iter().chain(GATEWAY) {
            let ok = match d.kind {
                InstrumentKind::Histogram => ["s", "{request}"].contains(&d.unit),
                InstrumentKind::ObservableCounter => false,
                _ => d.unit.starts_with('{') || d.unit == "1" || d.unit == "By",
            };
            assert!(ok, "{}: unexpected unit {}", d.name, d.unit);
        }
    }
}
