//! The run at a glance, the table at the top of a report: rollouts, how many passed
//! verification, throughput, each tool's requests with their p50/p99 latency and generated
//! tokens per second, and the rollouts that failed or did not pass, with why. Pure, from the
//! results and spans the report already reads.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::traces::Span;

/// Rollouts listed by name among those that failed or did not pass (the rest are counted).
pub const MAX_LISTED: usize = 20;
/// Characters of an error or an output shown for one of them.
const WHY_CHARS: usize = 300;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub rollouts: usize,
    /// Rollouts whose agent step (and verification) ran without an error.
    pub ok: usize,
    /// Rollouts whose output was verified, and how many of those passed.
    pub verified: usize,
    pub passed: usize,
    /// From the first rollout's start to the last one's end (their spans); 0 without spans.
    pub wall_seconds: f64,
    /// Finished rollouts per second of `wall_seconds` (absent without spans).
    pub rollouts_per_second: Option<f64>,
    pub tools: Vec<ToolSummary>,
    /// The rollouts that failed or did not pass (at most [`MAX_LISTED`]), in the results' order.
    pub not_passed: Vec<NotPassed>,
    /// How many more did, beyond those listed.
    pub not_passed_unlisted: usize,
}

/// One tool's requests, from the scheduler's `nomad.tool.request` spans.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSummary {
    pub tool: String,
    pub requests: usize,
    pub errors: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Tokens the tool generated (generation tools only).
    pub completion_tokens: u64,
    /// Its tokens per second of the time it had a request running (its requests' intervals
    /// joined): what the tool gave all its callers together while busy.
    pub tokens_per_second: Option<f64>,
    /// The median of each request's own tokens per second, its queue wait left out: what one
    /// caller sees.
    pub tokens_per_second_per_call: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotPassed {
    pub task_id: String,
    /// `error` (the rollout failed) or `failed` (verified, and did not pass).
    pub outcome: &'static str,
    pub reward: Option<f64>,
    /// The error's first line, or the output that did not pass (both clipped).
    pub why: String,
}

/// Whether a rollout's root span is one of the results' (all are when there are no results):
/// the report counts what `results.jsonl` holds, and a rollout of an interrupted run that
/// left spans and no result line is in neither its counts nor its waterfalls.
pub fn in_results(results: &[Value]) -> impl Fn(&Span) -> bool {
    let ids: std::collections::HashSet<String> = results
        .iter()
        .filter_map(|r| r["rollout_id"].as_str().map(str::to_owned))
        .collect();
    move |root: &Span| {
        ids.is_empty()
            || root
                .attr("nomad.rollout.id")
                .is_some_and(|id| ids.contains(id))
    }
}

