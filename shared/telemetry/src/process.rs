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

/// One process tree's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TreeMemory {
    pub processes: u64,
    pub rss: u64,
    /// The tree's PSS, when every process of it had one.
    pub pss: Option<u64>,
    /// Each process's PSS, or its RSS where it had none (a process caught mid-exec): what the
    /// tree holds, as closely as each process lets it be counted.
    pub held: u64,
}

/// A `Name:   N kB` field of a /proc text file, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// `Rss` and `Pss` (bytes) from the text of `/proc/<pid>/smaps_rollup`.
pub fn parse_smaps_rollup(text: &str) -> Option<(u64, u64)> {
    Some((kib_field(text, "Rss:")?, kib_field(text, "Pss:")?))
}

/// `(total, available)` bytes from the text of `/proc/meminfo`.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    Some((
        kib_field(text, "MemTotal:")?,
        kib_field(text, "MemAvailable:")?,
    ))
}

/// Processes a tree walk visits at most: a bound on the work, whatever a process forks.
const MAX_TREE: usize = 65_536;

/// `pid` and all its descendants (found through `/proc/<pid>/task/*/children`).
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() && tree.len() < MAX_TREE {
        let p = tree[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for task in tasks.flatten() {
                if let Ok(children) = std::fs::read_to_string(task.path().join("children")) {
                    tree.extend(
                        children
                            .split_whitespace()
                            .filter_map(|c| c.parse::<u32>().ok()),
                    );
                }
            }
        }
        i += 1;
    }
    tree.sort_unstable();
    tree.dedup();
    tree
}

/// RSS and, where `smaps_rollup` can be read, PSS of process `pid`; `None` when it is gone.
pub fn process_memory(pid: u32) -> Option<(u64, Option<u64>)> {
    match std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| parse_smaps_rollup(&t))
    {
        Some((rss, pss)) => Some((rss, Some(pss))),
        None => Some((rss_bytes(Some(pid))?, None)),
    }
}

/// Memory of `pid`'s process tree: RSS and PSS from `smaps_rollup`, RSS from `statm` where that
/// is unreadable (PSS is then left out for the tree); `None` when the process is gone.
pub fn tree_memory(pid: u32) -> Option<TreeMemory> {
    let mut total = TreeMemory {
        pss: Some(0),
        ..Default::default()
    };
    let mut seen = false;
    for p in process_tree(pid) {
        let Some((rss, pss)) = process_memory(p) else {
            continue; // exited between listing and reading
        };
        seen = true;
        total.processes += 1;
        total.rss += rss;
        total.pss = total.pss.zip(pss).map(|(a, b)| a + b);
        total.held += pss.unwrap_or(rss);
    }
    seen.then_some(total)
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

#[cfg(test)]
mod tree_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_smaps_rollup_and_meminfo() {
        let rollup = "00400000-7ffd [rollup]\nRss:               10240 kB\nPss:                4096 kB\nShared_Clean: 1 kB\n";
        assert_eq!(
            parse_smaps_rollup(rollup),
            Some((10240 * 1024, 4096 * 1024))
        );
        assert_eq!(parse_smaps_rollup("Rss: 1 kB\n"), None, "no PSS line");
        let meminfo = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            parse_meminfo(meminfo),
            Some((24000000 * 1024, 20000000 * 1024))
        );
    }

    #[test]
    fn a_process_tree_includes_children_and_grandchildren() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while process_tree(pid).len() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let tree = process_tree(pid);
        let memory = tree_memory(pid).unwrap();
        child.kill().unwrap();
        let _ = child.wait();
        assert_eq!(tree.len(), 3, "{tree:?}");
        assert_eq!(memory.processes, 3);
        assert!(memory.rss > 0);
        let pss = memory
            .pss
            .expect("smaps_rollup is readable for our own children");
        assert!(pss <= memory.rss, "PSS {pss} > RSS {}", memory.rss);
        assert!(tree_memory(u32::MAX - 1).is_none());
    }
}
