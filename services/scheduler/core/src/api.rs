//! What goes in and out of the manager: tool specs, timers, request costs, rejections,
//! outcomes, batch results, and the actions the driver carries out.

use std::time::Duration;

use crate::{BatchId, RequestId, SlotId, ToolId};

/// A tool as the manager sees it.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub batch_size: u32,
    pub max_devices: u32,
    pub max_pending: u32,
    /// Bytes of inputs one batch carries at most (a single request always goes).
    pub max_batch_bytes: u64,
    /// Estimated tokens one batch carries at most; 0: no limit.
    pub max_batch_tokens: u64,
    /// The model pads a batch to its longest input: when several batches' worth is queued,
    /// batch inputs of similar size together.
    pub group_by_size: bool,
    /// Successful batches at a size out-of-memory reduced before it doubles back.
    pub oom_regrow_after: u32,
    /// Served continuously (generation): a slot holding the tool runs up to `batch_size`
    /// requests at once, each dispatched alone as it arrives and answered when it ends, instead
    /// of one batch at a time. Out-of-memory halving and regrowth apply to that bound.
    pub continuous: bool,
}

impl ToolSpec {
    /// A tool with the default budgets.
    pub fn new(name: &str, batch_size: u32, max_devices: u32, max_pending: u32) -> Self {
        Self {
            name: name.to_owned(),
            batch_size,
            max_devices,
            max_pending,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            max_batch_tokens: 0,
            group_by_size: false,
            oom_regrow_after: 50,
            continuous: false,
        }
    }
}

/// 16 MiB: under the worker hop's 64 MiB message limit with room for outputs and framing.
pub const DEFAULT_MAX_BATCH_BYTES: u64 = 16 << 20;

/// What a request weighs in a batch's budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Bytes of its input as sent to the worker.
    pub bytes: u64,
    /// Tokens it is estimated to have (0 when its kind has no tokens).
    pub tokens: u64,
}

/// The manager's timers.
#[derive(Debug, Clone)]
pub struct Timing {
    /// A slot idle this long gives its device allocation back.
    pub idle: Duration,
    /// A tool with no slot, nothing queued and nothing in flight for this long is unloaded.
    pub disk_idle: Duration,
    /// After the whole server is idle this long, accelerator caches are cleared.
    pub gc_idle: Duration,
    /// How long a partial batch waits to fill.
    pub max_batch_delay: Duration,
}

/// Why a request was turned away before it was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    ManagerClosed,
    UnknownTool,
    QueueFull,
}

impl Rejection {
    /// The `reason` attribute of `nomad.tool.request_rejections`.
    pub fn reason(self) -> &'static str {
        match self {
            Rejection::ManagerClosed => "manager_closed",
            Rejection::UnknownTool => "unknown_tool",
            Rejection::QueueFull => "queue_full",
        }
    }
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The driver holds the output.
    Ok,
    /// The request's own input was refused by the model.
    InvalidInput(String),
    /// Out of memory with a batch of one: nothing left to halve.
    OutOfMemory(String),
    /// The model failed on the batch.
    Failed(String),
    /// Its worker died (after one requeue) or the tool could not be loaded.
    Unavailable(String),
    Cancelled,
}

/// Why the model did not answer one request of a batch that otherwise ran.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemFailure {
    /// The request's own input was refused.
    InvalidInput(String),
    /// The model failed on this request alone (its batch-mates were answered).
    Failed(String),
}

/// How one batch ended, as the driver reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchResult {
    /// One entry per request, in dispatch order: `None` is success.
    Done(Vec<Option<ItemFailure>>),
    OutOfMemory(String),
    Failed(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadKind {
    /// The first host copy of the tool anywhere.
    Resident,
    /// Another host copy, for another worker.
    Replica,
}

impl LoadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadKind::Resident => "resident",
            LoadKind::Replica => "replica",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Make `tool` runnable on `slot`: offload `offload` from the device first, load the weights
    /// from disk when `load` is set, then place on the device. Answer with `prepare_finished`.
    Prepare {
        slot: SlotId,
        tool: ToolId,
        offload: Option<ToolId>,
        load: Option<LoadKind>,
    },
    /// Run `requests` (in order) as one batch. Answer with `batch_finished`.
    Dispatch {
        batch: BatchId,
        slot: SlotId,
        tool: ToolId,
        requests: Vec<RequestId>,
        /// How long each request waited in its queue, in the same order.
        queue_waits: Vec<Duration>,
        /// Requests running on the slot with this batch (its size, or for a continuous tool
        /// every request in flight there).
        running: u32,
    },
    /// `request` ended, `duration` after it was submitted; the driver replies to its caller.
    Complete {
        request: RequestId,
        tool: ToolId,
        outcome: Outcome,
        duration: Duration,
    },
    /// Idle eviction: give `tool`'s device allocation on `slot` back. Answer with `slot_freed`.
    Evict { slot: SlotId, tool: ToolId },
    /// Disk unload: drop `tool`'s host copy on `slot`'s worker. Answer with `slot_freed`.
    Unload { slot: SlotId, tool: ToolId },
    /// Release `slot`'s unused accelerator cache. Answer with `slot_freed`.
    ClearCache { slot: SlotId },
    /// `tool`'s batch size changed: halved by an out-of-memory, or doubled back after enough
    /// good batches.
    BatchSizeChanged {
        tool: ToolId,
        old: u32,
        new: u32,
        cause: SizeChange,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeChange {
    OutOfMemory,
    Regrown,
}
