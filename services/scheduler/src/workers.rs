//! Registered device workers: who they are, how to reach them, when they last spoke.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::{DeviceInfo, WorkerInfo, WorkerStats};

#[derive(Clone)]
pub struct Worker {
    pub id: String,
    pub address: String,
    pub device: DeviceInfo,
    pub client: DeviceWorkerClient<nomad_rpc::Channel>,
    /// Bumped on every (re-)registration so per-worker state from an earlier life is not reused.
    pub generation: u64,
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

    /// Adds or replaces a worker. Fails only on an address that cannot be dialled.
    pub fn register(
        &self,
        id: &str,
        address: &str,
        device: DeviceInfo,
    ) -> Result<Worker, nomad_rpc::RpcError> {
        let worker = Worker {
            id: id.to_owned(),
            address: nomad_rpc::normalize_address(address),
            device,
            client: DeviceWorkerClient::new(nomad_rpc::channel(address)?),
            generation: self
                .next_generation
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
        self.lock().insert(
            id.to_owned(),
            Entry {
                worker: worker.clone(),
                last_seen: Instant::now(),
                stats: None,
            },
        );
        Ok(worker)
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

    /// Drops workers silent for longer than `timeout`; returns their ids.
    pub fn reap(&self, timeout: Duration) -> Vec<String> {
        let now = Instant::now();
        let mut gone = Vec::new();
        self.lock().retain(|id, e| {
            let alive = now.duration_since(e.last_seen) <= timeout;
            if !alive {
                gone.push(id.clone());
            }
            alive
        });
        gone
    }

    /// Workers in a stable order (by id).
    pub fn workers(&self) -> Vec<Worker> {
        let mut workers: Vec<_> = self.lock().values().map(|e| e.worker.clone()).collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        workers
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
