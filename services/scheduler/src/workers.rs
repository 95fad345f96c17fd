//! Registered device workers: who they are, how to reach them, when they last spoke.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::{DeviceInfo, WorkerInfo, WorkerStats};
use nomad_telemetry::KeyValue;

/// A CPU worker serves several tools at once, each on a lane: a core slot of its own, numbered
/// `generation | lane << LANE_SHIFT` (lane 0 is the generation itself, as for any worker).
const LANE_SHIFT: u32 = 48;

pub fn lane_slot(generation: u64, lane: u64) -> u64 {
    generation | (lane << LANE_SHIFT)
}

/// The worker (its generation) a slot is a lane of.
pub fn worker_of(slot: u64) -> u64 {
    slot & ((1 << LANE_SHIFT) - 1)
}

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

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(
        "worker id {id:?} is registered from {address} and still heartbeating: a second worker \
         with that id is refused until the first misses its heartbeats (give each worker its \
         own --worker-id)"
    )]
    Taken { id: String, address: String },
    #[error(transparent)]
    Address(#[from] nomad_rpc::RpcError),
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

    /// Adds a worker, or replaces one of the same id that registers again from the same
    /// address (a restart) or has missed its heartbeats for `liveness`; returns it and the
    /// generation it replaced, if any. A second live worker claiming a registered id from
    /// another address is refused: it would receive the first one's inputs.
    pub fn register(
        &self,
        id: &str,
        address: &str,
        device: DeviceInfo,
        liveness: Duration,
    ) -> Result<(Worker, Option<u64>), RegisterError> {
        let address = nomad_rpc::normalize_address(address);
        let mut entries = self.lock();
        if let Some(existing) = entries.get(id)
            && existing.worker.address != address
            && existing.last_seen.elapsed() <= liveness
        {
            return Err(RegisterError::Taken {
                id: id.to_owned(),
                address: existing.worker.address.clone(),
            });
        }
        let worker = Worker {
            id: id.to_owned(),
            client: DeviceWorkerClient::new(nomad_rpc::channel(&address)?)
                .max_decoding_message_size(nomad_rpc::WORKER_MESSAGE_LIMIT)
                .max_encoding_message_size(nomad_rpc::WORKER_MESSAGE_LIMIT),
            address,
            device,
            generation: self
                .next_generation
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
        let replaced = entries.insert(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lane_is_a_slot_of_its_own_that_names_its_worker() {
        assert_eq!(lane_slot(5, 0), 5, "lane 0 is the worker's own slot");
        let lanes: Vec<u64> = (0..4).map(|l| lane_slot(5, l)).collect();
        assert!(lanes.iter().all(|&s| worker_of(s) == 5), "{lanes:?}");
        let mut distinct = lanes.clone();
        distinct.extend((0..4).map(|l| lane_slot(6, l)));
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 8);
    }

    #[tokio::test]
    async fn a_live_worker_id_cannot_be_taken_from_another_address() {
        let registry = WorkerRegistry::default();
        let device = DeviceInfo::default();
        let live = Duration::from_secs(60);
        let (first, _) = registry
            .register("w", "127.0.0.1:5001", device.clone(), live)
            .unwrap();
        let Err(taken) = registry.register("w", "127.0.0.1:6666", device.clone(), live) else {
            panic!("an impostor took a live worker's id");
        };
        let taken = taken.to_string();
        assert!(
            taken.contains("http://127.0.0.1:5001") && taken.contains("--worker-id"),
            "{taken}"
        );
        // The same address again is a restart: it replaces the first.
        let (_, replaced) = registry
            .register("w", "127.0.0.1:5001", device.clone(), live)
            .unwrap();
        assert_eq!(replaced, Some(first.generation));
        // Once it has been silent past its liveness, another address may take the id.
        let (_, replaced) = registry
            .register("w", "127.0.0.1:6666", device, Duration::ZERO)
            .unwrap();
        assert!(replaced.is_some());
    }
}
