//! The `console` exporter: one compact JSON object per line for every span, metric point and
//! log record, so the output pipes straight into `jq`.
//!
//! Each line names its `signal` and carries the process's resource attributes, so lines from
//! several processes can be concatenated and still be told apart.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::logs::AnyValue;
use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{Array, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::logs::{LogBatch, LogExporter};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{Temporality, exporter::PushMetricExporter};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use serde_json::{Map, Value as Json, json};

/// Where console records go. Stdout by default; stderr when stdout carries a protocol (MCP
/// stdio); a file when stdout is someone's terminal (`nomad up` writes the head's to its run
/// directory).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ConsoleSink {
    #[default]
    Stdout,
    Stderr,
    /// Appended to; created if missing.
    File(std::path::PathBuf),
}

#[derive(Debug, Clone)]
enum Target {
    Stdout,
    Stderr,
    File(Arc<Mutex<std::fs::File>>),
}

/// Writes whole lines so records from concurrent exporters never interleave mid-line.
#[derive(Debug, Clone)]
struct LineWriter {
    target: Target,
    lock: Arc<Mutex<()>>,
}

impl LineWriter {
    fn new(sink: &ConsoleSink) -> Self {
        // One lock per process: the span, metric and log exporters share the stream.
        static LOCK: std::sync::OnceLock<Arc<Mutex<()>>> = std::sync::OnceLock::new();
        // One file handle per path, shared the same way.
        static FILES: std::sync::OnceLock<
            Mutex<std::collections::HashMap<std::path::PathBuf, Arc<Mutex<std::fs::File>>>>,
        > = std::sync::OnceLock::new();
        let target = match sink {
            ConsoleSink::Stdout => Target::Stdout,
            ConsoleSink::Stderr => Target::Stderr,
            ConsoleSink::File(path) => {
                let mut files = FILES
                    .get_or_init(Default::default)
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                match files.get(path) {
                    Some(f) => Target::File(f.clone()),
                    None => match std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                    {
                        Ok(f) => {
                            let f = Arc::new(Mutex::new(f));
                            files.insert(path.clone(), f.clone());
                            Target::File(f)
                        }
                        Err(e) => {
                            eprintln!(
                                "console exporter: cannot open {}: {e}; writing to stderr",
                                path.display()
                            );
                            Target::Stderr
                        }
                    },
                }
            }
        };
        Self {
            target,
            lock: LOCK.get_or_init(Default::default).clone(),
        }
    }

    fn write(&self, text: &str) -> OTelSdkResult {
        if text.is_empty() {
            return Ok(());
        }
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = match &self.target {
            Target::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes()).and_then(|_| out.flush())
            }
            Target::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
            Target::File(f) => f
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write_all(text.as_bytes()),
        };
        result.map_err(|e| OTelSdkError::InternalFailure(format!("console exporter: {e}")))
    }
}

fn unix_nanos(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
}

fn value_json(value: &Value) -> Json {
    match value {
        Value::Bool(b) => json!(b),
        Value::I64(i) => json!(i),
        Value::F64(f) => json!(f),
        Value::String(s) => json!(s.as_str()),
        Value::Array(Array::Bool(v)) => json!(v),
        Value::Array(Array::I64(v)) => json!(v),
        Value::Array(Array::F64(v)) => json!(v),
        Value::Array(Array::String(v)) => {
            Json::Array(v.iter().map(|s| json!(s.as_str())).collect())
        }
        other => json!(other.to_string()),
    }
}

fn any_json(value: &AnyValue) -> Json {
    match value {
        AnyValue::Int(i) => json!(i),
        AnyValue::Double(f) => json!(f),
        AnyValue::String(s) => json!(s.as_str()),
        AnyValue::Boolean(b) => json!(b),
        AnyValue::Bytes(b) => json!(b.as_slice()),
        AnyValue::ListAny(v) => Json::Array(v.iter().map(any_json).collect()),
        AnyValue::Map(m) => Json::Object(
            m.iter()
                .map(|(k, v)| (k.as_str().to_owned(), any_json(v)))
                .collect(),
        ),
        other => json!(format!("{other:?}")),
    }
}

fn attributes<'a>(kvs: impl IntoIterator<Item = &'a KeyValue>) -> Json {
    Json::Object(
        kvs.into_iter()
            .map(|kv| (kv.key.as_str().to_owned(), value_json(&kv.value)))
            .collect(),
    )
}

fn resource_json(resource: &Resource) -> Json {
    Json::Object(
        resource
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), value_json(v)))
            .collect::<Map<_, _>>(),
    )
}

fn kind_name(kind: &SpanKind) -> &'static str {
    match kind {
        SpanKind::Client => "client",
        SpanKind::Server => "server",
        SpanKind::Producer => "producer",
        SpanKind::Consumer => "consumer",
        SpanKind::Internal => "internal",
    }
}

/// The JSON line for one finished span.
pub fn span_json(span: &SpanData, resource: &Json) -> Json {
    let (status, message) = match &span.status {
        Status::Unset => ("unset", None),
        Status::Ok => ("ok", None),
        Status::Error { description } => ("error", Some(description.to_string())),
    };
    let parent = (span.parent_span_id != opentelemetry::trace::SpanId::INVALID)
        .then(|| span.parent_span_id.to_string());
    let start = unix_nanos(span.start_time);
    let end = unix_nanos(span.end_time);
    json!({
        "signal": "span",
        "name": span.name,
        "trace_id": span.span_context.trace_id().to_string(),
        "span_id": span.span_context.span_id().to_string(),
        "parent_span_id": parent,
        "kind": kind_name(&span.span_kind),
        "start_time_unix_nano": start,
        "end_time_unix_nano": end,
        "duration_ms": end.saturating_sub(start) as f64 / 1e6,
        "status": status,
        "status_message": message,
        "attributes": attributes(&span.attributes),
        "events": span.events.iter().map(|e| json!({
            "name": e.name,
            "time_unix_nano": unix_nanos(e.timestamp),
            "attributes": attributes(&e.attributes),
        })).collect::<Vec<_>>(),
        "links": span.links.iter().map(|l| json!({
            "trace_id": l.span_context.trace_id().to_string(),
            "span_id": l.span_context.span_id().to_string(),
        })).collect::<Vec<_>>(),
        "resource": resource,
    })
}

