//! OTLP export requests as the console exporter's JSON lines: what `nomad collect` writes, so a
//! collector's files read exactly like a run directory's (`nomad traces --from`, `jq`).

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::logs::v1::ResourceLogs;
use opentelemetry_proto::tonic::metrics::v1::{ResourceMetrics, metric, number_data_point};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;
use serde_json::{Map, Value as Json, json};

use crate::span_line::{self, SpanLine};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn value_json(value: &Option<AnyValue>) -> Json {
    use any_value::Value;
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => json!(s),
        Some(Value::BoolValue(b)) => json!(b),
        Some(Value::IntValue(i)) => json!(i),
        Some(Value::DoubleValue(f)) => json!(f),
        Some(Value::BytesValue(b)) => json!(b),
        Some(Value::ArrayValue(a)) => Json::Array(
            a.values
                .iter()
                .map(|v| value_json(&Some(v.clone())))
                .collect(),
        ),
        Some(Value::KvlistValue(kv)) => attributes(&kv.values),
        Some(Value::StringValueStrindex(i)) => json!(i),
        None => Json::Null,
    }
}

fn attributes(kvs: &[KeyValue]) -> Json {
    Json::Object(
        kvs.iter()
            .map(|kv| (kv.key.clone(), value_json(&kv.value)))
            .collect(),
    )
}

/// The most of a resource repeated on each line: a process's own resource is far smaller, and
/// a larger one (a peer's, or a forged one) would be written again on every line of a request.
pub const MAX_RESOURCE_BYTES: usize = 1024;

/// What a resource larger than that keeps: the keys the readers use.
const KEPT_RESOURCE_KEYS: &[&str] = &[
    "service.name",
    "service.instance.id",
    "host.name",
    "nomad.run.id",
];

fn resource_json(resource: &Option<Resource>) -> Json {
    let all = resource
        .as_ref()
        .map(|r| attributes(&r.attributes))
        .unwrap_or_else(|| Json::Object(Map::new()));
    let size = all.to_string().len();
    if size <= MAX_RESOURCE_BYTES {
        return all;
    }
    let mut kept: Map<String, Json> = KEPT_RESOURCE_KEYS
        .iter()
        .filter_map(|k| all.get(*k).map(|v| ((*k).to_owned(), clip(v))))
        .collect();
    kept.insert("nomad.resource.omitted_bytes".into(), json!(size));
    Json::Object(kept)
}

/// A kept resource value, cut to a bounded string.
fn clip(value: &Json) -> Json {
    match value.as_str() {
        Some(s) if s.len() > 128 => {
            let mut end = 128;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            json!(&s[..end])
        }
        Some(_) => value.clone(),
        None => json!(value.to_string().chars().take(128).collect::<String>()),
    }
}

fn kind_name(kind: i32) -> &'static str {
    match kind {
        2 => "server",
        3 => "client",
        4 => "producer",
        5 => "consumer",
        _ => "internal",
    }
}

/// One line per span, in the console exporter's span format.
pub fn span_lines(resource_spans: &[ResourceSpans]) -> Vec<Json> {
    let mut lines = Vec::new();
    for rs in resource_spans {
        let resource = resource_json(&rs.resource);
        for span in rs.scope_spans.iter().flat_map(|s| &s.spans) {
            let status = match &span.status {
                Some(s) if s.code == 1 => ("ok", None),
                Some(s) if s.code == 2 => ("error", Some(s.message.clone())),
                _ => ("unset", None),
            };
            let line = SpanLine {
                name: &span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: (!span.parent_span_id.is_empty())
                    .then(|| hex(&span.parent_span_id)),
                kind: kind_name(span.kind),
                start: span.start_time_unix_nano,
                end: span.end_time_unix_nano,
                status,
                attributes: attributes(&span.attributes),
                events: (span.events.iter())
                    .map(|e| span_line::event(&e.name, e.time_unix_nano, attributes(&e.attributes)))
                    .collect(),
                links: (span.links.iter())
                    .map(|l| span_line::link(hex(&l.trace_id), hex(&l.span_id)))
                    .collect(),
            };
            lines.push(line.json(&resource));
        }
    }
    lines
}

fn number(value: &Option<number_data_point::Value>) -> Json {
    match value {
        Some(number_data_point::Value::AsDouble(f)) => json!(f),
        Some(number_data_point::Value::AsInt(i)) => json!(i),
        None => Json::Null,
    }
}

