//! The figures of a run report, computed from what the run left: its results, its spans and
//! its metric points. Pure: every plot (and the test that checks it) reads these.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::summary::{Summary, summary};
use crate::traces::Span;

/// One bar of a histogram: values in `[lo, hi)` (the last bar includes `hi`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bin {
    pub lo: f64,
    pub hi: f64,
    pub count: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Histogram {
    /// Values counted (the sum of the bins).
    pub count: usize,
    pub bins: Vec<Bin>,
}

/// `(seconds since the run began, value)` points, one series per name (tool, server).
pub type Series = BTreeMap<String, Vec<(f64, f64)>>;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figures {
    /// The table at the top of the report.
    pub summary: Summary,
    pub rollouts: usize,
    pub failed: usize,
    pub rollout_seconds: Histogram,
    pub rewards: Histogram,
    /// Each tool request's latency (ms) at the time it was received, by tool.
    pub request_latency_ms: Series,
    /// Each batch's size at the time it started, by tool.
    pub batch_size: Series,
    /// Requests waiting in each tool's queue, at every change.
    pub queue_length: Series,
    /// Resident memory (MiB) of each server, as the head's memory profiler sampled it.
    pub memory_mib: Series,
    /// Each sandboxed run's wait for a sandbox slot (ms), at the time it began waiting.
    pub sandbox_wait_ms: Series,
    /// What held each device worker over time: its batches, by worker id.
    pub worker_batches: BTreeMap<String, Vec<Held>>,
}

/// One batch on a worker: which tool, from when to when (seconds since the run began).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Held {
    pub tool: String,
    pub start: f64,
    pub end: f64,
}

/// `values` in `bins` equal-width bars from their least to their greatest value.
pub fn histogram(values: &[f64], bins: usize) -> Histogram {
    let values: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        return Histogram {
            count: 0,
            bins: Vec::new(),
        };
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // All equal: one bar around the value.
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        (lo - 0.5, lo + 0.5)
    };
    let width = (hi - lo) / bins as f64;
    let mut out: Vec<Bin> = (0..bins)
        .map(|i| Bin {
            lo: lo + width * i as f64,
            hi: lo + width * (i + 1) as f64,
            count: 0,
        })
        .collect();
    for v in &values {
        let i = (((v - lo) / width) as usize).min(bins - 1);
        out[i].count += 1;
    }
    Histogram {
        count: values.len(),
        bins: out,
    }
}

fn seconds(ns: u128, origin: u128) -> f64 {
    ns.saturating_sub(origin) as f64 / 1e9
}

/// Queue length over time from each request's arrival and queue wait.
fn queue_steps(mut changes: Vec<(u128, i64)>, origin: u128) -> Vec<(f64, f64)> {
    changes.sort();
    let mut length = 0i64;
    let mut points = vec![(0.0, 0.0)];
    for (at, delta) in changes {
        length += delta;
        points.push((seconds(at, origin), length as f64));
    }
    points
}