#[derive(Debug)]
pub struct ConsoleSpanExporter {
    out: LineWriter,
    resource: Json,
}

impl ConsoleSpanExporter {
    pub fn new(sink: &ConsoleSink) -> Self {
        Self {
            out: LineWriter::new(sink),
            resource: Json::Object(Map::new()),
        }
    }
}

impl SpanExporter for ConsoleSpanExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let mut text = String::new();
        for span in &batch {
            text.push_str(&span_json(span, &self.resource).to_string());
            text.push('\n');
        }
        self.out.write(&text)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = resource_json(resource);
    }
}

#[derive(Debug)]
pub struct ConsoleMetricExporter {
    out: LineWriter,
}

impl ConsoleMetricExporter {
    pub fn new(sink: &ConsoleSink) -> Self {
        Self {
            out: LineWriter::new(sink),
        }
    }
}

/// One JSON object per data point of `data`, with `head` fields (name, unit, resource) in each.
fn metric_points<T: Into<Json> + Copy>(
    data: &MetricData<T>,
    head: &Map<String, Json>,
) -> Vec<Json> {
    let point = |kind: &str, attrs: Json, time: SystemTime, fields: Json| {
        let mut obj = head.clone();
        obj.insert("type".into(), json!(kind));
        obj.insert("time_unix_nano".into(), json!(unix_nanos(time)));
        obj.insert("attributes".into(), attrs);
        if let Json::Object(extra) = fields {
            obj.extend(extra);
        }
        Json::Object(obj)
    };
    match data {
        MetricData::Gauge(g) => g
            .data_points()
            .map(|p| {
                point(
                    "gauge",
                    attributes(p.attributes()),
                    g.time(),
                    json!({"value": p.value().into()}),
                )
            })
            .collect(),
        MetricData::Sum(s) => {
            let kind = if s.is_monotonic() {
                "counter"
            } else {
                "updowncounter"
            };
            s.data_points()
                .map(|p| {
                    point(
                        kind,
                        attributes(p.attributes()),
                        s.time(),
                        json!({"value": p.value().into()}),
                    )
                })
                .collect()
        }
        MetricData::Histogram(h) => h
            .data_points()
            .map(|p| {
                point(
                    "histogram",
                    attributes(p.attributes()),
                    h.time(),
                    json!({
                        "count": p.count(),
                        "sum": p.sum().into(),
                        "min": p.min().map(Into::into),
                        "max": p.max().map(Into::into),
                        "bounds": p.bounds().collect::<Vec<_>>(),
                        "bucket_counts": p.bucket_counts().collect::<Vec<_>>(),
                    }),
                )
            })
            .collect(),
        MetricData::ExponentialHistogram(h) => h
            .data_points()
            .map(|p| {
                point(
                    "exponential_histogram",
                    attributes(p.attributes()),
                    h.time(),
                    json!({"count": p.count(), "sum": p.sum().into()}),
                )
            })
            .collect(),
    }
}

/// The JSON lines (one per data point) for one export of metrics.
pub fn metric_lines(metrics: &ResourceMetrics) -> Vec<Json> {
    let resource = resource_json(metrics.resource());
    let mut lines = Vec::new();
    for scope in metrics.scope_metrics() {
        for metric in scope.metrics() {
            let mut head = Map::new();
            head.insert("signal".into(), json!("metric"));
            head.insert("name".into(), json!(metric.name()));
            head.insert("unit".into(), json!(metric.unit()));
            head.insert("resource".into(), resource.clone());
            lines.extend(match metric.data() {
                AggregatedMetrics::F64(d) => metric_points(d, &head),
                AggregatedMetrics::U64(d) => metric_points(d, &head),
                AggregatedMetrics::I64(d) => metric_points(d, &head),
            });
        }
    }
    lines
}

impl PushMetricExporter for ConsoleMetricExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let mut text = String::new();
        for line in metric_lines(metrics) {
            text.push_str(&line.to_string());
            text.push('\n');
        }
        self.out.write(&text)
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

#[derive(Debug)]
pub struct ConsoleLogExporter {
    out: LineWriter,
    resource: Json,
}

impl ConsoleLogExporter {
    pub fn new(sink: &ConsoleSink) -> Self {
        Self {
            out: LineWriter::new(sink),
            resource: Json::Object(Map::new()),
        }
    }
}

impl LogExporter for ConsoleLogExporter {
    async fn export(&self, batch: LogBatch<'_>) -> OTelSdkResult {
        let mut text = String::new();
        for (record, _scope) in batch.iter() {
            let trace = record.trace_context();
            let line = json!({
                "signal": "log",
                "time_unix_nano": record.timestamp().or(record.observed_timestamp()).map(unix_nanos),
                "severity": record.severity_text(),
                "target": record.target().map(|t| t.to_string()),
                "body": record.body().map(any_json),
                "trace_id": trace.map(|t| t.trace_id.to_string()),
                "span_id": trace.map(|t| t.span_id.to_string()),
                "attributes": Json::Object(record.attributes_iter()
                    .map(|(k, v)| (k.as_str().to_owned(), any_json(v))).collect()),
                "resource": self.resource,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        self.out.write(&text)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = resource_json(resource);
    }
}
