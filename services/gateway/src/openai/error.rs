//! Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with the HTTP
//! status a client expects: 400 for bad input (naming the field), 404 for an unknown model, 429
//! when a tool's queue is full, 503 when no worker can serve, 500 otherwise.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::tool_error::{ToolError, ToolErrorCode};

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: param.map(str::to_owned),
            message: message.into(),
        }
    }

    pub fn model_not_found(model: &str, fitting: &[&str]) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("model_not_found"),
            param: Some("model".into()),
            message: format!(
                "the model {model:?} does not exist here; models for this endpoint: {}",
                if fitting.is_empty() {
                    "none".into()
                } else {
                    fitting.join(", ")
                }
            ),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    /// A failed tool call as the HTTP error a client acts on.
    pub fn from_tool_error(error: ToolError) -> Self {
        use ToolErrorCode as Code;
        let message = error.message;
        let (http, kind, code) = match error.code {
            Code::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            Code::NotFound => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            Code::ResourceExhausted => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("queue_full"),
            ),
            Code::Unavailable | Code::FailedPrecondition => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("unavailable"),
            ),
            Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error", None),
            Code::DeadlineExceeded => {
                (StatusCode::GATEWAY_TIMEOUT, "server_error", Some("timeout"))
            }
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        Self {
            status: http,
            kind,
            code,
            param: None,
            message,
        }
    }

    /// This error, for input `index` of a request of several.
    pub fn at_input(mut self, index: usize) -> Self {
        if self.status == StatusCode::BAD_REQUEST {
            self.param = Some(format!("input[{index}]"));
        }
        self.message = format!("input {index}: {}", self.message);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
