//! The bridge between sandboxed code and the gateway: frames (`nomad_frame`'s format, with the
//! bridge's limit declared in `nomad_jail::frame`) over a socketpair the sandbox inherits as
//! descriptor 3. No TCP listener exists for sandboxed code to find.
//!
//! In order: the sandbox reports what isolation holds (JSON, [`super::init::Report`], with a
//! pidfd of the run's first process attached);
//! the gateway sends the run ([`encode_run`]: length-prefixed text fields, so the runner decodes
//! it without importing `json`); the runner says `ready` (once its imports are done) and then
//! sends requests, each with an `id` that its JSON response repeats: `list_servers`,
//! `list_tools {server}`, `call_tool {server, tool, arguments}`, `why_missing {server, tool}`
//! (the error a name the server's module lacks raises). Its last message is
//! `done {result | error}`.

use crate::tool_error::ToolError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use nomad_jail::frame::FrameError;
pub use nomad_jail::frame::{Decoder, MAX_FRAME, decoder, encode, encode_fields as encode_run};

/// Why a run's frame was refused, as its failure says it (the run ends unread past it).
pub fn refused(error: &FrameError) -> String {
    match error {
        FrameError::TooLarge { .. } => {
            format!("bridge {error} (a tool call may send at most sandbox.max_call_bytes)")
        }
        FrameError::NotJson(_) => format!("bridge {error}"),
    }
}

/// A message from the runner: a request, with the `id` its answer repeats, or a notice.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    #[serde(default)]
    pub id: Option<u64>,
    pub method: Method,
    /// Read as the method's own parameters ([`ToolParams`], [`CallParams`]) where it is served.
    #[serde(default)]
    pub params: Value,
}

/// What the runner asks or says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Its imports are done (not answered).
    Ready,
    /// The run's end, `{result | error}` (not answered).
    Done,
    ListServers,
    /// `{server}`
    ListTools,
    /// `{server, tool, arguments}`
    CallTool,
    /// `{server, tool}`: the error a name the server's module lacks raises.
    WhyMissing,
    /// A name the runner never sends, answered as an error to its `id`.
    #[serde(other)]
    Unknown,
}

/// `list_tools`' and `why_missing`'s parameters.
#[derive(Debug, Deserialize)]
pub struct ToolParams {
    pub server: String,
    #[serde(default)]
    pub tool: String,
}

/// `call_tool`'s parameters.
#[derive(Debug, Deserialize)]
pub struct CallParams {
    pub server: String,
    pub tool: String,
    #[serde(default = "no_arguments")]
    pub arguments: Value,
}

fn no_arguments() -> Value {
    Value::Object(Default::default())
}

/// The gateway's answer to a request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Response {
    pub id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why the request failed: a code (what to do next) and a message (what was wrong), raised
    /// in the run as `ToolError` with `.code` and the message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolError>,
}

impl Response {
    pub fn ok(id: u64, result: Value) -> Self {
        Self {
            id,
            result: Some(result),
            error: None,
        }
    }

    pub fn error(id: u64, error: ToolError) -> Self {
        Self {
            id,
            result: None,
            error: Some(error),
        }
    }
}
