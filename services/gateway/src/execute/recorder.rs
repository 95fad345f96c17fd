//! The telemetry of one gateway request, kept out of the handlers: the request's span (and its
//! sandbox run's), the request counter and the duration histograms, each request finished once
//! with a [`RunStatus`]. Names and units are the metric table's (`nomad_telemetry::metrics`).

use std::time::Instant;

use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram};

use super::ExecuteReply;
use crate::sandbox::{Outcome, Rejected};

/// What a gateway request asked for (`request.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RequestKind {
    ExecuteMcpCode,
    ExecuteMcpScript,
    CallTool,
}

impl RequestKind {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    fn attribute(self) -> KeyValue {
        KeyValue::new("request.kind", self.as_str())
    }
}

/// How a request ended (`status` on metrics, `nomad.gateway.status` on spans, and the reply's
/// `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RunStatus {
    /// The code ran to its end (or the tool answered).
    Ok,
    /// It raised, was killed, or its result was refused (or the tool failed).
    Error,
    /// It ran past its time.
    Timeout,
    /// It never ran: no room in the sandbox, or no process could start.
    Rejected,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    fn attribute(self) -> KeyValue {
        KeyValue::new("status", self.as_str())
    }
}

/// The gateway's request instruments, made once.
pub struct Instruments {
    requests: Counter<u64>,
    request_duration: Histogram<f64>,
    sandbox_duration: Histogram<f64>,
}

impl Instruments {
    pub fn new() -> Self {
        Self {
            requests: defs::GATEWAY_REQUESTS.u64_counter(),
            request_duration: defs::GATEWAY_REQUEST_DURATION.f64_histogram(),
            sandbox_duration: defs::GATEWAY_SANDBOX_DURATION.f64_histogram(),
        }
    }

    /// A request turned away before anything ran (a script outside the workspace root): counted,
    /// with a duration of zero.
    pub fn refused(&self, kind: RequestKind) {
        self.requests.add(1, &[kind.attribute()]);
        self.request_duration
            .record(0.0, &[kind.attribute(), RunStatus::Error.attribute()]);
    }

    /// Starts recording a sandboxed run: `nomad.gateway.<kind>` and its child
    /// `nomad.gateway.sandbox.run`, whose context the run and its tool calls carry.
    pub fn start_run(
        &self,
        kind: RequestKind,
        code_size: usize,
        timeout_seconds: f64,
        cx: &Context,
    ) -> RunRecorder<'_> {
        self.requests.add(1, &[kind.attribute()]);
        let span = GroupSpan::start(
            SpanGroup::Gateway,
            format!("nomad.gateway.{}", kind.as_str()),
            cx,
        );
        span.set_attributes([
            KeyValue::new("nomad.gateway.request_id", uuid::Uuid::new_v4().to_string()),
            KeyValue::new("nomad.gateway.code_size", code_size as i64),
            KeyValue::new("nomad.gateway.timeout_seconds", timeout_seconds),
        ]);
        let run_span = GroupSpan::start(
            SpanGroup::Sandbox,
            "nomad.gateway.sandbox.run",
            span.context(),
        );
        run_span.set_attribute(KeyValue::new(
            "nomad.gateway.timeout_seconds",
            timeout_seconds,
        ));
        RunRecorder {
            instruments: self,
            kind,
            started: Instant::now(),
            span,
            run_span,
        }
    }

    /// Starts recording one tool call made for a gRPC caller (its span is the upstream call's).
    pub fn start_call(&self) -> CallRecorder<'_> {
        self.requests.add(1, &[RequestKind::CallTool.attribute()]);
        CallRecorder {
            instruments: self,
            started: Instant::now(),
        }
    }
}

/// One sandboxed run's telemetry, from admission to its reply; finished by [`Self::rejected`]
/// or [`Self::finished`].
pub struct RunRecorder<'a> {
    instruments: &'a Instruments,
    kind: RequestKind,
    started: Instant,
    span: GroupSpan,
    run_span: GroupSpan,
}

impl RunRecorder<'_> {
    /// The run's context: its process and its tool calls are children of the run span.
    pub fn run_context(&self) -> &Context {
        self.run_span.context()
    }

    /// The sandbox turned the run away.
    pub fn rejected(self, rejected: &Rejected) {
        let status = RunStatus::Rejected;
        for s in [&self.run_span, &self.span] {
            s.set_attribute(KeyValue::new("nomad.gateway.status", status.as_str()));
            s.set_error(status.as_str(), rejected.to_string());
        }
        self.instruments.request_duration.record(
            self.started.elapsed().as_secs_f64(),
            &[self.kind.attribute(), status.attribute()],
        );
    }

    /// The run ended with `outcome`, answered by `reply`.
    pub fn finished(self, outcome: &Outcome, reply: &ExecuteReply) {
        let returncode = i64::from(reply.returncode);
        for s in [&self.run_span, &self.span] {
            s.set_attributes([
                KeyValue::new("nomad.gateway.returncode", returncode),
                KeyValue::new(
                    "nomad.gateway.tool_call_count",
                    i64::from(outcome.tool_calls),
                ),
                KeyValue::new("nomad.gateway.status", reply.status.as_str()),
                KeyValue::new(
                    "nomad.gateway.sandbox.start",
                    if outcome.warm { "warm" } else { "cold" },
                ),
                KeyValue::new(
                    "nomad.gateway.sandbox.queue_wait_seconds",
                    outcome.queue_wait.as_secs_f64(),
                ),
            ]);
            match &outcome.failure {
                Some(f) => s.set_error(f.kind(), first_line(&reply.error)),
                None => s.set_ok(),
            }
        }
        let attributes = [
            self.kind.attribute(),
            reply.status.attribute(),
            KeyValue::new("returncode", returncode),
        ];
        // The run span ends before the request's, as the run ends before its reply is sent.
        drop(self.run_span);
        self.instruments
            .sandbox_duration
            .record(outcome.duration.as_secs_f64(), &attributes);
        self.instruments
            .request_duration
            .record(self.started.elapsed().as_secs_f64(), &attributes);
    }
}

/// One `call_tool` request's duration and status.
pub struct CallRecorder<'a> {
    instruments: &'a Instruments,
    started: Instant,
}

impl CallRecorder<'_> {
    pub fn finished(self, ok: bool) {
        let status = if ok { RunStatus::Ok } else { RunStatus::Error };
        self.instruments.request_duration.record(
            self.started.elapsed().as_secs_f64(),
            &[RequestKind::CallTool.attribute(), status.attribute()],
        );
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or_default()
}
