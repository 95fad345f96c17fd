//! Why a tool call failed, as every caller of a tool gets it: sandboxed Python (`ToolError` with
//! `.code`), MCP tool results, the gateway's gRPC `CallTool` and the OpenAI routes. The code says
//! what to do next (fix the arguments, retry later, give up); the message says what was wrong.

use serde::Serialize;

/// The `_meta` key of a failed call's result (and the `data` key of a refusal) that holds its
/// code (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, ...).
pub const ERROR_CODE_META: &str = "nomad/error_code";

/// What kind of failure a tool call met. The names are gRPC's canonical codes, which the
/// scheduler already speaks, so a code passes unchanged from the scheduler to sandboxed code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::IntoStaticStr)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[strum(serialize_all = "SCREAMING_SNAKE_CASE")]
pub enum ToolErrorCode {
    /// The arguments are wrong; the message names which and how.
    InvalidArgument,
    /// No such server or tool.
    NotFound,
    /// The gateway's allowlist does not let this tool through.
    PermissionDenied,
    /// The tool's queue is full: retry later.
    ResourceExhausted,
    /// No worker or upstream server can take the call now: retry later.
    Unavailable,
    /// The tool cannot serve (its model failed to load).
    FailedPrecondition,
    /// No answer in time.
    DeadlineExceeded,
    /// The call was cancelled.
    Cancelled,
    /// The tool itself failed on this input (an MCP tool's error result, a model that raised).
    Unknown,
    /// Anything else: a fault in the fleet, not in the call.
    Internal,
}

impl ToolErrorCode {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// A few words for a person reading an MCP tool result.
    pub fn describe(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid arguments",
            Self::NotFound => "not found",
            Self::PermissionDenied => "not allowed",
            Self::ResourceExhausted => "overloaded (retry later)",
            Self::Unavailable => "unavailable (retry later)",
            Self::FailedPrecondition => "the tool cannot serve",
            Self::DeadlineExceeded => "timed out",
            Self::Cancelled => "cancelled",
            Self::Unknown => "the tool failed",
            Self::Internal => "failed",
        }
    }
}

impl From<tonic::Code> for ToolErrorCode {
    fn from(code: tonic::Code) -> Self {
        use tonic::Code;
        match code {
            Code::InvalidArgument | Code::OutOfRange => Self::InvalidArgument,
            Code::NotFound => Self::NotFound,
            Code::PermissionDenied => Self::PermissionDenied,
            Code::ResourceExhausted => Self::ResourceExhausted,
            Code::Unavailable => Self::Unavailable,
            Code::FailedPrecondition => Self::FailedPrecondition,
            Code::DeadlineExceeded => Self::DeadlineExceeded,
            Code::Cancelled => Self::Cancelled,
            Code::Unknown => Self::Unknown,
            Code::Ok
            | Code::AlreadyExists
            | Code::Aborted
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
            | Code::Unauthenticated => Self::Internal,
        }
    }
}

impl From<ToolErrorCode> for tonic::Code {
    fn from(code: ToolErrorCode) -> Self {
        use tonic::Code;
        match code {
            ToolErrorCode::InvalidArgument => Code::InvalidArgument,
            ToolErrorCode::NotFound => Code::NotFound,
            ToolErrorCode::PermissionDenied => Code::PermissionDenied,
            ToolErrorCode::ResourceExhausted => Code::ResourceExhausted,
            ToolErrorCode::Unavailable => Code::Unavailable,
            ToolErrorCode::FailedPrecondition => Code::FailedPrecondition,
            ToolErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
            ToolErrorCode::Cancelled => Code::Cancelled,
            ToolErrorCode::Unknown => Code::Unknown,
            ToolErrorCode::Internal => Code::Internal,
        }
    }
}

/// A failed tool call: its code and a message naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    pub code: ToolErrorCode,
    pub message: String,
}

impl ToolError {
    pub fn new(code: ToolErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ToolErrorCode::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ToolErrorCode::NotFound, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ToolErrorCode::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ToolErrorCode::Internal, message)
    }
}

impl From<tonic::Status> for ToolError {
    fn from(status: tonic::Status) -> Self {
        Self::new(status.code().into(), status.message())
    }
}

impl From<ToolError> for tonic::Status {
    fn from(error: ToolError) -> Self {
        tonic::Status::new(error.code.into(), error.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheduler_status_keeps_its_code_through_the_gateway() {
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::NotFound,
            tonic::Code::ResourceExhausted,
            tonic::Code::Unavailable,
            tonic::Code::FailedPrecondition,
            tonic::Code::DeadlineExceeded,
        ] {
            let error = ToolError::from(tonic::Status::new(code, "why"));
            assert_eq!(error.message, "why");
            assert_eq!(tonic::Status::from(error).code(), code);
        }
        let error = ToolError::from(tonic::Status::resource_exhausted("queue full"));
        assert_eq!(
            serde_json::to_value(&error).unwrap(),
            serde_json::json!({"code": "RESOURCE_EXHAUSTED", "message": "queue full"})
        );
        assert_eq!(error.code.as_str(), "RESOURCE_EXHAUSTED");
    }
}
