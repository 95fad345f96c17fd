//! The bridge between sandboxed code and the gateway: frames (`nomad_jail::frame`, the one
//! format every sandbox socket uses) over a socketpair the sandbox inherits as descriptor 3. No
//! TCP listener exists for sandboxed code to find.
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

pub use nomad_jail::frame::{Decoder, MAX_FRAME, encode, encode_fields as encode_run};

/// A message from the runner.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    #[serde(default)]
    pub id: Option<u64>,
    pub method: String,
    #[serde(default)]
    pub params: Value,
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
