//! The core under a fake clock: one module per concern, the harness here.

/// What each of `actions` that matches the pattern carries, in order.
macro_rules! picked {
    ($actions:expr, $pattern:pat => $value:expr) => {
        $actions
            .iter()
            .filter_map(|a| match a {
                $pattern => Some($value),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
}

mod budget;
mod continuous;
mod failures;
mod idle;
mod lanes;
mod placement;
mod random;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::*;
use crate::snapshot::SlotSnapshot;

const DELAY: Duration = Duration::from_millis(5);
const IDLE: Duration = Duration::from_secs(10);
const DISK_IDLE: Duration = Duration::from_secs(20);
const GC_IDLE: Duration = Duration::from_secs(30);

fn spec(name: &str, batch_size: u32, max_devices: u32, max_pending: u32) -> ToolSpec {
    ToolSpec::new(name, batch_size, max_devices, max_pending)
}

/// A core with a fake clock.
struct Harness {
    core: Core,
    now: Instant,
    next_id: RequestId,
}

impl Harness {
    fn new(tools: Vec<ToolSpec>, slots: u64) -> Self {
        Self::with_delay(tools, slots, DELAY)
    }

    fn with_delay(tools: Vec<ToolSpec>, slots: u64, max_batch_delay: Duration) -> Self {
        let now = Instant::now();
        let timing = Timing {
            idle: IDLE,
            disk_idle: DISK_IDLE,
            gc_idle: GC_IDLE,
            max_batch_delay,
        };
        let mut core = Core::new(tools, timing, now);
        for slot in 0..slots {
            core.worker_registered(slot, now);
        }
        Harness {
            core,
            now,
            next_id: 0,
        }
    }

    fn advance(&mut self, by: Duration) -> Vec<Action> {
        self.now += by;
        self.core.tick(self.now);
        self.core.take_actions()
    }

    fn submit(&mut self, tool: &str) -> RequestId {
        self.try_submit(tool).unwrap()
    }

    fn try_submit(&mut self, tool: &str) -> Result<RequestId, Rejection> {
        self.submit_costing(tool, Cost::default())
    }

    fn submit_costing(&mut self, tool: &str, cost: Cost) -> Result<RequestId, Rejection> {
        self.next_id += 1;
        self.core.submit(self.next_id, tool, cost, self.now)?;
        Ok(self.next_id)
    }

    fn take(&mut self) -> Vec<Action> {
        self.core.take_actions()
    }

    /// Answers every Prepare in `actions` with success; returns the actions that follow.
    fn prepare_ok(&mut self, actions: &[Action]) -> Vec<Action> {
        let mut out = Vec::new();
        for a in actions {
            if let Action::Prepare { slot, tool, .. } = a {
                self.core.prepare_finished(*slot, *tool, Ok(()), self.now);
                out.extend(self.take());
            }
        }
        out
    }

    /// Answers the pending Prepares with success: the actions that follow.
    fn prepared(&mut self) -> Vec<Action> {
        let actions = self.take();
        self.prepare_ok(&actions)
    }

    /// Answers the pending Prepares with success: the batches then dispatched.
    fn placed(&mut self) -> Vec<(BatchId, SlotId, Vec<RequestId>)> {
        dispatches(&self.prepared())
    }

    /// Submits one request of `tool`, places it, and answers its batch.
    fn served(&mut self, tool: &str) {
        self.submit(tool);
        let d = self.placed();
        self.finish(d[0].0, BatchResult::Done(vec![None]));
    }

    fn finish(&mut self, batch: BatchId, result: BatchResult) -> Vec<Action> {
        self.core.batch_finished(batch, result, self.now);
        self.take()
    }
}

fn prepares(actions: &[Action]) -> Vec<(SlotId, ToolId, Option<ToolId>)> {
    picked!(actions, Action::Prepare { slot, tool, offload, .. } => (*slot, *tool, *offload))
}

fn prepare(slot: SlotId, tool: ToolId, offload: Option<ToolId>, load: Option<LoadKind>) -> Action {
    Action::Prepare {
        slot,
        tool,
        offload,
        load,
    }
}

fn dispatches(actions: &[Action]) -> Vec<(BatchId, SlotId, Vec<RequestId>)> {
    picked!(actions, Action::Dispatch { batch, slot, requests, .. } => (*batch, *slot, requests.clone()))
}

fn completions(actions: &[Action]) -> Vec<(RequestId, Outcome)> {
    picked!(actions, Action::Complete { request, outcome, .. } => (*request, outcome.clone()))
}
