//! The gRPC statuses callers get, from the core's rejections and outcomes.

use nomad_scheduler_core::{Outcome, Rejection};
use tonic::Status;

use crate::config::ToolConfig;

pub fn stopped() -> Status {
    Status::unavailable("the scheduler is shutting down")
}

pub fn rejection(rejection: Rejection, tool: &str, known: &[ToolConfig]) -> Status {
    match rejection {
        Rejection::ManagerClosed => stopped(),
        Rejection::UnknownTool => {
            let names: Vec<&str> = known.iter().map(|t| t.name.as_str()).collect();
            Status::not_found(format!(
                "unknown tool {tool:?}; this scheduler serves: {}",
                names.join(", ")
            ))
        }
        Rejection::QueueFull => {
            let limit = known
                .iter()
                .find(|t| t.name == tool)
                .map_or(0, |t| t.max_pending);
            Status::resource_exhausted(format!(
                "tool {tool:?} already has {limit} requests queued (its max_pending); retry later"
            ))
        }
    }
}

/// The status of a request that did not end with an output (`Outcome::Ok` without one is the
/// worker's fault).
pub fn failure(outcome: Outcome, tool: &str) -> Status {
    match outcome {
        Outcome::Ok => Status::internal(format!(
            "{tool}: the worker reported success without an output"
        )),
        Outcome::InvalidInput(m) => Status::invalid_argument(format!("{tool}: {m}")),
        Outcome::OutOfMemory(m) => Status::resource_exhausted(format!(
            "{tool}: out of memory even with a batch of one: {m}"
        )),
        Outcome::Failed(m) => Status::internal(format!("{tool}: {m}")),
        Outcome::Unavailable(m) => Status::unavailable(format!("{tool}: {m}")),
        Outcome::Cancelled => Status::cancelled("the request was cancelled"),
    }
}

/// A worker RPC failure that means the worker is gone (as opposed to an answer it gave, such as
/// an `UNKNOWN` from a live worker, which fails that batch only).
pub fn lost(status: &Status) -> bool {
    nomad_rpc::peer_lost(status)
}
