//! The summary a run prints when it ends: its rollouts by outcome, and which ones to look at.

use std::path::Path;

use crate::rollouts;

/// Results by kind of verification: count, passed, mean reward.
pub(crate) fn summarize(results: &[rollouts::RolloutResult], out: &Path) {
    let failed = results.iter().filter(|r| r.status == "error").count();
    let cancelled = results.iter().filter(|r| r.status == "cancelled").count();
    let passed = results.iter().filter(|r| r.passed == Some(true)).count();
    let rewards: Vec<f64> = results.iter().filter_map(|r| r.reward).collect();
    let mean = if rewards.is_empty() {
        0.0
    } else {
        rewards.iter().sum::<f64>() / rewards.len() as f64
    };
    let cancelled_note = if cancelled > 0 {
        format!(", {cancelled} cancelled")
    } else {
        String::new()
    };
    println!(
        "{} rollouts: {} ok, {failed} failed{cancelled_note}; {passed} of {} verified passed; \
         mean reward {mean:.3}",
        results.len(),
        results.len() - failed - cancelled,
        rewards.len()
    );
    // Which ones, so a reader goes straight to them in the results and traces.
    let named = |label: &str, ids: Vec<&str>| {
        if !ids.is_empty() {
            const SHOWN: usize = 10;
            let more = ids.len().saturating_sub(SHOWN);
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            println!(
                "  {label}: {}{more}",
                ids[..ids.len().min(SHOWN)].join(", ")
            );
        }
    };
    for (label, which) in [
        (
            "failed",
            (|r| r.status == "error") as fn(&rollouts::RolloutResult) -> bool,
        ),
        ("cancelled", |r| r.status == "cancelled"),
        ("verified, not passed", |r| r.passed == Some(false)),
    ] {
        named(
            label,
            results
                .iter()
                .filter(|r| which(r))
                .map(|r| r.task_id.as_str())
                .collect(),
        );
    }
    println!("Results: {}", out.display());
}
