//! A sandboxed run's tool calls as its caller gets them back (`gateway.record_tool_calls`), so a
//! rollout can be replayed: server, tool, status, start offset and duration of each, in the
//! order they started; arguments, output and error only with `record_tool_call_payloads`
//! (redacted as `gateway.redaction` says).

use std::sync::Mutex;
use std::time::Instant;

use serde_json::{Value, json};

use crate::tool_error::ToolError;

/// Calls one run records at most (the sandbox's default `max_tool_calls`); later ones are
/// counted in `dropped`.
const MAX_RECORDED: usize = 10_000;
/// Bytes of a server or tool name kept (names come from sandboxed code).
const NAME_BYTES: usize = 256;

pub struct CallLog {
    started: Instant,
    payloads: bool,
    calls: Mutex<Vec<(f64, Value)>>,
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
        let offset = started.duration_since(self.started).as_secs_f64();
        let mut call = json!({
            "server": nomad_tool_search::text::clip(server, NAME_BYTES),
            "tool": nomad_tool_search::text::clip(tool, NAME_BYTES),
            "status": if result.is_ok() { "ok" } else { "error" },
            "start_offset_seconds": offset,
            "duration_seconds": started.elapsed().as_secs_f64(),
        });
        if let Err(error) = result {
            call["code"] = json!(error.code);
        }
        if self.payloads {
            call["arguments"] = redact(arguments);
            match result {
                Ok(output) => call["output"] = redact(output),
                Err(error) => call["error"] = json!(error.message),
            }
        }
        let mut calls = self.calls.lock().expect("call log lock");
        if calls.len() < MAX_RECORDED {
            calls.push((offset, call));
        } else {
            *self.dropped.lock().expect("call log lock") += 1;
        }
    }

    /// The calls by start time, and how many were not kept.
    pub fn finish(self) -> (Vec<Value>, u64) {
        let mut calls = self.calls.into_inner().expect("call log lock");
        // Concurrent calls finish out of order; replay wants them as they started.
        calls.sort_by(|a, b| a.0.total_cmp(&b.0));
        let dropped = self.dropped.into_inner().expect("call log lock");
        (calls.into_iter().map(|(_, c)| c).collect(), dropped)
    }
}

#[cfg(test)]
mod tests {
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
            assert_eq!(calls[0]["status"], "ok");
            assert_eq!(calls[1]["status"], "error");
            assert_eq!(
                calls[1]["code"], "INVALID_ARGUMENT",
                "the code is kept, payloads or not"
            );
            assert_eq!(calls[0].get("arguments").is_some(), payloads);
            assert_eq!(calls[0].get("output").is_some(), payloads);
            assert_eq!(calls[1].get("error").is_some(), payloads);
            assert!(calls[0]["duration_seconds"].as_f64().unwrap() >= 0.0);
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
        assert_eq!(calls[0]["tool"], "first");
    }
}