pub fn summary(results: &[Value], spans: &[Span]) -> Summary {
    let ok = results.iter().filter(|r| r["status"] == "ok").count();
    let verified = results.iter().filter(|r| r["passed"].is_boolean()).count();
    let passed = results.iter().filter(|r| r["passed"] == true).count();

    let counted = in_results(results);
    let rollouts: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "nomad.rollout" && counted(s))
        .collect();
    let wall_seconds = match (
        rollouts.iter().map(|s| s.start_ns).min(),
        rollouts.iter().map(|s| s.end_ns).max(),
    ) {
        (Some(start), Some(end)) => end.saturating_sub(start) as f64 / 1e9,
        _ => 0.0,
    };
    let per_second = |n: f64| (wall_seconds > 0.0).then(|| n / wall_seconds);

    let mut by_tool: BTreeMap<&str, Vec<&Span>> = BTreeMap::new();
    for s in spans.iter().filter(|s| s.name == "nomad.tool.request") {
        if let Some(tool) = s.attr("tool") {
            by_tool.entry(tool).or_default().push(s);
        }
    }
    let tools = by_tool
        .into_iter()
        .map(|(tool, requests)| {
            let mut ms: Vec<f64> = requests.iter().map(|s| s.duration_ms()).collect();
            ms.sort_by(f64::total_cmp);
            let tokens = |s: &Span| {
                s.attr("nomad.tool.generate.completion_tokens")?
                    .parse::<u64>()
                    .ok()
            };
            let completion_tokens: u64 = requests.iter().filter_map(|s| tokens(s)).sum();
            let mut per_call: Vec<f64> = requests
                .iter()
                .filter_map(|s| {
                    let wait = s
                        .attr("nomad.tool.queue_wait_seconds")
                        .and_then(|w| w.parse::<f64>().ok())
                        .unwrap_or(0.0);
                    let seconds = s.duration_ms() / 1e3 - wait.max(0.0);
                    (seconds > 0.0).then(|| tokens(s).map(|t| t as f64 / seconds))?
                })
                .collect();
            per_call.sort_by(f64::total_cmp);
            let busy = busy_seconds(requests.iter().map(|s| (s.start_ns, s.end_ns)));
            ToolSummary {
                tool: tool.to_owned(),
                requests: requests.len(),
                errors: requests.iter().filter(|s| s.status == "error").count(),
                p50_ms: quantile(&ms, 0.5),
                p99_ms: quantile(&ms, 0.99),
                completion_tokens,
                tokens_per_second: (completion_tokens > 0 && busy > 0.0)
                    .then(|| completion_tokens as f64 / busy),
                tokens_per_second_per_call: (completion_tokens > 0 && !per_call.is_empty())
                    .then(|| quantile(&per_call, 0.5)),
            }
        })
        .collect();

    let mut not_passed: Vec<NotPassed> = results
        .iter()
        .filter_map(|r| {
            let (outcome, why) = if r["status"] != "ok" {
                let error = r["error"].as_str().unwrap_or_default();
                ("error", error.lines().next().unwrap_or_default().to_owned())
            } else if r["passed"] == false {
                // The expected answer first: a long output is what gets clipped.
                let expected = match &r["expected"] {
                    Value::Null => String::new(),
                    expected => format!("expected: {expected}; "),
                };
                ("failed", format!("{expected}output: {}", r["output"]))
            } else {
                return None;
            };
            Some(NotPassed {
                task_id: r["task_id"].as_str().unwrap_or_default().to_owned(),
                outcome,
                reward: r["reward"].as_f64(),
                why: clip(&why),
            })
        })
        .collect();
    let not_passed_unlisted = not_passed.len().saturating_sub(MAX_LISTED);
    not_passed.truncate(MAX_LISTED);

    Summary {
        rollouts: results.len(),
        ok,
        verified,
        passed,
        wall_seconds,
        rollouts_per_second: per_second(results.len() as f64),
        tools,
        not_passed,
        not_passed_unlisted,
    }
}

/// Seconds covered by at least one of the `(start, end)` intervals (nanoseconds).
fn busy_seconds(intervals: impl Iterator<Item = (u128, u128)>) -> f64 {
    let mut intervals: Vec<(u128, u128)> = intervals.collect();
    intervals.sort_unstable();
    let (mut total, mut reach) = (0u128, 0u128);
    for (start, end) in intervals {
        let start = start.max(reach);
        if end > start {
            total += end - start;
            reach = end;
        }
    }
    total as f64 / 1e9
}

