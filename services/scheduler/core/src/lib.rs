//! The tool manager as a state machine with no I/O.
//!
//! Events come in (a request arrived, a batch finished, a worker registered or was lost, time
//! passed) and actions come out (prepare a slot, dispatch a batch, complete a request, evict,
//! unload, clear a cache). Time is an argument, so every rule is testable with a fake clock.
//! The scheduler's driver carries the actions out over gRPC and feeds results back.
//!
//! Invariant: every accepted request is completed exactly once (ok, failed or cancelled).

mod api;
mod rules;
mod snapshot;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

pub use api::*;
pub use snapshot::{SlotSnapshot, Snapshot, ToolSnapshot};

pub type RequestId = u64;
pub type BatchId = u64;
pub type SlotId = u64;
pub type ToolId = usize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Idle,
    Preparing(ToolId),
    /// Running the batches in `Slot::batches` (one, or for a continuous tool up to its bound).
    Executing,
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
    /// Tools that failed to load or place here, not to be tried on this slot again until then.
    backoff: HashMap<ToolId, Backoff>,
    /// Batches running here.
    batches: BTreeSet<BatchId>,
    /// The worker this slot is a lane of: a CPU worker serves several tools at once, one lane
    /// each (all its lanes share this id; a GPU worker is one slot, its own group).
    group: SlotId,
}

/// A failed prepare's wait before the (slot, tool) pair is tried again: doubling, capped.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    until: Instant,
    next: Duration,
    /// Still to end (cleared once a schedule pass sees it over, so its deadline is reported
    /// only while it is pending; `next` is kept for the doubling).
    pending: bool,
}

/// The first wait after a failed prepare, and the longest.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Tool {
    spec: ToolSpec,
    queue: VecDeque<RequestId>,
    /// Current batch size: the configured one until out-of-memory errors halve it.
    batch_size: u32,
    /// Good batches since the size last changed, while it is below the configured one.
    good_batches: u32,
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
    cost: Cost,
    /// Why its workers were lost while it ran. After one loss it runs alone, so an input that
    /// kills workers takes no neighbour down with it; after a second it fails.
    losses: Vec<String>,
}

impl Request {
    /// Runs in a batch of its own.
    fn solo(&self) -> bool {
        !self.losses.is_empty()
    }
}

