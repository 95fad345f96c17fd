//! Registers this worker with the scheduler and keeps it registered: heartbeats at the interval
//! the scheduler asks for, and registers again when the scheduler has forgotten it.

use std::sync::Arc;
use std::time::Duration;

use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{DeviceInfo, HeartbeatRequest, RegisterWorkerRequest};

use crate::models::load::Backend;
use crate::store::ModelStore;

pub struct Registration {
    pub scheduler: SchedulerClient<nomad_rpc::Channel>,
    pub worker_id: String,
    pub address: String,
    pub device: DeviceInfo,
    pub store: Arc<ModelStore>,
    pub backend: Arc<Backend>,
    pub on_accelerator: bool,
}

impl Registration {
    /// Runs until the task is dropped.
    pub async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        let mut reported_down = false;
        loop {
            let request = RegisterWorkerRequest {
                worker_id: self.worker_id.clone(),
                address: self.address.clone(),
                device: Some(self.device.clone()),
            };
            let interval = match self.scheduler.register_worker(request).await {
                Ok(reply) => {
                    tracing::info!(worker_id = %self.worker_id, "registered with the scheduler");
                    reported_down = false;
                    backoff = Duration::from_millis(100);
                    Duration::from_millis(u64::from(
                        reply.into_inner().heartbeat_interval_ms.max(50),
                    ))
                }
                Err(status) => {
                    if !reported_down {
                        tracing::warn!(
                            "cannot register with the scheduler ({}): retrying",
                            status.message()
                        );
                        reported_down = true;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            self.heartbeat_until_forgotten(interval).await;
        }
    }

    /// Heartbeats until the scheduler says it does not know this worker or stays unreachable.
    async fn heartbeat_until_forgotten(&mut self, interval: Duration) {
        let mut failures = 0u32;
        loop {
            tokio::time::sleep(interval).await;
            let request = HeartbeatRequest {
                worker_id: self.worker_id.clone(),
                stats: Some(crate::stats::collect(
                    &self.store,
                    &self.backend,
                    self.on_accelerator,
                )),
            };
            match self.scheduler.heartbeat(request).await {
                Ok(reply) if reply.get_ref().registered => failures = 0,
                Ok(_) => {
                    tracing::warn!("the scheduler no longer knows this worker: registering again");
                    return;
                }
                Err(status) => {
                    failures += 1;
                    if failures == 3 {
                        tracing::warn!(
                            "heartbeats failing ({}): registering again",
                            status.message()
                        );
                        return;
                    }
                }
            }
        }
    }
}
