//! The console format's line for one span: the one place its fields are named, written by the
//! console exporter (from the SDK's spans) and by `nomad collect` (from OTLP's).

use serde_json::{Value as Json, json};

/// One finished span, its ids as lowercase hex and its times in Unix nanoseconds.
pub(crate) struct SpanLine<'a> {
    pub name: &'a str,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: Option<String>,
    pub kind: &'static str,
    pub start: u64,
    pub end: u64,
    /// `unset`, `ok` or `error`, and an error's description.
    pub status: (&'static str, Option<String>),
    pub attributes: Json,
    /// Each made by [`event`].
    pub events: Vec<Json>,
    /// Each made by [`link`].
    pub links: Vec<Json>,
}

/// One of a span's events.
pub(crate) fn event(name: &str, time_unix_nano: u64, attributes: Json) -> Json {
    json!({"name": name, "time_unix_nano": time_unix_nano, "attributes": attributes})
}

/// One of a span's links.
pub(crate) fn link(trace_id: String, span_id: String) -> Json {
    json!({"trace_id": trace_id, "span_id": span_id})
}

impl SpanLine<'_> {
    pub fn json(self, resource: &Json) -> Json {
        json!({
            "signal": "span",
            "name": self.name,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "kind": self.kind,
            "start_time_unix_nano": self.start,
            "end_time_unix_nano": self.end,
            "duration_ms": self.end.saturating_sub(self.start) as f64 / 1e6,
            "status": self.status.0,
            "status_message": self.status.1,
            "attributes": self.attributes,
            "events": self.events,
            "links": self.links,
            "resource": resource,
        })
    }
}
