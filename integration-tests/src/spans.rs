//! Checks over spans as a backend sees them (read by `nomad_telemetry::records`): whole
//! rollout traces, batch links.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

pub use nomad_telemetry::records::{SpanRecord, from_otlp};

/// The spans of console-exporter output; panics on a line that is not JSON, since the console
/// exporter promises one JSON object per line.
pub fn from_console(stdout: &str) -> Vec<SpanRecord> {
    let (spans, bad) = nomad_telemetry::records::from_console(stdout);
    assert!(
        bad.is_empty(),
        "console output lines that are not JSON: {bad:?}"
    );
    spans
}

/// OTLP attributes as a map of texts.
pub(crate) fn kv_map(
    kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue],
) -> BTreeMap<String, String> {
    nomad_telemetry::records::attributes(kvs)
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
