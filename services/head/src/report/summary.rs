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
    /// Tokens the tool generated (generation tools only), and per second of the run.
    pub completion_tokens: u64,
    pub tokens_per_second: Option<f64>,
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

pub fn summary(results: &[Value], spans: &[Span]) -> Summary {
    let ok = results.iter().filter(|r| r["status"] == "ok").count();
    let verified = results.iter().filter(|r| r["passed"].is_boolean()).count();
    let passed = results.iter().filter(|r| r["passed"] == true).count();

    let rollouts: Vec<&Span> = spans.iter().filter(|s| s.name == "nomad.rollout").collect();
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
            let completion_tokens: u64 = requests
                .iter()
                .filter_map(|s| {
                    s.attr("nomad.tool.generate.completion_tokens")?
                        .parse::<u64>()
                        .ok()
                })
                .sum();
            ToolSummary {
                tool: tool.to_owned(),
                requests: requests.len(),
                errors: requests.iter().filter(|s| s.status == "error").count(),
                p50_ms: quantile(&ms, 0.5),
                p99_ms: quantile(&ms, 0.99),
                completion_tokens,
                tokens_per_second: (completion_tokens > 0)
                    .then(|| per_second(completion_tokens as f64))
                    .flatten(),
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
        assert_eq!(s.tools[1].tokens_per_second, Some(100.0));
        assert_eq!(s.tools[0].tokens_per_second, None);
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