/// A batch being executed.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub tool: ToolId,
    pub slot: SlotId,
    /// In dispatch order (a cancelled one stays listed; its result is ignored).
    pub requests: Vec<RequestId>,
    /// Requests running on the slot when it was dispatched, itself included.
    pub running: u32,
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
                good_batches: 0,
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

    /// Sets `tool`'s configured batch size (a model that reports its own once it is described);
    /// the size in force follows at once.
    pub fn set_batch_size(&mut self, tool: ToolId, batch_size: u32) {
        if let Some(t) = self.tools.get_mut(tool) {
            t.spec.batch_size = batch_size.max(1);
            t.batch_size = t.spec.batch_size;
            t.good_batches = 0;
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

    /// Request `id` (chosen by the caller, unique) for `tool`, weighing `cost`, arrived.
    /// Accepted requests are completed exactly once later.
    pub fn submit(
        &mut self,
        id: RequestId,
        tool: &str,
        cost: Cost,
        now: Instant,
    ) -> Result<(), Rejection> {
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
                cost,
                losses: Vec::new(),
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
        self.lane_registered(slot, slot, now);
    }

    /// One more lane of worker `group` (a CPU worker serving several tools at once): a slot of
    /// its own, except that a tool is never on two lanes of one worker (they share its memory,
    /// and the worker holds one copy of each tool).
    pub fn lane_registered(&mut self, slot: SlotId, group: SlotId, now: Instant) {
        self.slots.insert(
            slot,
            Slot {
                state: SlotState::Idle,
                on_device: None,
                resident: BTreeSet::new(),
                last_used: now,
                dirty: false,
                backoff: HashMap::new(),
                batches: BTreeSet::new(),
                group,
            },
        );
        self.schedule(now);
    }

    /// A worker died or stopped heartbeating. Its batch's requests are requeued at the front,
    /// each to run alone from now on: an input that kills workers then takes only itself down.
    /// A request whose worker was lost a second time is failed, naming both losses.
    pub fn worker_lost(&mut self, slot: SlotId, reason: &str, now: Instant) {
        let Some(s) = self.slots.remove(&slot) else {
            return;
        };
        let lost: Vec<Batch> = s
            .batches
            .iter()
            .filter_map(|id| self.batches.remove(id))
            .collect();
        // Batches in dispatch order (ids ascend), each batch's requests in theirs.
        let mut requeue = Vec::new();
        for b in lost {
            for request in b.requests {
                let Some(r) = self.requests.get_mut(&request) else {
                    continue; // cancelled while executing
                };
                r.losses.push(reason.to_owned());
                if r.losses.len() > 1 {
                    let losses = r.losses.join("; then ");
                    self.complete(
                        request,
                        Outcome::Unavailable(format!(
                            "two workers were lost while running it ({losses}); not retried \
                             again: it may be the input that brings them down"
                        )),
                        now,
                    );
                } else {
                    r.state = RequestState::Queued;
                    let tool = &mut self.tools[b.tool];
                    tool.inflight = tool.inflight.saturating_sub(1);
                    requeue.push((b.tool, request));
                }
            }
        }
        for (tool, request) in requeue.into_iter().rev() {
            self.tools[tool].queue.push_front(request);
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
                s.backoff.remove(&tool);
            }
            Err(message) => {
                // The offload may have happened; nothing is known to be on the device, and the
                // load may not have.
                s.on_device = None;
                s.resident.remove(&tool);
                let wait = s.backoff.get(&tool).map_or(BACKOFF_FIRST, |b| b.next);
                s.backoff.insert(
                    tool,
                    Backoff {
                        until: now + wait,
                        next: (wait * 2).min(BACKOFF_MAX),
                        pending: true,
                    },
                );
                // Another slot that holds the tool, or may take it, serves what waits; only
                // when none is left do the waiting requests fail, with the worker's words.
                if !self.servable_elsewhere(tool, slot, now) {
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
        }
        self.schedule(now);
    }

    /// The driver finished a `Dispatch`.
    pub fn batch_finished(&mut self, batch: BatchId, result: BatchResult, now: Instant) {
        let Some(b) = self.batches.remove(&batch) else {
            return;
        };
        if let Some(s) = self.slots.get_mut(&b.slot) {
            s.batches.remove(&batch);
            if s.batches.is_empty() {
                s.state = SlotState::Idle;
            }
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
                        Some(ItemFailure::InvalidInput(message)) => Outcome::InvalidInput(message),
                        Some(ItemFailure::Failed(message)) => Outcome::Failed(message),
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
                self.regrow(b.tool);
            }
            BatchResult::OutOfMemory(_) if b.running > 1 => {
                let tool = &mut self.tools[b.tool];
                let old = tool.batch_size;
                // Never above the current size: a batch dispatched before a reduction cannot
                // undo it.
                let new = (old.min(b.running) / 2).max(1);
                tool.good_batches = 0;
                if new < old {
                    tool.batch_size = new;
                    self.actions.push(Action::BatchSizeChanged {
                        tool: b.tool,
                        old,
                        new,
                        cause: SizeChange::OutOfMemory,
                    });
                }
                for request in &live {
                    if let Some(r) = self.requests.get_mut(request) {
                        r.state = RequestState::Queued;
                    }
                }
                let tool = &mut self.tools[b.tool];
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
        // A tool waiting on slots it failed to prepare on is retried when their backoff ends.
        for (id, tool) in self.tools.iter().enumerate() {
            if !tool.queue.is_empty() {
                for s in self.slots.values() {
                    if let Some(b) = s.backoff.get(&id)
                        && b.pending
                    {
                        consider(b.until);
                    }
                }
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
