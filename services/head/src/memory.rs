//! Memory profiling of the fleet (`memory_profiling.enabled`): the host, and each server's
//! whole process tree (`nomad_telemetry::process::tree_memory`). PSS is left out for a tree when
//! any member lacks it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nomad_telemetry::KeyValue;
use nomad_telemetry::metrics as defs;
use nomad_telemetry::process::{TreeMemory, parse_meminfo, tree_memory};

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
                held: entry.1.held.max(now.held),
            };
        }
        if let Some((total, available)) = host {
            let used = total.saturating_sub(available);
            let peak = s.host.map_or(used, |(_, _, p)| p.max(used));
            s.host = Some((total, available, peak));
        }
    }

    /// Samples the running `servers` (kept current across restarts) every `interval` until
    /// the task is aborted.
    pub fn run(
        self: Arc<Self>,
        servers: crate::supervisor::Servers,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let servers = servers.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let this = self.clone();
                // /proc reads are blocking I/O.
                let _ = tokio::task::spawn_blocking(move || this.sample(&servers)).await;
            }
        })
    }
}
