//! What each tool did lately, for `Snapshot` (`nomad top`): the requests answered and batches
//! started in the last [`WINDOW`], bounded per tool, with their rate, latency percentiles and
//! mean batch size.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far back the figures look.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Most events kept per tool and kind: beyond it the oldest go (the rate then reads low).
const MAX_EVENTS: usize = 8192;

#[derive(Default)]
struct ToolEvents {
    /// (answered at, latency in seconds)
    requests: VecDeque<(Instant, f64)>,
    /// (started at, size)
    batches: VecDeque<(Instant, u32)>,
}

fn push<T>(events: &mut VecDeque<(Instant, T)>, at: Instant, value: T) {
    while events.len() >= MAX_EVENTS
        || events
            .front()
            .is_some_and(|(t, _)| at.duration_since(*t) > WINDOW)
    {
        events.pop_front();
    }
    events.push_back((at, value));
}

/// One tool's figures over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Activity {
    pub requests_per_second: f64,
    pub latency_p50_seconds: f64,
    pub latency_p99_seconds: f64,
    pub mean_batch_size: f64,
}

/// Shared by the driver (which records) and the service (which reads).
#[derive(Default)]
pub struct Recent {
    tools: Mutex<HashMap<String, ToolEvents>>,
}

/// The `q` quantile of sorted `values` (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Recent {
    fn with<R>(&self, tool: &str, f: impl FnOnce(&mut ToolEvents) -> R) -> R {
        let mut tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        f(tools.entry(tool.to_owned()).or_default())
    }

    pub fn request(&self, tool: &str, latency: Duration, at: Instant) {
        self.with(tool, |t| push(&mut t.requests, at, latency.as_secs_f64()));
    }

    pub fn batch(&self, tool: &str, size: u32, at: Instant) {
        self.with(tool, |t| push(&mut t.batches, at, size));
    }

    /// `tool`'s figures over the window ending at `now`.
    pub fn activity(&self, tool: &str, now: Instant) -> Activity {
        let tools = self.tools.lock().unwrap_or_else(|e| e.into_inner());
        let Some(t) = tools.get(tool) else {
            return Activity::default();
        };
        let recent = |at: &Instant| now.saturating_duration_since(*at) <= WINDOW;
        let mut latencies: Vec<f64> = t
            .requests
            .iter()
            .filter(|(at, _)| recent(at))
            .map(|(_, l)| *l)
            .collect();
        latencies.sort_by(f64::total_cmp);
        let sizes: Vec<u32> = t
            .batches
            .iter()
            .filter(|(at, _)| recent(at))
            .map(|(_, s)| *s)
            .collect();
        Activity {
            requests_per_second: latencies.len() as f64 / WINDOW.as_secs_f64(),
            latency_p50_seconds: quantile(&latencies, 0.5),
            latency_p99_seconds: quantile(&latencies, 0.99),
            mean_batch_size: if sizes.is_empty() {
                0.0
            } else {
                sizes.iter().map(|&s| f64::from(s)).sum::<f64>() / sizes.len() as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_cover_the_window_only() {
        let recent = Recent::default();
        let t0 = Instant::now();
        // Outside the window by the time we look.
        recent.request("embed", Duration::from_secs(9), t0);
        let now = t0 + WINDOW + Duration::from_secs(1);
        for ms in 1..=100 {
            recent.request(
                "embed",
                Duration::from_millis(ms),
                now - Duration::from_millis(ms),
            );
        }
        recent.batch("embed", 4, now);
        recent.batch("embed", 8, now);
        let a = recent.activity("embed", now);
        assert_eq!(a.requests_per_second, 100.0 / WINDOW.as_secs_f64());
        assert_eq!(a.latency_p50_seconds, 0.05);
        assert_eq!(a.latency_p99_seconds, 0.099);
        assert_eq!(a.mean_batch_size, 6.0);
        assert_eq!(recent.activity("generate", now), Activity::default());
    }

    #[test]
    fn a_tool_keeps_at_most_max_events() {
        let recent = Recent::default();
        let now = Instant::now();
        for _ in 0..MAX_EVENTS + 10 {
            recent.request("embed", Duration::from_millis(1), now);
        }
        let tools = recent.tools.lock().unwrap();
        assert_eq!(tools["embed"].requests.len(), MAX_EVENTS);
    }
}
