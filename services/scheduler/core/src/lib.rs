//! The tool manager as a state machine with no I/O.
//!
//! Events come in (a request arrived, a batch finished, a worker registered or was lost, time
//! passed) and actions come out (prepare a slot, dispatch a batch, complete a request, evict,
//! unload, clear a cache). Time is an argument, so every rule is testable with a fake clock.
//! The scheduler's driver carries the actions out over gRPC and feeds results back.
//!
//! Invariant: every accepted request is completed exactly once (ok, failed or cancelled).

mod rules;
mod snapshot;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

pub use snapshot::Snapshot;

pub type RequestId = u64;
pub type BatchId = u64;
pub type SlotId = u64;
pub type ToolId = usize;

/// A tool as the manager sees it.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub batch_size: u32,
    pub max_devices: u32,
    pub max_pending: u32,
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

/// How one batch ended, as the driver reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchResult {
    /// One entry per request, in dispatch order: `None` is success, `Some(msg)` an invalid input.
    Done(Vec<Option<String>>),
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
    /// An out-of-memory halved `tool`'s batch size.
    OomReduced { tool: ToolId, old: u32, new: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Idle,
    Preparing(ToolId),
    Executing(BatchId),
    /// Evicting, unloading or clearing its cache.
    Maintenance,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    /// The tool whose weights are on the device.
    on_device: Option<ToolId>,
    /// Tools with a host copy on this slot's worker.
    resident: BTreeSet<ToolId>,
    last_used: Instant,
    /// Used since its cache was last cleared.
    dirty: bool,
}

#[derive(Debug)]
struct Tool {
    spec: ToolSpec,
    queue: VecDeque<RequestId>,
    /// Current batch size: the configured one until out-of-memory errors halve it.
    batch_size: u32,
    inflight: u32,
    last_used: Instant,
}

impl Tool {
    fn effective_batch(&self) -> usize {
        self.batch_size.min(self.spec.max_pending).max(1) as usize
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestState {
    Queued,
    Executing(BatchId),
}

#[derive(Debug)]
struct Request {
    tool: ToolId,
    enqueued_at: Instant,
    state: RequestState,
    /// Already requeued once after its worker was lost.
    requeued: bool,
}

/// A batch being executed.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub tool: ToolId,
    pub slot: SlotId,
    /// In dispatch order (a cancelled one stays listed; its result is ignored).
    pub requests: Vec<RequestId>,
}

#[derive(Debug)]
pub struct Core {
    timing: Timing,
    tools: Vec<Tool>,
    names: HashMap<String, ToolId>,
    slots: HashMap<SlotId, Slot>,
    requests: HashMap<RequestId, Request>,
    batches: HashMap<BatchId, Batch>,
    next_batch: BatchId,
    closed: bool,
    /// Last time a request arrived or a batch finished (for cache clearing).
    last_activity: Instant,
    actions: Vec<Action>,
}

impl Core {
    pub fn new(tools: Vec<ToolSpec>, timing: Timing, now: Instant) -> Self {
        let names = tools
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let tools = tools
            .into_iter()
            .map(|spec| Tool {
                batch_size: spec.batch_size.max(1),
                spec,
                queue: VecDeque::new(),
                inflight: 0,
                last_used: now,
            })
            .collect();
        Self {
            timing,
            tools,
            names,
            slots: HashMap::new(),
            requests: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 0,
            closed: false,
            last_activity: now,
            actions: Vec::new(),
        }
    }

    /// Actions produced since the last call, in order.
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    pub fn tool_id(&self, name: &str) -> Option<ToolId> {
        self.names.get(name).copied()
    }

    /// Requests accepted and not yet completed.
    pub fn open_requests(&self) -> usize {
        self.requests.len()
    }

