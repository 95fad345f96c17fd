//! A sandboxed run's tool calls as its caller gets them back (`gateway.record_tool_calls`), so a
//! rollout can be replayed: server, tool, status, start offset and duration of each, in the
//! order they started; arguments, output and error only with `record_tool_call_payloads`
//! (redacted as `gateway.redaction` says).

use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use crate::tool_error::{ToolError, ToolErrorCode};

/// Calls one run records at most (the sandbox's default `max_tool_calls`); later ones are
/// counted in `dropped`.
const MAX_RECORDED: usize = 10_000;
/// Bytes of a server or tool name kept (names come from sandboxed code).
const NAME_BYTES: usize = 256;

/// One recorded call, as MCP callers get it in JSON and gRPC callers as a `ToolCallRecord`.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    pub server: String,
    pub tool: String,
    pub status: CallStatus,
    /// Seconds from the start of the run to the call.
    pub start_offset_seconds: f64,
    pub duration_seconds: f64,
    /// Why it failed, when it did (kept with or without payloads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<ToolErrorCode>,
    /// Payloads: with `record_tool_call_payloads` only, redacted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::IntoStaticStr)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum CallStatus {
    Ok,
    Error,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What a run's reply says of its tool calls (`gateway.record_tool_calls` and
/// `gateway.record_tool_call_payloads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    Off,
    Calls,
    CallsWithPayloads,
}

impl Recording {
    pub fn new(record_tool_calls: bool, payloads: bool) -> Self {
        match (record_tool_calls, payloads) {
            (false, _) => Recording::Off,
            (true, false) => Recording::Calls,
            (true, true) => Recording::CallsWithPayloads,
        }
    }

    /// A log for one run's calls, unless they are not recorded.
    pub fn log(self) -> Option<CallLog> {
        match self {
            Recording::Off => None,
            Recording::Calls => Some(CallLog::new(false)),
            Recording::CallsWithPayloads => Some(CallLog::new(true)),
        }
    }
}

pub struct CallLog {
    started: Instant,
    payloads: bool,
    calls: Mutex<Vec<ToolCall>>,
    dropped: Mutex<u64>,
}

impl CallLog {
    pub fn new(payloads: bool) -> Self {
        Self {
            started: Instant::now(),
            payloads,
            calls: Mutex::new(Vec::new()),
            dropped: Mutex::new(0),
        }
    }

    pub fn record(
        &self,
        server: &str,
        tool: &str,
        started: Instant,
        arguments: &Value,
        result: &Result<Value, ToolError>,
        redact: impl Fn(&Value) -> Value,
    ) {
        let payloads = self.payloads;
        let call = ToolCall {
            server: nomad_tool_search::text::clip(server, NAME_BYTES).into(),
            tool: nomad_tool_search::text::clip(tool, NAME_BYTES).into(),
            status: match result {
                Ok(_) => CallStatus::Ok,
                Err(_) => CallStatus::Error,
            },
            start_offset_seconds: started.duration_since(self.started).as_secs_f64(),
            duration_seconds: started.elapsed().as_secs_f64(),
            code: result.as_ref().err().map(|e| e.code),
            arguments: payloads.then(|| redact(arguments)),
            output: match result {
                Ok(output) if payloads => Some(redact(output)),
                _ => None,
            },
            error: match result {
                Err(error) if payloads => Some(error.message.clone()),
                _ => None,
            },
        };
        let mut calls = self.calls.lock().expect("call log lock");
        if calls.len() < MAX_RECORDED {
            calls.push(call);
        } else {
            *self.dropped.lock().expect("call log lock") += 1;
        }
    }

    /// The calls by start time, and how many were not kept.
    pub fn finish(self) -> (Vec<ToolCall>, u64) {
        let mut calls = self.calls.into_inner().expect("call log lock");
        // Concurrent calls finish out of order; replay wants them as they started.
        calls.sort_by(|a, b| a.start_offset_seconds.total_cmp(&b.start_offset_seconds));
        let dropped = self.dropped.into_inner().expect("call log lock");
        (calls, dropped)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn payloads_are_kept_only_when_asked() {
        for payloads in [false, true] {
            let log = CallLog::new(payloads);
            let t = Instant::now();
            log.record(
                "git",
                "git_log",
                t,
                &json!({"repo_path": "/r"}),
                &Ok(json!("log")),
                Value::clone,
            );
            log.record(
                "git",
                "git_show",
                t,
                &json!({}),
                &Err(ToolError::invalid_argument("no such revision")),
                Value::clone,
            );
            let (calls, dropped) = log.finish();
            assert_eq!(dropped, 0);
            // As MCP callers get them.
            let calls: Vec<Value> = calls.iter().map(|c| json!(c)).collect();
            assert_eq!(calls[0]["status"], "ok");
            assert_eq!(calls[1]["status"], "error");
            assert_eq!(
                calls[1]["code"], "INVALID_ARGUMENT",
                "the code is kept, payloads or not"
            );
            assert_eq!(calls[0].get("arguments").is_some(), payloads);
            assert_eq!(calls[0].get("output").is_some(), payloads);
            assert_eq!(calls[1].get("error").is_some(), payloads);
        }
    }

    #[test]
    fn calls_come_back_in_start_order_and_beyond_the_bound_are_counted() {
        let log = CallLog::new(false);
        let early = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let late = Instant::now();
        log.record("s", "second", late, &json!({}), &Ok(json!(1)), Value::clone);
        log.record("s", "first", early, &json!({}), &Ok(json!(1)), Value::clone);
        for _ in 0..MAX_RECORDED {
            log.record("s", "more", late, &json!({}), &Ok(json!(1)), Value::clone);
        }
        let (calls, dropped) = log.finish();
        assert_eq!(calls.len(), MAX_RECORDED);
        assert_eq!(dropped, 2);
        assert_eq!(calls[0].tool, "first");
    }
}
