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

use crate::span_line::{self, SpanLine};

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
    File(Arc<Mutex<RotatingFile>>),
}

/// How many rotated copies a console file keeps (`x.1.jsonl` newest .. `x.3.jsonl` oldest).
const ROTATED_COPIES: u64 = 3;

/// A console file rotated by size, so a fleet left running holds a bounded amount of telemetry:
/// once writing would take `x.jsonl` past its share of the budget, it becomes `x.1.jsonl` (each
/// older copy moves up one, the oldest is removed) and a new `x.jsonl` begins. The file and its
/// copies together stay within the budget (a single record larger than a share is still written
/// whole). Every reader of a run directory reads every `*.jsonl`, copies included.
#[derive(Debug)]
pub struct RotatingFile {
    path: std::path::PathBuf,
    file: std::fs::File,
    len: u64,
    /// Bytes per file before it rotates (0: never).
    share: u64,
}

impl RotatingFile {
    /// Opens `path` for appending; `max_bytes` bounds it and its copies together (0: never
    /// rotate).
    pub fn open(path: &std::path::Path, max_bytes: u64) -> std::io::Result<Self> {
        let file = Self::append(path)?;
        Ok(Self {
            path: path.to_owned(),
            len: file.metadata()?.len(),
            file,
            share: max_bytes / (ROTATED_COPIES + 1),
        })
    }

    fn append(path: &std::path::Path) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    }

    /// The path of rotated copy `n` (1 is the newest): `gateway.jsonl` -> `gateway.1.jsonl`.
    pub fn copy_path(path: &std::path::Path, n: u64) -> std::path::PathBuf {
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let name = match path.extension() {
            Some(ext) => format!("{stem}.{n}.{}", ext.to_string_lossy()),
            None => format!("{stem}.{n}"),
        };
        path.with_file_name(name)
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.share > 0 && self.len > 0 && self.len + bytes.len() as u64 > self.share {
            self.rotate()?;
        }
        self.file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let ignore_missing = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        ignore_missing(std::fs::remove_file(Self::copy_path(
            &self.path,
            ROTATED_COPIES,
        )))?;
        for n in (1..ROTATED_COPIES).rev() {
            ignore_missing(std::fs::rename(
                Self::copy_path(&self.path, n),
                Self::copy_path(&self.path, n + 1),
            ))?;
        }
        std::fs::rename(&self.path, Self::copy_path(&self.path, 1))?;
        self.file = Self::append(&self.path)?;
        self.len = 0;
        Ok(())
    }
}

/// Writes whole lines so records from concurrent exporters never interleave mid-line.
#[derive(Debug, Clone)]
struct LineWriter {
    target: Target,
    lock: Arc<Mutex<()>>,
}