/// The value at `q` of sorted `values` (nearest rank); 0 when there are none.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn clip(text: &str) -> String {
    match text.char_indices().nth(WHY_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn span(
        name: &str,
        start_ms: u128,
        end_ms: u128,
        status: &str,
        attrs: &[(&str, &str)],
    ) -> Span {
        Span {
            service_name: "test".into(),
            resource: Default::default(),
            trace_id: String::new(),
            span_id: String::new(),
            parent_span_id: None,
            name: name.into(),
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            status: status.into(),
            attributes: attrs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            links: Vec::new(),
        }
    }

    #[test]
    fn counts_rates_latencies_and_the_rollouts_that_did_not_pass() {
        let results = [
            json!({"task_id": "a", "status": "ok", "passed": true, "reward": 1.0, "output": 4}),
            json!({"task_id": "b", "status": "ok", "passed": false, "reward": 0.0, "output": 5,
                   "expected": 4}),
            json!({"task_id": "c", "status": "error", "passed": null,
                   "error": "ToolError: no worker\nTraceback ..."}),
            json!({"task_id": "d", "status": "ok", "passed": null, "output": "unverified"}),
        ];
        let mut spans = vec![
            span("nomad.rollout", 1_000, 2_000, "ok", &[]),
            span("nomad.rollout", 1_500, 5_000, "error", &[]),
        ];
        // generate: 100 requests of 1..=100 ms, 4 tokens each; embed: 2, one failed.
        for i in 1..=100 {
            spans.push(span(
                "nomad.tool.request",
                1_000,
                1_000 + i,
                "ok",
                &[
                    ("tool", "generate"),
                    ("nomad.tool.generate.completion_tokens", "4"),
                ],
            ));
        }
        spans.push(span(
            "nomad.tool.request",
            1_000,
            1_010,
            "ok",
            &[("tool", "embed")],
        ));
        spans.push(span(
            "nomad.tool.request",
            1_000,
            1_030,
            "error",
            &[("tool", "embed")],
        ));
        spans.push(span(
            "nomad.tool.batch",
            1_000,
            1_030,
            "ok",
            &[("tool", "embed")],
        ));

        let s = summary(&results, &spans);
        assert_eq!((s.rollouts, s.ok, s.verified, s.passed), (4, 3, 2, 1));
        assert_eq!(s.wall_seconds, 4.0);
        assert_eq!(s.rollouts_per_second, Some(1.0));
        let tools: Vec<_> = s
            .tools
            .iter()
            .map(|t| (t.tool.as_str(), t.requests, t.errors, t.p50_ms, t.p99_ms))
            .collect();
        assert_eq!(
            tools,
            [
                ("embed", 2, 1, 10.0, 30.0),
                ("generate", 100, 0, 50.0, 99.0)
            ]
        );
        assert_eq!(s.tools[1].completion_tokens, 400);
        // 400 tokens while the tool was busy, 1,000 to 1,100 ms: 4,000 a second together; one
        // call's own rate is 4 tokens over its i ms, the median at i = 51.
        assert_eq!(s.tools[1].tokens_per_second, Some(4000.0));
        assert_eq!(s.tools[1].tokens_per_second_per_call, Some(4000.0 / 51.0));
        assert_eq!(s.tools[0].tokens_per_second, None);
        assert_eq!(s.tools[0].tokens_per_second_per_call, None);
        let listed: Vec<_> = s
            .not_passed
            .iter()
            .map(|n| (n.task_id.as_str(), n.outcome, n.why.as_str()))
            .collect();
        assert_eq!(
            listed,
            [
                ("b", "failed", "expected: 4; output: 5"),
                ("c", "error", "ToolError: no worker")
            ]
        );
        assert_eq!(s.not_passed_unlisted, 0);
    }

    #[test]
    fn busy_time_joins_overlapping_requests_and_queue_wait_is_not_a_calls_time() {
        let ms = |a: u128, b: u128| (a * 1_000_000, b * 1_000_000);
        let busy = busy_seconds([ms(0, 100), ms(50, 150), ms(300, 400), ms(320, 330)].into_iter());
        assert!((busy - 0.25).abs() < 1e-12, "{busy}");
        let spans = [span(
            "nomad.tool.request",
            0,
            2_000,
            "ok",
            &[
                ("tool", "generate"),
                ("nomad.tool.generate.completion_tokens", "10"),
                ("nomad.tool.queue_wait_seconds", "1.0"),
            ],
        )];
        let s = summary(&[], &spans);
        assert_eq!(s.tools[0].tokens_per_second_per_call, Some(10.0));
        assert_eq!(s.tools[0].tokens_per_second, Some(5.0));
    }

    #[test]
    fn rollouts_without_a_result_line_are_not_counted_when_there_are_results() {
        let results = [json!({"task_id": "a", "rollout_id": "r1", "status": "ok"})];
        let spans = [
            span(
                "nomad.rollout",
                0,
                1_000,
                "ok",
                &[("nomad.rollout.id", "r1")],
            ),
            // An interrupted run's rollout: spans, no result line.
            span(
                "nomad.rollout",
                0,
                9_000,
                "ok",
                &[("nomad.rollout.id", "r0")],
            ),
        ];
        let s = summary(&results, &spans);
        assert_eq!(s.wall_seconds, 1.0);
        assert!(in_results(&[])(&spans[1]));
    }

    #[test]
    fn without_spans_there_is_no_rate_and_long_lists_are_cut() {
        let results: Vec<Value> = (0..MAX_LISTED + 3)
            .map(
                |i| json!({"task_id": i.to_string(), "status": "error", "error": "x".repeat(1000)}),
            )
            .collect();
        let s = summary(&results, &[]);
        assert_eq!(s.wall_seconds, 0.0);
        assert_eq!(s.rollouts_per_second, None);
        assert_eq!(s.not_passed.len(), MAX_LISTED);
        assert_eq!(s.not_passed_unlisted, 3);
        assert_eq!(s.not_passed[0].why.chars().count(), WHY_CHARS + 1);
    }
}
