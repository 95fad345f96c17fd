//! The scheduler's errors for the core's rejections and outcomes, and a worker call's failure in
//! the driver's terms.

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

/// Why a call to a worker gave no answer: read once from the call's status (`From<Status>`), at
/// the call, so the driver never matches on gRPC codes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkerError {
    /// The worker is gone, or missed the call's deadline: its slots are lost.
    #[error("{0}")]
    Lost(String),
    /// The worker refused or failed this call alone (an `UNKNOWN` from a live worker fails that
    /// batch only); `code` names its category.
    #[error("{code}: {message}")]
    Failed { code: String, message: String },
}

impl WorkerError {
    /// What the worker (or the missing answer) said, without the category.
    pub fn message(&self) -> &str {
        match self {
            WorkerError::Lost(message) | WorkerError::Failed { message, .. } => message,
        }
    }
}

impl From<Status> for WorkerError {
    fn from(status: Status) -> Self {
        if nomad_rpc::peer_lost(&status) {
            WorkerError::Lost(status.message().to_owned())
        } else {
            WorkerError::Failed {
                code: format!("{:?}", status.code()),
                message: status.message().to_owned(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_worker_is_lost_and_an_answer_fails_the_call_alone() {
        assert_eq!(
            WorkerError::from(Status::unavailable("connection refused")),
            WorkerError::Lost("connection refused".into())
        );
        let failed = WorkerError::from(Status::internal("embed: boom"));
        assert_eq!(failed.message(), "embed: boom");
        assert_eq!(failed.to_string(), "Internal: embed: boom");
    }
}