pub fn figures(results: &[Value], spans: &[Span], metrics: &[Value]) -> Figures {
    let durations: Vec<f64> = results
        .iter()
        .filter_map(|r| r["durations"]["total_seconds"].as_f64())
        .collect();
    let rewards: Vec<f64> = results
        .iter()
        .filter_map(|r| r["reward"].as_f64())
        .collect();
    let failed = results.iter().filter(|r| r["status"] != "ok").count();
    // The run began with its first span (or first metric point).
    let origin = spans
        .iter()
        .map(|s| s.start_ns)
        .chain(
            metrics
                .iter()
                .filter_map(|m| m["time_unix_nano"].as_u64().map(u128::from)),
        )
        .min()
        .unwrap_or(0);

    let mut request_latency_ms = Series::new();
    let mut batch_size = Series::new();
    let mut sandbox_wait_ms = Series::new();
    let mut worker_batches: BTreeMap<String, Vec<Held>> = BTreeMap::new();
    let mut queue_changes: BTreeMap<String, Vec<(u128, i64)>> = BTreeMap::new();
    for s in spans {
        if s.name == "nomad.gateway.sandbox.queue_wait" {
            sandbox_wait_ms
                .entry("runs".to_owned())
                .or_default()
                .push((seconds(s.start_ns, origin), s.duration_ms()));
            continue;
        }
        let Some(tool) = s.attr("tool") else { continue };
        match s.name.as_str() {
            "nomad.tool.request" => {
                request_latency_ms
                    .entry(tool.to_owned())
                    .or_default()
                    .push((seconds(s.start_ns, origin), s.duration_ms()));
                if let Some(wait) = s
                    .attr("nomad.tool.queue_wait_seconds")
                    .and_then(|w| w.parse::<f64>().ok())
                {
                    let left = s.start_ns + (wait.max(0.0) * 1e9) as u128;
                    let changes = queue_changes.entry(tool.to_owned()).or_default();
                    changes.push((s.start_ns, 1));
                    changes.push((left, -1));
                }
            }
            "nomad.tool.batch" => {
                if let Some(size) = s
                    .attr("nomad.tool.batch.size")
                    .and_then(|n| n.parse::<f64>().ok())
                {
                    batch_size
                        .entry(tool.to_owned())
                        .or_default()
                        .push((seconds(s.start_ns, origin), size));
                }
                if let Some(worker) = s.attr("nomad.worker.id") {
                    worker_batches
                        .entry(worker.to_owned())
                        .or_default()
                        .push(Held {
                            tool: tool.to_owned(),
                            start: seconds(s.start_ns, origin),
                            end: seconds(s.end_ns, origin),
                        });
                }
            }
            _ => {}
        }
    }
    for points in request_latency_ms
        .values_mut()
        .chain(batch_size.values_mut())
        .chain(sandbox_wait_ms.values_mut())
    {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    for batches in worker_batches.values_mut() {
        batches.sort_by(|a, b| a.start.total_cmp(&b.start));
    }
    let queue_length = queue_changes
        .into_iter()
        .map(|(tool, changes)| (tool, queue_steps(changes, origin)))
        .collect();

    let mut memory_mib = Series::new();
    for m in metrics {
        if m["name"] != "nomad.server.memory.usage" || m["attributes"]["memory.type"] != "rss" {
            continue;
        }
        let (Some(server), Some(value), Some(time)) = (
            m["attributes"]["server"].as_str(),
            m["value"].as_f64(),
            m["time_unix_nano"].as_u64(),
        ) else {
            continue;
        };
        memory_mib
            .entry(server.to_owned())
            .or_default()
            .push((seconds(time.into(), origin), value / (1 << 20) as f64));
    }
    for points in memory_mib.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points.dedup_by(|a, b| a.0 == b.0);
    }

    Figures {
        summary: summary(results, spans),
        rollouts: results.len(),
        failed,
        rollout_seconds: histogram(&durations, 20),
        rewards: histogram(&rewards, 10),
        request_latency_ms,
        batch_size,
        queue_length,
        memory_mib,
        sandbox_wait_ms,
        worker_batches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn histograms_count_every_value_once_including_the_greatest() {
        let h = histogram(&[0.0, 0.5, 1.0, 1.0, f64::NAN], 4);
        assert_eq!(h.count, 4);
        assert_eq!(h.bins.iter().map(|b| b.count).sum::<usize>(), 4);
        assert_eq!(h.bins[3].count, 2);
        let same = histogram(&[2.0, 2.0], 3);
        assert_eq!(same.bins.iter().map(|b| b.count).sum::<usize>(), 2);
        assert_eq!(histogram(&[], 3).bins, vec![]);
    }

    fn span(name: &str, start_ms: u128, end_ms: u128, attrs: &[(&str, &str)]) -> Span {
        Span {
            service_name: "nomad/scheduler".into(),
            resource: Default::default(),
            trace_id: "t".into(),
            span_id: format!("{name}{start_ms}"),
            parent_span_id: None,
            name: name.into(),
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            status: "ok".into(),
            attributes: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            links: vec![],
        }
    }

    #[test]
    fn queue_length_follows_arrivals_and_their_waits() {
        let spans = [
            span(
                "nomad.tool.request",
                0,
                100,
                &[("tool", "embed"), ("nomad.tool.queue_wait_seconds", "0.05")],
            ),
            span(
                "nomad.tool.request",
                10,
                90,
                &[("tool", "embed"), ("nomad.tool.queue_wait_seconds", "0.02")],
            ),
            span(
                "nomad.tool.batch",
                60,
                80,
                &[("tool", "embed"), ("nomad.tool.batch.size", "2")],
            ),
        ];
        let results = [
            json!({"status": "ok", "reward": 1.0, "durations": {"total_seconds": 0.1}}),
            json!({"status": "error", "durations": {"total_seconds": 0.3}}),
        ];
        let memory = [
            json!({"name": "nomad.server.memory.usage", "time_unix_nano": 50_000_000u64,
            "value": 2.0 * 1048576.0, "attributes": {"server": "gateway", "memory.type": "rss"}}),
        ];
        let f = figures(&results, &spans, &memory);
        let lengths: Vec<f64> = f.queue_length["embed"].iter().map(|p| p.1).collect();
        assert_eq!(lengths, [0.0, 1.0, 2.0, 1.0, 0.0]);
        assert_eq!(f.request_latency_ms["embed"], [(0.0, 100.0), (0.01, 80.0)]);
        assert_eq!(f.batch_size["embed"], [(0.06, 2.0)]);
        assert_eq!(f.memory_mib["gateway"], [(0.05, 2.0)]);
        assert_eq!(
            (
                f.rollouts,
                f.failed,
                f.rewards.count,
                f.rollout_seconds.count
            ),
            (2, 1, 1, 2)
        );
    }

    #[test]
    fn workers_show_which_tool_held_them_and_runs_their_wait_for_a_slot() {
        let spans = [
            span("nomad.gateway.sandbox.queue_wait", 0, 40, &[]),
            span(
                "nomad.tool.batch",
                100,
                300,
                &[
                    ("tool", "generate"),
                    ("nomad.tool.batch.size", "1"),
                    ("nomad.worker.id", "w0"),
                ],
            ),
            span(
                "nomad.tool.batch",
                50,
                60,
                &[
                    ("tool", "embed"),
                    ("nomad.tool.batch.size", "4"),
                    ("nomad.worker.id", "w0"),
                ],
            ),
            span(
                "nomad.tool.batch",
                70,
                90,
                &[
                    ("tool", "embed"),
                    ("nomad.tool.batch.size", "2"),
                    ("nomad.worker.id", "w1"),
                ],
            ),
            span("nomad.gateway.sandbox.queue_wait", 20, 21, &[]),
        ];
        let f = figures(&[], &spans, &[]);
        assert_eq!(f.sandbox_wait_ms["runs"], [(0.0, 40.0), (0.02, 1.0)]);
        let held = |tool: &str, start: f64, end: f64| Held {
            tool: tool.into(),
            start,
            end,
        };
        assert_eq!(
            f.worker_batches["w0"],
            [held("embed", 0.05, 0.06), held("generate", 0.1, 0.3)]
        );
        assert_eq!(f.worker_batches["w1"], [held("embed", 0.07, 0.09)]);
    }
}
