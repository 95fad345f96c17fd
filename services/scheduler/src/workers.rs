//! Registered device workers: who they are, how to reach them, when they last spoke.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::{DeviceInfo, WorkerInfo, WorkerStats};
use nomad_telemetry::KeyValue;

#[derive(Clone)]
pub struct Worker {
    pub id: String,
    pub address: String,
    pub device: DeviceInfo,
    pub client: DeviceWorkerClient<nomad_rpc::Channel>,
    /// Bumped on every (re-)registration so per-worker state from an earlier life is not reused.
    pub generation: u64,
}

impl Worker {
    /// `device`, `device.type`, `device.index` and the worker's id (which tells two workers'
    /// `cpu:0` apart), for slot metrics and spans.
    pub fn device_attributes(&self) -> Vec<KeyValue> {
        vec![
            KeyValue::new(
                "device",
                format!("{}:{}", self.device.r#type, self.device.index),
            ),
            KeyValue::new("device.type", self.device.r#type.clone()),
            KeyValue::new("device.index", i64::from(self.device.index)),
            KeyValue::new("nomad.worker.id", self.id.clone()),
        ]
    }

    /// `tool` and the device attributes, for batch and device metrics.
    pub fn tool_attributes(&self, tool: &str) -> Vec<KeyValue> {
        let mut attributes = vec![KeyValue::new("tool", tool.to_owned())];
        attributes.extend(self.device_attributes());
        attributes
    }
}

struct Entry {
    worker: Worker,
    last_seen: Instant,
    stats: Option<WorkerStats>,
}

#[derive(Default)]
pub struct WorkerRegistry {
    entries: Mutex<HashMap<String, Entry>>,
    next_generation: std::sync::atomic::AtomicU64,
}

impl WorkerRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces a worker; returns it and the generation it replaced, if any. Fails only
    /// on an address that cannot be dialled.
    pub fn register(
        &self,
        id: &str,
        address: &str,
        device: DeviceInfo,
    ) -> Result<(Worker, Option<u64>), nomad_rpc::RpcError> {
        let worker = Worker {
            id: id.to_owned(),
            address: nomad_rpc::normalize_address(address),
            device,
            client: DeviceWorkerClient::new(nomad_rpc::channel(address)?),
            generation: self
                .next_generation
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
        let replaced = self.lock().insert(
            id.to_owned(),
            Entry {
                worker: worker.clone(),
                last_seen: Instant::now(),
                stats: None,
            },
        );
        Ok((worker, replaced.map(|e| e.worker.generation)))
    }

    /// Forgets `id` if it is still the given generation (its next heartbeat then asks it to
    /// register again).
    pub fn forget(&self, id: &str, generation: u64) {
        let mut entries = self.lock();
        if entries
            .get(id)
            .is_some_and(|e| e.worker.generation == generation)
        {
            entries.remove(id);
        }
    }

    /// Each worker's device attributes and latest reported stats.
    pub fn stats(&self) -> Vec<(Vec<KeyValue>, WorkerStats)> {
        self.lock()
            .values()
            .filter_map(|e| e.stats.clone().map(|s| (e.worker.device_attributes(), s)))
            .collect()
    }

    /// Records a heartbeat; false when the worker is unknown (it must register again).
    pub fn heartbeat(&self, id: &str, stats: Option<WorkerStats>) -> bool {
        match self.lock().get_mut(id) {
            Some(entry) => {
                entry.last_seen = Instant::now();
                if stats.is_some() {
                    entry.stats = stats;
                }
                true
            }
            None => false,
        }
    }

    /// Drops workers silent for longer than `timeout`; returns them.
    pub fn reap(&self, timeout: Duration) -> Vec<Worker> {
        let now = Instant::now();
        let mut gone = Vec::new();
        self.lock().retain(|_, e| {
            let alive = now.duration_since(e.last_seen) <= timeout;
            if !alive {
                gone.push(e.worker.clone());
            }
            alive
        });
        gone
    }

    pub fn infos(&self) -> Vec<WorkerInfo> {
        let mut infos: Vec<_> = self
            .lock()
            .values()
            .map(|e| WorkerInfo {
                worker_id: e.worker.id.clone(),
                address: e.worker.address.clone(),
                device: Some(e.worker.device.clone()),
                stats: e.stats.clone(),
            })
            .collect();
        infos.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        infos
    }
}
