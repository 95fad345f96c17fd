//! Spans read back as a backend sees them: from OTLP protobuf (a collector, Jaeger's query API)
//! or from the console exporter's JSON lines. One reader for `nomad traces` and the tests.

use std::collections::BTreeMap;

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    /// The resource's `service.name`.
    pub service_name: String,
    pub resource: BTreeMap<String, String>,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: Option<String>,
    pub name: String,
    pub start_ns: u128,
    pub end_ns: u128,
    /// `ok`, `error` or `unset`.
    pub status: String,
    pub attributes: BTreeMap<String, String>,
    /// Linked span ids.
    pub links: Vec<String>,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    pub fn duration_ms(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 / 1e6
    }

    /// `nomad.run.id` from the span, else from its resource.
    pub fn run_id(&self) -> Option<&str> {
        self.attr("nomad.run.id")
            .or_else(|| self.resource.get("nomad.run.id").map(String::as_str))
    }
}

/// An OTLP value as text (strings as they are, numbers and booleans printed).
pub fn any_text(value: &Option<AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(f)) => f.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// OTLP attributes as a map of texts.
pub fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), any_text(&kv.value)))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Flattens OTLP `ResourceSpans`.
pub fn from_otlp(resource_spans: &[ResourceSpans]) -> Vec<SpanRecord> {
    let mut out = Vec::new();
    for rs in resource_spans {
        let resource = rs
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service_name = resource.get("service.name").cloned().unwrap_or_default();
        for scope in &rs.scope_spans {
            for span in &scope.spans {
                let status = match span.status.as_ref().map(|st| st.code) {
                    Some(1) => "ok",
                    Some(2) => "error",
                    _ => "unset",
                };
                out.push(SpanRecord {
                    service_name: service_name.clone(),
                    resource: resource.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: (!span.parent_span_id.is_empty())
                        .then(|| hex(&span.parent_span_id)),
                    name: span.name.clone(),
                    start_ns: span.start_time_unix_nano.into(),
                    end_ns: span.end_time_unix_nano.into(),
                    status: status.to_owned(),
                    attributes: attributes(&span.attributes),
                    links: span.links.iter().map(|l| hex(&l.span_id)).collect(),
                });
            }
        }
    }
    out
}

fn json_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| {
                    let text = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), text)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The span of one console-exporter record (`None` for a metric or log record).
pub fn from_console_record(v: &Value) -> Option<SpanRecord> {
    if v["signal"] != "span" {
        return None;
    }
    let resource = json_map(&v["resource"]);
    Some(SpanRecord {
        service_name: resource.get("service.name").cloned().unwrap_or_default(),
        resource,
        trace_id: v["trace_id"].as_str().unwrap_or_default().to_owned(),
        span_id: v["span_id"].as_str().unwrap_or_default().to_owned(),
        parent_span_id: v["parent_span_id"].as_str().map(str::to_owned),
        name: v["name"].as_str().unwrap_or_default().to_owned(),
        start_ns: v["start_time_unix_nano"]
            .as_u64()
            .unwrap_or_default()
            .into(),
        end_ns: v["end_time_unix_nano"].as_u64().unwrap_or_default().into(),
        status: v["status"].as_str().unwrap_or("unset").to_owned(),
        attributes: json_map(&v["attributes"]),
        links: v["links"]
            .as_array()
            .map(|links| {
                links
                    .iter()
                    .filter_map(|l| l["span_id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// The spans of console-exporter output, and the lines that were not JSON (a process killed
/// mid-write leaves one; the exporter itself writes only whole objects).
pub fn from_console(text: &str) -> (Vec<SpanRecord>, Vec<String>) {
    let mut spans = Vec::new();
    let mut bad = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<Value>(line) {
            Ok(v) => spans.extend(from_console_record(&v)),
            Err(_) => bad.push(line.to_owned()),
        }
    }
    (spans, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines_become_spans_and_bad_lines_are_reported() {
        let text = concat!(
            r#"{"signal":"span","name":"nomad.rollout","trace_id":"ab","span_id":"01","status":"ok","#,
            r#""start_time_unix_nano":10,"end_time_unix_nano":2000010,"attributes":{"nomad.run.id":"r1","n":3},"#,
            r#""resource":{"service.name":"nomad/head"},"links":[{"span_id":"09"}]}"#,
            "\n",
            r#"{"signal":"metric","name":"m"}"#,
            "\nnot json\n"
        );
        let (spans, bad) = from_console(text);
        assert_eq!(bad, ["not json"]);
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(
            (s.service_name.as_str(), s.name.as_str()),
            ("nomad/head", "nomad.rollout")
        );
        assert_eq!(s.run_id(), Some("r1"));
        assert_eq!(s.attr("n"), Some("3"));
        assert_eq!(s.duration_ms(), 2.0);
        assert_eq!(s.links, ["09"]);
        assert_eq!(s.parent_span_id, None);
    }
}
