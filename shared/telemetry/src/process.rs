//! Process and async-runtime metrics every service exports. Their cost stays off the request
//! path: the metric reader reads /proc and Tokio's counters when it exports; a request touches
//! one atomic (in-flight count, in the server layer).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;

use crate::metrics as defs;

/// Keeps the instruments and the lag sampler alive.
pub(crate) struct ProcessMetrics {
    _observers: Vec<Box<dyn std::any::Any + Send + Sync>>,
    lag_sampler: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for ProcessMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessMetrics").finish_non_exhaustive()
    }
}

impl Drop for ProcessMetrics {
    fn drop(&mut self) {
        if let Some(task) = self.lag_sampler.take() {
            task.abort();
        }
    }
}

/// `(user, system)` CPU seconds from /proc/self/stat.
fn cpu_seconds() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which may itself contain spaces and parentheses.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let field = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((field(11)? / ticks, field(12)? / ticks))
}

/// The page size the kernel counts `/proc/<pid>/statm` in.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// Resident set size of process `pid` (`None`: this process) from `/proc/<pid>/statm`; `None`
/// when it cannot be read (the process is gone, or this is not Linux).
pub fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/statm"),
        None => "/proc/self/statm".to_owned(),
    };
    let statm = std::fs::read_to_string(path).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

fn threads() -> Option<i64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))?
        .trim()
        .parse()
        .ok()
}

fn open_fds() -> Option<i64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as i64)
}

pub(crate) fn start(runtime_interval: Duration, task_count: bool) -> ProcessMetrics {
    let mut observers: Vec<Box<dyn std::any::Any + Send + Sync>> = vec![
        Box::new(defs::PROCESS_CPU_TIME.f64_observable_counter(|o| {
            if let Some((user, system)) = cpu_seconds() {
                o.observe(user, &[KeyValue::new("cpu.mode", "user")]);
                o.observe(system, &[KeyValue::new("cpu.mode", "system")]);
            }
        })),
        Box::new(
            defs::PROCESS_MEMORY_USAGE.i64_observable_up_down_counter(|o| {
                if let Some(v) = rss_bytes(None).and_then(|v| i64::try_from(v).ok()) {
                    o.observe(v, &[]);
                }
            }),
        ),
        Box::new(
            defs::PROCESS_THREAD_COUNT.i64_observable_up_down_counter(|o| {
                if let Some(v) = threads() {
                    o.observe(v, &[]);
                }
            }),
        ),
        Box::new(defs::PROCESS_FD_COUNT.i64_observable_up_down_counter(|o| {
            if let Some(v) = open_fds() {
                o.observe(v, &[]);
            }
        })),
        Box::new(
            defs::SERVER_REQUESTS_IN_FLIGHT.i64_observable_up_down_counter(|o| {
                o.observe(crate::grpc::requests_in_flight(), &[]);
            }),
        ),
    ];
    let mut lag_sampler = None;
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        let metrics = handle.metrics();
        let last = Mutex::new((Instant::now(), busy_total(&metrics)));
        let m = metrics.clone();
        observers.push(Box::new(defs::RUNTIME_BUSY_RATIO.f64_observable_gauge(
            move |o| {
                let now = Instant::now();
                let busy = busy_total(&m);
                let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
                let wall = now.duration_since(last.0).as_secs_f64() * m.num_workers() as f64;
                if wall > 0.0 {
                    o.observe(((busy - last.1).as_secs_f64() / wall).clamp(0.0, 1.0), &[]);
                }
                *last = (now, busy);
            },
        )));
        let m = metrics.clone();
        observers.push(Box::new(
            defs::RUNTIME_GLOBAL_QUEUE_DEPTH.i64_observable_up_down_counter(move |o| {
                o.observe(m.global_queue_depth() as i64, &[])
            }),
        ));
        if task_count {
            let m = metrics;
            observers.push(Box::new(
                defs::RUNTIME_TASKS_ALIVE.i64_observable_up_down_counter(move |o| {
                    o.observe(m.num_alive_tasks() as i64, &[])
                }),
            ));
        }
        // How late a fixed-interval sleep wakes: the scheduling delay every task sees.
        let lag = defs::RUNTIME_LAG.f64_histogram();
        lag_sampler = Some(handle.spawn(async move {
            loop {
                let asked = Instant::now();
                tokio::time::sleep(runtime_interval).await;
                let late = asked.elapsed().saturating_sub(runtime_interval);
                lag.record(late.as_secs_f64(), &[]);
            }
        }));
    }
    ProcessMetrics {
        _observers: observers,
        lag_sampler,
    }
}

fn busy_total(metrics: &tokio::runtime::RuntimeMetrics) -> Duration {
    (0..metrics.num_workers())
        .map(|i| metrics.worker_total_busy_duration(i))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_readers_give_plausible_figures_for_this_process() {
        let (user, system) = cpu_seconds().unwrap();
        assert!(user >= 0.0 && system >= 0.0);
        assert!(rss_bytes(None).unwrap() > 1 << 20);
        assert_eq!(rss_bytes(Some(u32::MAX)), None);
        assert!(threads().unwrap() >= 1);
        assert!(open_fds().unwrap() >= 3);
    }
}