impl LineWriter {
    fn new(sink: &ConsoleSink, max_bytes: u64) -> Self {
        // One lock per process: the span, metric and log exporters share the stream.
        static LOCK: std::sync::OnceLock<Arc<Mutex<()>>> = std::sync::OnceLock::new();
        // One file per path, shared the same way.
        static FILES: std::sync::OnceLock<
            Mutex<std::collections::HashMap<std::path::PathBuf, Arc<Mutex<RotatingFile>>>>,
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
                    None => match RotatingFile::open(path, max_bytes) {
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

/// Nanoseconds since the Unix epoch (0 before it; u64 holds them until the year 2554).
fn unix_nanos(t: SystemTime) -> u64 {
    let nanos = t
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos();
    u64::try_from(nanos).unwrap_or(u64::MAX)
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
    let status = match &span.status {
        Status::Unset => ("unset", None),
        Status::Ok => ("ok", None),
        Status::Error { description } => ("error", Some(description.to_string())),
    };
    let context = &span.span_context;
    SpanLine {
        name: &span.name,
        trace_id: context.trace_id().to_string(),
        span_id: context.span_id().to_string(),
        parent_span_id: (span.parent_span_id != opentelemetry::trace::SpanId::INVALID)
            .then(|| span.parent_span_id.to_string()),
        kind: kind_name(&span.span_kind),
        start: unix_nanos(span.start_time),
        end: unix_nanos(span.end_time),
        status,
        attributes: attributes(&span.attributes),
        events: (span.events.iter())
            .map(|e| span_line::event(&e.name, unix_nanos(e.timestamp), attributes(&e.attributes)))
            .collect(),
        links: (span.links.iter())
            .map(|l| {
                let context = &l.span_context;
                span_line::link(
                    context.trace_id().to_string(),
                    context.span_id().to_string(),
                )
            })
            .collect(),
    }
    .json(resource)
}

#[derive(Debug)]
pub struct ConsoleSpanExporter {
    out: LineWriter,
    resource: Json,
}

impl ConsoleSpanExporter {
    pub fn new(sink: &ConsoleSink, max_bytes: u64) -> Self {
        Self {
            out: LineWriter::new(sink, max_bytes),
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
    unchanged: Mutex<Unchanged>,
}

impl ConsoleMetricExporter {
    pub fn new(sink: &ConsoleSink, max_bytes: u64) -> Self {
        Self {
            out: LineWriter::new(sink, max_bytes),
            unchanged: Mutex::new(Unchanged::default()),
        }
    }
}

/// How long a point that has not changed goes unwritten: an idle fleet's counters and settings
/// repeat themselves at every export, and most of what it wrote was those repeats.
pub const UNCHANGED_REWRITE: Duration = Duration::from_secs(60);

/// What each series last wrote, so a point equal to it is skipped until [`UNCHANGED_REWRITE`]
/// has passed. A reader's latest line of a series is still its current value. Bounded by the
/// series the SDK keeps (its cardinality limit per instrument).
#[derive(Debug, Default)]
pub struct Unchanged {
    last: std::collections::HashMap<String, (String, SystemTime)>,
}

impl Unchanged {
    /// Whether `line` (one metric point) should be written at `now`.
    pub fn keep(&mut self, line: &Json, now: SystemTime) -> bool {
        let Json::Object(point) = line else {
            return true;
        };
        let series = format!("{}{}", point["name"], point["attributes"]);
        let mut values = point.clone();
        for field in ["time_unix_nano", "resource", "name", "attributes"] {
            values.remove(field);
        }
        let values = Json::Object(values).to_string();
        match self.last.get(&series) {
            Some((seen, at))
                if *seen == values
                    && now.duration_since(*at).unwrap_or_default() < UNCHANGED_REWRITE =>
            {
                false
            }
            _ => {
                self.last.insert(series, (values, now));
                true
            }
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
        let now = SystemTime::now();
        let mut unchanged = self.unchanged.lock().unwrap_or_else(|e| e.into_inner());
        for line in metric_lines(metrics) {
            if !unchanged.keep(&line, now) {
                continue;
            }
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
    pub fn new(sink: &ConsoleSink, max_bytes: u64) -> Self {
        Self {
            out: LineWriter::new(sink, max_bytes),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "nomad-console-{name}-{}-{}",
            std::process::id(),
            unix_nanos(SystemTime::now())
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_console_file_rotates_within_its_budget_keeping_the_newest_lines() {
        let dir = scratch("rotate");
        let path = dir.join("gateway.jsonl");
        // 400 bytes in all: 100 per file, the file and three copies.
        let mut file = RotatingFile::open(&path, 400).unwrap();
        let line = |i: usize| format!("{{\"n\":{i:04}}}{}\n", " ".repeat(39));
        assert_eq!(line(0).len(), 50);
        for i in 0..20 {
            file.write_all(line(i).as_bytes()).unwrap();
        }
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "gateway.1.jsonl",
                "gateway.2.jsonl",
                "gateway.3.jsonl",
                "gateway.jsonl"
            ]
        );
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        let total: usize = names.iter().map(|n| read(n).len()).sum();
        assert!(total <= 400, "{total} bytes on disk");
        // The newest two lines in the file, the two before in copy 1, the oldest dropped.
        assert_eq!(read("gateway.jsonl"), line(18) + &line(19));
        assert_eq!(read("gateway.1.jsonl"), line(16) + &line(17));
        assert_eq!(read("gateway.3.jsonl"), line(12) + &line(13));
        // Reopened, it goes on from the file's size, not from zero.
        drop(file);
        let mut file = RotatingFile::open(&path, 400).unwrap();
        file.write_all(line(20).as_bytes()).unwrap();
        assert_eq!(read("gateway.jsonl"), line(20));
        assert_eq!(read("gateway.1.jsonl"), line(18) + &line(19));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_budget_of_zero_never_rotates() {
        let dir = scratch("never");
        let path = dir.join("head.jsonl");
        let mut file = RotatingFile::open(&path, 0).unwrap();
        for _ in 0..100 {
            file.write_all(b"{\"x\":1}\n").unwrap();
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 800);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unchanged_metric_point_is_written_again_only_after_a_minute() {
        let point = |value: u64, time: u64| {
            json!({"signal": "metric", "name": "nomad.tool.queue.length", "unit": "",
                   "resource": {"service.name": "s"}, "type": "gauge",
                   "time_unix_nano": time, "attributes": {"tool": "embed"}, "value": value})
        };
        let mut unchanged = Unchanged::default();
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(unchanged.keep(&point(0, 1), at(0)), "the first point");
        assert!(!unchanged.keep(&point(0, 2), at(2)), "the same value");
        assert!(unchanged.keep(&point(3, 3), at(4)), "a new value");
        assert!(unchanged.keep(&point(0, 4), at(6)), "back to the old value");
        assert!(
            !unchanged.keep(&point(0, 5), at(65)),
            "59 s after its last line"
        );
        assert!(
            unchanged.keep(&point(0, 6), at(66)),
            "a minute after its last line"
        );
        let mut other = point(0, 7);
        other["attributes"]["tool"] = json!("generate");
        assert!(unchanged.keep(&other, at(67)), "another series");
    }
}
