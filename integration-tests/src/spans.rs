//! One span, as seen by a backend: from OTLP protobuf or from a console JSON line.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub service_name: String,
    pub resource: BTreeMap<String, String>,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: Option<String>,
    pub name: String,
    pub attributes: BTreeMap<String, String>,
    /// Linked span ids.
    pub links: Vec<String>,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

fn any_to_string(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(f)) => f.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

pub(crate) fn kv_map(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), any_to_string(&kv.value)))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Flattens an OTLP export request's spans.
pub fn from_otlp(resource_spans: &[ResourceSpans]) -> Vec<SpanRecord> {
    let mut out = Vec::new();
    for rs in resource_spans {
        let resource = rs
            .resource
            .as_ref()
            .map(|r| kv_map(&r.attributes))
            .unwrap_or_default();
        let service_name = resource.get("service.name").cloned().unwrap_or_default();
        for scope in &rs.scope_spans {
            for span in &scope.spans {
                let parent = (!span.parent_span_id.is_empty()).then(|| hex(&span.parent_span_id));
                out.push(SpanRecord {
                    service_name: service_name.clone(),
                    resource: resource.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: parent,
                    name: span.name.clone(),
                    attributes: kv_map(&span.attributes),
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
                    let s = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), s)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Parses the span lines of a console exporter's output; panics on a line that is not JSON,
/// since the console exporter promises one JSON object per line.
pub fn from_console(stdout: &str) -> Vec<SpanRecord> {
    stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str::<Value>(l)
                .unwrap_or_else(|e| panic!("console output line is not JSON ({e}): {l}"))
        })
        .filter(|v| v["signal"] == "span")
        .map(|v| {
            let resource = json_map(&v["resource"]);
            SpanRecord {
                service_name: resource.get("service.name").cloned().unwrap_or_default(),
                resource,
                trace_id: v["trace_id"].as_str().unwrap_or_default().to_owned(),
                span_id: v["span_id"].as_str().unwrap_or_default().to_owned(),
                parent_span_id: v["parent_span_id"].as_str().map(str::to_owned),
                name: v["name"].as_str().unwrap_or_default().to_owned(),
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
            }
        })
        .collect()
}

pub const ALL_SERVICES: [&str; 4] = [
    "nomad/head",
    "nomad/gateway",
    "nomad/scheduler",
    "nomad/device-worker",
];

/// Checks that each rollout in `results` is exactly one whole trace:
/// - every span carrying the rollout's id is in the trace the head reported, and no two rollouts
///   share a trace;
/// - the trace has one root, `nomad.rollout`, and every other span's parent is in the trace;
/// - the trace has spans from all four services, each with `nomad.service_group = nomad`;
/// - every span in it carries the run's `nomad.run.id`.
pub fn check_rollout_traces(spans: &[SpanRecord], results: &[Value], run_id: &str) {
    assert!(!results.is_empty(), "no rollout results to check");
    let mut by_trace: HashMap<&str, Vec<&SpanRecord>> = HashMap::new();
    for s in spans {
        by_trace.entry(&s.trace_id).or_default().push(s);
    }
    let mut seen_traces = BTreeSet::new();
    for result in results {
        let rollout_id = result["rollout_id"].as_str().expect("rollout_id");
        let trace_id = result["trace_id"].as_str().expect("trace_id");
        assert!(
            !trace_id.is_empty(),
            "rollout {rollout_id} reported no trace id"
        );
        assert!(
            seen_traces.insert(trace_id),
            "two rollouts share trace {trace_id}"
        );
        let tagged: BTreeSet<&str> = spans
            .iter()
            .filter(|s| s.attr("nomad.rollout.id") == Some(rollout_id))
            .map(|s| s.trace_id.as_str())
            .collect();
        assert_eq!(
            tagged,
            BTreeSet::from([trace_id]),
            "spans of rollout {rollout_id} are spread over traces {tagged:?}"
        );
        let trace = by_trace
            .get(trace_id)
            .unwrap_or_else(|| panic!("no spans received for trace {trace_id}"));
        let ids: BTreeSet<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
        let roots: Vec<_> = trace
            .iter()
            .filter(|s| s.parent_span_id.is_none())
            .collect();
        assert_eq!(roots.len(), 1, "trace {trace_id} has {} roots", roots.len());
        assert_eq!(roots[0].name, "nomad.rollout", "trace {trace_id} root");
        assert_eq!(roots[0].service_name, "nomad/head");
        for s in trace {
            if let Some(parent) = &s.parent_span_id {
                assert!(
                    ids.contains(parent.as_str()),
                    "orphan span {} ({}) in trace {trace_id}: parent {parent} not in the trace",
                    s.name,
                    s.service_name
                );
            }
            assert_eq!(
                s.attr("nomad.run.id"),
                Some(run_id),
                "span {} ({}) lacks nomad.run.id={run_id}",
                s.name,
                s.service_name
            );
            assert_eq!(
                s.attr("nomad.rollout.id"),
                Some(rollout_id),
                "span {} ({}) lacks nomad.rollout.id",
                s.name,
                s.service_name
            );
            assert_eq!(
                s.resource.get("nomad.service_group").map(String::as_str),
                Some("nomad"),
                "span {} ({}) lacks nomad.service_group",
                s.name,
                s.service_name
            );
        }
        let services: BTreeSet<&str> = trace.iter().map(|s| s.service_name.as_str()).collect();
        assert_eq!(
            services,
            BTreeSet::from(ALL_SERVICES),
            "trace {trace_id} services"
        );
    }
}

/// Checks batch linking for every request span: its `nomad.tool.execute` share links to a
/// `nomad.tool.batch` span, and that batch span links back to the request.
pub fn check_batch_links(spans: &[SpanRecord]) {
    let by_id: HashMap<&str, &SpanRecord> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let requests: Vec<&SpanRecord> = spans
        .iter()
        .filter(|s| s.name == "nomad.tool.request")
        .collect();
    assert!(!requests.is_empty(), "no nomad.tool.request spans");
    for request in requests {
        let share = spans
            .iter()
            .find(|s| {
                s.name == "nomad.tool.execute"
                    && s.parent_span_id.as_deref() == Some(&request.span_id)
            })
            .unwrap_or_else(|| {
                panic!(
                    "request {} has no nomad.tool.execute child",
                    request.span_id
                )
            });
        let batch = share
            .links
            .iter()
            .filter_map(|id| by_id.get(id.as_str()))
            .find(|s| s.name == "nomad.tool.batch")
            .unwrap_or_else(|| panic!("share {} links to no nomad.tool.batch span", share.span_id));
        assert!(
            batch.links.contains(&request.span_id),
            "batch {} does not link back to request {}",
            batch.span_id,
            request.span_id
        );
        assert_ne!(
            batch.trace_id, request.trace_id,
            "a batch span is its own trace"
        );
    }
}
