//! The scheduler's errors for the core's rejections and outcomes.

use nomad_scheduler_core::{Outcome, Rejection};
use tonic::Status;

use crate::config::ToolConfig;
use crate::error::CallError;

pub fn rejection(rejection: Rejection, tool: &str, known: &[ToolConfig]) -> CallError {
    match rejection {
        Rejection::ManagerClosed => CallError::Stopped,
        Rejection::UnknownTool => CallError::UnknownTool {
            tool: tool.to_owned(),
            known: known.iter().map(|t| t.name.clone()).collect(),
        },
        Rejection::QueueFull => CallError::QueueFull {
            tool: tool.to_owned(),
            limit: known
                .iter()
                .find(|t| t.name == tool)
                .map_or(0, |t| t.max_pending),
        },
    }
}

/// The error of a request that did not end with an output (`Outcome::Ok` without one is the
/// worker's fault).
pub fn failure(outcome: Outcome, tool: &str) -> CallError {
    CallError::Outcome {
        tool: tool.to_owned(),
        outcome,
    }
}

/// A worker RPC failure that means the worker is gone (as opposed to an answer it gave, such as
/// an `UNKNOWN` from a live worker, which fails that batch only).
pub fn lost(status: &Status) -> bool {
    nomad_rpc::peer_lost(status)
}