/// One line per data point, in the console exporter's metric format.
pub fn metric_lines(resource_metrics: &[ResourceMetrics]) -> Vec<Json> {
    let mut lines = Vec::new();
    for rm in resource_metrics {
        let resource = resource_json(&rm.resource);
        for m in rm.scope_metrics.iter().flat_map(|s| &s.metrics) {
            let point = |kind: &str, attrs: &[KeyValue], time: u64, fields: Json| {
                let mut obj = Map::new();
                obj.insert("signal".into(), json!("metric"));
                obj.insert("name".into(), json!(m.name));
                obj.insert("unit".into(), json!(m.unit));
                obj.insert("resource".into(), resource.clone());
                obj.insert("type".into(), json!(kind));
                obj.insert("time_unix_nano".into(), json!(time));
                obj.insert("attributes".into(), attributes(attrs));
                if let Json::Object(extra) = fields {
                    obj.extend(extra);
                }
                Json::Object(obj)
            };
            match &m.data {
                Some(metric::Data::Gauge(g)) => lines.extend(g.data_points.iter().map(|p| {
                    point(
                        "gauge",
                        &p.attributes,
                        p.time_unix_nano,
                        json!({"value": number(&p.value)}),
                    )
                })),
                Some(metric::Data::Sum(s)) => {
                    let kind = if s.is_monotonic {
                        "counter"
                    } else {
                        "updowncounter"
                    };
                    lines.extend(s.data_points.iter().map(|p| {
                        point(
                            kind,
                            &p.attributes,
                            p.time_unix_nano,
                            json!({"value": number(&p.value)}),
                        )
                    }))
                }
                Some(metric::Data::Histogram(h)) => lines.extend(h.data_points.iter().map(|p| {
                    point(
                        "histogram",
                        &p.attributes,
                        p.time_unix_nano,
                        json!({
                            "count": p.count,
                            "sum": p.sum,
                            "min": p.min,
                            "max": p.max,
                            "bounds": p.explicit_bounds,
                            "bucket_counts": p.bucket_counts,
                        }),
                    )
                })),
                Some(metric::Data::ExponentialHistogram(h)) => {
                    lines.extend(h.data_points.iter().map(|p| {
                        point(
                            "exponential_histogram",
                            &p.attributes,
                            p.time_unix_nano,
                            json!({"count": p.count, "sum": p.sum}),
                        )
                    }))
                }
                Some(metric::Data::Summary(s)) => lines.extend(s.data_points.iter().map(|p| {
                    point(
                        "summary",
                        &p.attributes,
                        p.time_unix_nano,
                        json!({"count": p.count, "sum": p.sum}),
                    )
                })),
                None => {}
            }
        }
    }
    lines
}

/// One line per log record, in the console exporter's log format.
pub fn log_lines(resource_logs: &[ResourceLogs]) -> Vec<Json> {
    let mut lines = Vec::new();
    for rl in resource_logs {
        let resource = resource_json(&rl.resource);
        for scope in &rl.scope_logs {
            let target = scope.scope.as_ref().map(|s| s.name.clone());
            for record in &scope.log_records {
                let time = match record.time_unix_nano {
                    0 => record.observed_time_unix_nano,
                    t => t,
                };
                lines.push(json!({
                    "signal": "log",
                    "time_unix_nano": time,
                    "severity": (!record.severity_text.is_empty()).then_some(&record.severity_text),
                    "target": target,
                    "body": value_json(&record.body),
                    "trace_id": (!record.trace_id.is_empty()).then(|| hex(&record.trace_id)),
                    "span_id": (!record.span_id.is_empty()).then(|| hex(&record.span_id)),
                    "attributes": attributes(&record.attributes),
                    "resource": resource,
                }));
            }
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::trace::v1::{ScopeSpans, Span, Status};

    fn kv(key: &str, value: &str) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.into())),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_span_reads_back_as_the_console_exporter_wrote_it() {
        let request = [ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv("service.name", "nomad/gateway")],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: vec![0xab; 16],
                    span_id: vec![1; 8],
                    parent_span_id: vec![2; 8],
                    name: "nomad.rollout".into(),
                    kind: 2,
                    start_time_unix_nano: 1_000,
                    end_time_unix_nano: 3_001_000,
                    attributes: vec![kv("nomad.run.id", "42")],
                    status: Some(Status {
                        code: 2,
                        message: "boom".into(),
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }];
        let lines = span_lines(&request);
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0]["kind"], "server");
        assert_eq!(lines[0]["status_message"], "boom");
        let span = crate::records::from_console_record(&lines[0]).unwrap();
        assert_eq!(span.service_name, "nomad/gateway");
        assert_eq!(span.trace_id, "ab".repeat(16));
        assert_eq!(span.parent_span_id.as_deref(), Some("0202020202020202"));
        assert_eq!(span.run_id(), Some("42"));
        assert_eq!(span.status, "error");
        assert_eq!(span.duration_ms(), 3.0);
    }

    /// A resource too large to repeat on every line keeps the keys readers use, cut short,
    /// and says how much was left out; a small one is written whole.
    #[test]
    fn a_large_resource_is_not_repeated_on_every_line() {
        let span = |n: u8| Span {
            trace_id: vec![n; 16],
            span_id: vec![n; 8],
            name: "s".into(),
            ..Default::default()
        };
        let request = |attributes| ResourceSpans {
            resource: Some(Resource {
                attributes,
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans: (0..100).map(span).collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let small = span_lines(&[request(vec![kv("service.name", "nomad/head")])]);
        assert_eq!(small[0]["resource"], json!({"service.name": "nomad/head"}));
        let padding = "x".repeat(100_000);
        let large = span_lines(&[request(vec![
            kv("service.name", "nomad/head"),
            kv("nomad.run.id", &"r".repeat(1000)),
            kv("padding", &padding),
        ])]);
        assert_eq!(large.len(), 100);
        for line in &large {
            let resource = &line["resource"];
            assert_eq!(resource["service.name"], "nomad/head");
            assert_eq!(resource["nomad.run.id"].as_str().unwrap().len(), 128);
            assert!(resource.get("padding").is_none());
            assert!(resource["nomad.resource.omitted_bytes"].as_u64().unwrap() > 100_000);
            assert!(resource.to_string().len() <= MAX_RESOURCE_BYTES);
        }
    }
}
