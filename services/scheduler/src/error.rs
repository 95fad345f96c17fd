//! Why a call, or a question about a tool, was refused or failed: the scheduler's own error,
//! each variant with its words and its category. It becomes a gRPC status in `grpc_service.rs`
//! only; the driver and the catalog never build one.

use nomad_scheduler_core::Outcome;

/// What kind of refusal or failure, as callers act on it (the gRPC codes' names, so spans and
/// statuses say the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    InvalidArgument,
    NotFound,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    Internal,
    Cancelled,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CallError {
    #[error("the scheduler is shutting down")]
    Stopped,
    #[error("unknown tool {tool:?}; this scheduler serves: {}", known.join(", "))]
    UnknownTool { tool: String, known: Vec<String> },
    #[error("tool {tool:?} already has {limit} requests queued (its max_pending); retry later")]
    QueueFull { tool: String, limit: u32 },
    #[error(
        "tool {tool:?} is still starting: no worker has described it within {seconds} s (a \
         Python model's environment is built once per host; the device worker's log shows its \
         progress); retry shortly"
    )]
    StillStarting { tool: String, seconds: u64 },
    #[error(
        "tool {tool:?} is not described yet (no worker has registered, or its environment is \
         still building); retry shortly"
    )]
    NotDescribed { tool: String },
    #[error("tool {tool:?} cannot serve: {why}")]
    CannotServe { tool: String, why: String },
    /// An input of the wrong form for the tool's kind, refused before it is queued.
    #[error("{0}")]
    WrongInput(String),
    #[error("no tool is named {tool:?}; tools: {}", known.join(", "))]
    NoSuchTool { tool: String, known: Vec<String> },
    #[error("tool {tool:?} has no model card: its model directory ({directory}) has no README.md")]
    NoModelCard { tool: String, directory: String },
    /// How the worker's batch ended for this request, when it gave no output.
    #[error("{}", outcome_words(.tool, .outcome))]
    Outcome { tool: String, outcome: Outcome },
}

fn outcome_words(tool: &str, outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ok => format!("{tool}: the worker reported success without an output"),
        Outcome::InvalidInput(m) | Outcome::Failed(m) | Outcome::Unavailable(m) => {
            format!("{tool}: {m}")
        }
        Outcome::OutOfMemory(m) => {
            format!("{tool}: out of memory even with a batch of one: {m}")
        }
        Outcome::Cancelled => "the request was cancelled".to_owned(),
    }
}

impl CallError {
    pub fn category(&self) -> Category {
        match self {
            CallError::Stopped
            | CallError::StillStarting { .. }
            | CallError::NotDescribed { .. } => Category::Unavailable,
            CallError::UnknownTool { .. }
            | CallError::NoSuchTool { .. }
            | CallError::NoModelCard { .. } => Category::NotFound,
            CallError::QueueFull { .. } => Category::ResourceExhausted,
            CallError::CannotServe { .. } => Category::FailedPrecondition,
            CallError::WrongInput(_) => Category::InvalidArgument,
            CallError::Outcome { outcome, .. } => match outcome {
                Outcome::Ok | Outcome::Failed(_) => Category::Internal,
                Outcome::InvalidInput(_) => Category::InvalidArgument,
                Outcome::OutOfMemory(_) => Category::ResourceExhausted,
                Outcome::Unavailable(_) => Category::Unavailable,
                Outcome::Cancelled => Category::Cancelled,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_says_what_happened_and_falls_in_its_category() {
        let cases = [
            (
                CallError::UnknownTool {
                    tool: "x".into(),
                    known: vec!["embed".into(), "mlp".into()],
                },
                "unknown tool \"x\"; this scheduler serves: embed, mlp",
                Category::NotFound,
            ),
            (
                CallError::QueueFull {
                    tool: "mlp".into(),
                    limit: 4,
                },
                "tool \"mlp\" already has 4 requests queued (its max_pending); retry later",
                Category::ResourceExhausted,
            ),
            (
                CallError::Outcome {
                    tool: "mlp".into(),
                    outcome: Outcome::OutOfMemory("12 GiB".into()),
                },
                "mlp: out of memory even with a batch of one: 12 GiB",
                Category::ResourceExhausted,
            ),
            (
                CallError::Outcome {
                    tool: "mlp".into(),
                    outcome: Outcome::Cancelled,
                },
                "the request was cancelled",
                Category::Cancelled,
            ),
        ];
        for (error, words, category) in cases {
            assert_eq!(error.to_string(), words);
            assert_eq!(error.category(), category, "{words}");
        }
    }
}
