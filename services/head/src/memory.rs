//! Memory profiling of the fleet (`memory_profiling.enabled`): the host, and each server's
//! whole process tree (found through `/proc/<pid>/task/*/children`), with RSS and PSS from
//! `smaps_rollup` and RSS from `statm` where that is missing. PSS is left out for a tree when any
//! member lacks it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nomad_telemetry::KeyValue;
use nomad_telemetry::metrics as defs;

/// One process tree's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TreeMemory {
    pub processes: u64,
    pub rss: u64,
    pub pss: Option<u64>,
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

/// `pid` and all its descendants.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
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

/// Memory of `pid`'s process tree; `None` when the process is gone.
pub fn tree_memory(pid: u32) -> Option<TreeMemory> {
    let mut total = TreeMemory {
        pss: Some(0),
        ..Default::default()
    };
    let mut seen = false;
    for p in process_tree(pid) {
        let (rss, pss) = match std::fs::read_to_string(format!("/proc/{p}/smaps_rollup"))
            .ok()
            .and_then(|t| parse_smaps_rollup(&t))
        {
            Some((rss, pss)) => (rss, Some(pss)),
            None => {
                let Some(rss) = nomad_telemetry::process::rss_bytes(Some(p)) else {
                    continue; // exited between listing and reading
                };
                (rss, None)
            }
        };
        seen = true;
        total.processes += 1;
        total.rss += rss;
        total.pss = total.pss.zip(pss).map(|(a, b)| a + b);
    }
    seen.then_some(total)
}

#[derive(Debug, Default)]
struct Samples {
    servers: BTreeMap<String, (TreeMemory, TreeMemory)>, // (latest, peak)
    host: Option<(u64, u64, u64)>,                       // (total, available, peak used)
}

/// The values one gauge reports from a server's (latest, peak) samples.
type PickSeries = fn(&(TreeMemory, TreeMemory)) -> Vec<(f64, &'static str)>;

/// RSS, and PSS where every process of the tree had it, labelled by `memory.type`.
fn by_type(m: &TreeMemory) -> Vec<(f64, &'static str)> {
    let mut v = vec![(m.rss as f64, "rss")];
    v.extend(m.pss.map(|p| (p as f64, "pss")));
    v
}

/// Samples the fleet's memory every interval and reports it through observable gauges.
pub struct Profiler {
    samples: Arc<Mutex<Samples>>,
    _gauges: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

fn lock(s: &Mutex<Samples>) -> std::sync::MutexGuard<'_, Samples> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl Profiler {
    pub fn new() -> Self {
        let samples = Arc::new(Mutex::new(Samples::default()));
        let server_gauge = |def: &'static defs::MetricDef, pick: PickSeries| {
            let s = samples.clone();
            Box::new(def.f64_observable_gauge(move |o| {
                for (server, values) in &lock(&s).servers {
                    for (v, memory_type) in pick(values) {
                        let mut attributes = vec![KeyValue::new("server", server.clone())];
                        if !memory_type.is_empty() {
                            attributes.push(KeyValue::new("memory.type", memory_type));
                        }
                        o.observe(v, &attributes);
                    }
                }
            })) as Box<dyn std::any::Any + Send + Sync>
        };
        let host_gauge = |def: &'static defs::MetricDef, pick: fn(u64, u64, u64) -> u64| {
            let s = samples.clone();
            Box::new(def.f64_observable_gauge(move |o| {
                if let Some((total, available, peak)) = lock(&s).host {
                    o.observe(pick(total, available, peak) as f64, &[]);
                }
            })) as Box<dyn std::any::Any + Send + Sync>
        };
        let gauges = vec![
            server_gauge(&defs::SERVER_MEMORY_USAGE, |(latest, _)| by_type(latest)),
            server_gauge(&defs::SERVER_MEMORY_SAMPLED_PEAK, |(_, peak)| by_type(peak)),
            server_gauge(&defs::SERVER_PROCESSES, |(latest, _)| {
                vec![(latest.processes as f64, "")]
            }),
            host_gauge(&defs::HOST_MEMORY_USAGE, |t, a, _| t.saturating_sub(a)),
            host_gauge(&defs::HOST_MEMORY_AVAILABLE, |_, a, _| a),
            host_gauge(&defs::HOST_MEMORY_TOTAL, |t, _, _| t),
            host_gauge(&defs::HOST_MEMORY_SAMPLED_PEAK, |_, _, p| p),
        ];
        Self {
            samples,
            _gauges: gauges,
        }
    }

    /// Takes one sample of each `(server, pid)` and of the host.
    pub fn sample(&self, servers: &[(String, u32)]) {
        let host = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| parse_meminfo(&t));
        let mut s = lock(&self.samples);
        for (server, pid) in servers {
            let Some(now) = tree_memory(*pid) else {
                continue;
            };
            let entry = s.servers.entry(server.clone()).or_insert((now, now));
            entry.0 = now;
            entry.1 = TreeMemory {
                processes: entry.1.processes.max(now.processes),
                rss: entry.1.rss.max(now.rss),
                pss: match (entry.1.pss, now.pss) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                },
            };
        }
        if let Some((total, available)) = host {
            let used = total.saturating_sub(available);
            let peak = s.host.map_or(used, |(_, _, p)| p.max(used));
            s.host = Some((total, available, peak));
        }
    }

    /// Samples every `interval` until the task is aborted.
    pub fn run(
        self: Arc<Self>,
        servers: Vec<(String, u32)>,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let (this, servers) = (self.clone(), servers.clone());
                // /proc reads are blocking I/O.
                let _ = tokio::task::spawn_blocking(move || this.sample(&servers)).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