    /// A batch still executing.
    pub fn batch(&self, batch: BatchId) -> Option<&Batch> {
        self.batches.get(&batch)
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn complete(&mut self, request: RequestId, outcome: Outcome, now: Instant) {
        if let Some(r) = self.requests.remove(&request) {
            if let RequestState::Executing(_) = r.state {
                self.tools[r.tool].inflight = self.tools[r.tool].inflight.saturating_sub(1);
            }
            self.actions.push(Action::Complete {
                request,
                tool: r.tool,
                outcome,
                duration: now.saturating_duration_since(r.enqueued_at),
            });
        }
    }

    // ---- events -------------------------------------------------------------------------

    /// Request `id` (chosen by the caller, unique) for `tool` arrived. Accepted requests are
    /// completed exactly once later.
    pub fn submit(&mut self, id: RequestId, tool: &str, now: Instant) -> Result<(), Rejection> {
        if self.closed {
            return Err(Rejection::ManagerClosed);
        }
        let tool = self.tool_id(tool).ok_or(Rejection::UnknownTool)?;
        debug_assert!(!self.requests.contains_key(&id), "request id {id} reused");
        let t = &mut self.tools[tool];
        if t.queue.len() >= t.spec.max_pending as usize {
            return Err(Rejection::QueueFull);
        }
        t.queue.push_back(id);
        self.requests.insert(
            id,
            Request {
                tool,
                enqueued_at: now,
                state: RequestState::Queued,
                requeued: false,
            },
        );
        self.last_activity = now;
        self.schedule(now);
        Ok(())
    }

    /// The caller went away or asked to cancel. A queued request leaves its queue; an executing
    /// one is answered now and its result ignored when the batch ends.
    pub fn cancel(&mut self, request: RequestId, now: Instant) {
        let Some(r) = self.requests.get(&request) else {
            return;
        };
        if r.state == RequestState::Queued {
            let queue = &mut self.tools[r.tool].queue;
            if let Some(pos) = queue.iter().position(|&q| q == request) {
                queue.remove(pos);
            }
        }
        self.complete(request, Outcome::Cancelled, now);
        self.schedule(now);
    }

    /// A device worker registered: one more slot.
    pub fn worker_registered(&mut self, slot: SlotId, now: Instant) {
        self.slots.insert(
            slot,
            Slot {
                state: SlotState::Idle,
                on_device: None,
                resident: BTreeSet::new(),
                last_used: now,
                dirty: false,
            },
        );
        self.schedule(now);
    }

    /// A worker died or stopped heartbeating. Its batch's requests are requeued at the front
    /// once; a request that already was is failed.
    pub fn worker_lost(&mut self, slot: SlotId, reason: &str, now: Instant) {
        let Some(s) = self.slots.remove(&slot) else {
            return;
        };
        if let SlotState::Executing(batch) = s.state
            && let Some(b) = self.batches.remove(&batch)
        {
            let mut requeue = Vec::new();
            for request in b.requests {
                let Some(r) = self.requests.get_mut(&request) else {
                    continue; // cancelled while executing
                };
                if r.requeued {
                    self.complete(
                        request,
                        Outcome::Unavailable(format!(
                            "its worker was lost twice ({reason}); not retried again"
                        )),
                        now,
                    );
                } else {
                    r.requeued = true;
                    r.state = RequestState::Queued;
                    let tool = &mut self.tools[b.tool];
                    tool.inflight = tool.inflight.saturating_sub(1);
                    requeue.push(request);
                }
            }
            let queue = &mut self.tools[b.tool].queue;
            for request in requeue.into_iter().rev() {
                queue.push_front(request);
            }
        }
        self.schedule(now);
    }

    /// The driver finished (or failed) a `Prepare`.
    pub fn prepare_finished(
        &mut self,
        slot: SlotId,
        tool: ToolId,
        result: Result<(), String>,
        now: Instant,
    ) {
        let Some(s) = self.slots.get_mut(&slot) else {
            return;
        };
        s.state = SlotState::Idle;
        s.last_used = now;
        match result {
            Ok(()) => {
                s.on_device = Some(tool);
                s.resident.insert(tool);
                s.dirty = true;
            }
            Err(message) => {
                // The offload may have happened; nothing is known to be on the device, and the
                // load may not have.
                s.on_device = None;
                s.resident.remove(&tool);
                // A tool that cannot be loaded fails what waits for it rather than retrying
                // forever; new requests try again.
                let waiting: Vec<_> = self.tools[tool].queue.drain(..).collect();
                for request in waiting {
                    self.complete(
                        request,
                        Outcome::Unavailable(format!(
                            "loading {} failed: {message}",
                            self.tools[tool].spec.name
                        )),
                        now,
                    );
                }
            }
        }
        self.schedule(now);
    }

    /// The driver finished a `Dispatch`.
    pub fn batch_finished(&mut self, batch: BatchId, result: BatchResult, now: Instant) {
        let Some(b) = self.batches.remove(&batch) else {
            return;
        };
        if let Some(s) = self.slots.get_mut(&b.slot) {
            s.state = SlotState::Idle;
            s.last_used = now;
            s.dirty = true;
        }
        self.tools[b.tool].last_used = now;
        self.last_activity = now;
        let live: Vec<RequestId> = b
            .requests
            .iter()
            .copied()
            .filter(|r| self.requests.contains_key(r))
            .collect();
        match result {
            BatchResult::Done(items) => {
                for (request, item) in b.requests.iter().zip(items) {
                    let outcome = match item {
                        None => Outcome::Ok,
                        Some(message) => Outcome::InvalidInput(message),
                    };
                    self.complete(*request, outcome, now);
                }
                // A short answer must not leave requests open.
                for request in live {
                    self.complete(
                        request,
                        Outcome::Failed("the worker returned fewer results than inputs".into()),
                        now,
                    );
                }
            }
            BatchResult::OutOfMemory(_) if b.requests.len() > 1 => {
                let old = b.requests.len() as u32;
                let new = (old / 2).max(1);
                self.actions.push(Action::OomReduced {
                    tool: b.tool,
                    old,
                    new,
                });
                for request in &live {
                    if let Some(r) = self.requests.get_mut(request) {
                        r.state = RequestState::Queued;
                    }
                }
                let tool = &mut self.tools[b.tool];
                tool.batch_size = new;
                tool.inflight = tool.inflight.saturating_sub(live.len() as u32);
                // Back at the front, in their original order.
                for request in live.into_iter().rev() {
                    tool.queue.push_front(request);
                }
            }
            BatchResult::OutOfMemory(detail) => {
                for request in live {
                    self.complete(request, Outcome::OutOfMemory(detail.clone()), now);
                }
            }
            BatchResult::Failed(message) => {
                for request in live {
                    self.complete(request, Outcome::Failed(message.clone()), now);
                }
            }
        }
        self.schedule(now);
    }

    /// The driver finished an `Evict`, `Unload` or `ClearCache` on `slot`.
    pub fn slot_freed(&mut self, slot: SlotId, now: Instant) {
        if let Some(s) = self.slots.get_mut(&slot)
            && s.state == SlotState::Maintenance
        {
            s.state = SlotState::Idle;
        }
        self.schedule(now);
    }

    /// Time passed: fire due timers (batch delay, idle eviction, disk unload, cache clear).
    pub fn tick(&mut self, now: Instant) {
        self.schedule(now);
        self.evict_idle(now);
        self.unload_idle(now);
        self.clear_caches(now);
    }

    /// Stop accepting requests; queued and executing ones still finish.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// When `tick` next has something to do, if ever. Each deadline is only reported while the
    /// condition that fires it holds, so a due deadline never waits on a busy slot.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        let idle = |s: &&Slot| s.state == SlotState::Idle;
        for (id, tool) in self.tools.iter().enumerate() {
            if let Some(&front) = tool.queue.front()
                && self
                    .slots
                    .values()
                    .filter(idle)
                    .any(|s| s.on_device == Some(id))
            {
                consider(self.requests[&front].enqueued_at + self.timing.max_batch_delay);
            }
        }
        for s in self.slots.values().filter(idle) {
            if s.on_device.is_some() {
                consider(s.last_used + self.timing.idle);
            }
        }
        for (id, tool) in self.tools.iter().enumerate() {
            if self.unloadable(id)
                && self
                    .slots
                    .values()
                    .filter(idle)
                    .any(|s| s.resident.contains(&id))
            {
                consider(tool.last_used + self.timing.disk_idle);
            }
        }
        if self.requests.is_empty()
            && self.slots.values().all(|s| s.state == SlotState::Idle)
            && self.slots.values().any(|s| s.dirty)
        {
            consider(self.last_activity + self.timing.gc_idle);
        }
        next
    }
}
