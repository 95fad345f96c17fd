//! One upstream call's telemetry, kept out of the call path: the `nomad.gateway.upstream_tool`
//! span, the call counter and duration histogram (names from the metric table), and a log line
//! that carries the arguments' keys and size, never their values (a prompt, a document, a secret
//! under an innocent key), and at most [`LOGGED_BYTES`] of a name or an error.

use std::time::Instant;

use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram};
use serde_json::Value;

use super::record::CallStatus;
use crate::tool_error::ToolError;

/// The upstream call instruments, made once.
pub struct Instruments {
    calls: Counter<u64>,
    duration: Histogram<f64>,
}

impl Instruments {
    pub fn new() -> Self {
        Self {
            calls: defs::GATEWAY_UPSTREAM_TOOL_CALLS.u64_counter(),
            duration: defs::GATEWAY_UPSTREAM_TOOL_DURATION.f64_histogram(),
        }
    }

    /// Starts recording a call of `tool` on `server`, as labelled (names sandboxed code made up
    /// are `unknown` by then), in the caller's context `cx`.
    pub fn start(&self, server: String, tool: String, cx: &Context) -> CallRecorder<'_> {
        let span = GroupSpan::start(SpanGroup::Upstream, "nomad.gateway.upstream_tool", cx);
        span.set_attributes([
            KeyValue::new("nomad.gateway.server", server.clone()),
            KeyValue::new("nomad.gateway.tool", tool.clone()),
        ]);
        CallRecorder {
            instruments: self,
            span,
            started: Instant::now(),
            server,
            tool,
        }
    }
}

pub struct CallRecorder<'a> {
    instruments: &'a Instruments,
    span: GroupSpan,
    started: Instant,
    server: String,
    tool: String,
}

impl CallRecorder<'_> {
    /// The call's context: the upstream server continues the trace from here.
    pub fn context(&self) -> &Context {
        self.span.context()
    }

    /// The call of `tool` on `server` (as the caller named them) with `arguments` ended.
    pub fn finished(
        self,
        server: &str,
        tool: &str,
        arguments: &Value,
        result: &Result<Value, ToolError>,
    ) {
        let status = match result {
            Ok(_) => CallStatus::Ok,
            Err(_) => CallStatus::Error,
        };
        self.span
            .set_attribute(KeyValue::new("nomad.gateway.status", status.as_str()));
        let (server_log, tool_log) = (clip(server), clip(tool));
        let shape = shape_of(arguments);
        match result {
            Ok(_) => tracing::debug!(server = %server_log, tool = %tool_log, arguments = %shape,
                "upstream call"),
            Err(e) => {
                self.span.set_error(e.code.as_str(), &e.message);
                tracing::info!(server = %server_log, tool = %tool_log, arguments = %shape,
                    code = e.code.as_str(), error = %clip(&e.message), "upstream call failed");
            }
        }
        let attributes = [
            KeyValue::new("server", self.server),
            KeyValue::new("tool", self.tool),
            KeyValue::new("status", status.as_str()),
        ];
        self.instruments.calls.add(1, &attributes);
        self.instruments
            .duration
            .record(self.started.elapsed().as_secs_f64(), &attributes);
    }
}

/// What a log line says of a call's arguments: their top-level keys (at most 16, each clipped)
/// and their size in bytes of JSON.
fn shape_of(arguments: &Value) -> String {
    let bytes = crate::json_len::json_len(arguments, u64::MAX);
    match arguments {
        Value::Object(map) => {
            let keys: Vec<String> = map.keys().take(16).map(|k| clip(k).into_owned()).collect();
            let more = if map.len() > 16 { ", ..." } else { "" };
            format!("keys [{}{more}], {bytes} bytes", keys.join(", "))
        }
        _ => format!("{bytes} bytes"),
    }
}

/// Bytes of any one value a log line carries.
const LOGGED_BYTES: usize = 1024;

/// `text` cut to [`LOGGED_BYTES`] at a character boundary, saying how much was left out.
fn clip(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= LOGGED_BYTES {
        return text.into();
    }
    let mut end = LOGGED_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &text[..end], text.len()).into()
}
