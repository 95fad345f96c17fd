//! The Scheduler gRPC service: converts between the wire and the dispatcher and registry.

use std::sync::Arc;

use nomad_proto::v1::scheduler_server::Scheduler;
use nomad_proto::v1::{
    CallToolRequest, CallToolResponse, HeartbeatRequest, HeartbeatResponse, ListToolsRequest,
    ListToolsResponse, ListWorkersRequest, ListWorkersResponse, RegisterWorkerRequest,
    RegisterWorkerResponse, ToolInfo,
};
use tonic::{Request, Response, Status};

use crate::config::ToolConfig;
use crate::driver::Handle;
use crate::workers::WorkerRegistry;

pub struct SchedulerService {
    pub tools: Vec<ToolConfig>,
    pub driver: Handle,
    pub workers: Arc<WorkerRegistry>,
    pub heartbeat_interval_ms: u32,
}

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    async fn list_tools(
        &self,
        _request: Request<ListToolsRequest>,
    ) -> Result<Response<ListToolsResponse>, Status> {
        let tools = self
            .tools
            .iter()
            .map(|t| ToolInfo {
                name: t.name.clone(),
                kind: t.kind.clone(),
                description: t.description.clone(),
                batch_size: t.batch_size,
                max_devices: t.max_devices,
                max_pending: t.max_pending,
            })
            .collect();
        Ok(Response::new(ListToolsResponse { tools }))
    }

    async fn call_tool(
        &self,
        request: Request<CallToolRequest>,
    ) -> Result<Response<CallToolResponse>, Status> {
        let CallToolRequest { tool, input } = request.into_inner();
        if tool.is_empty() {
            return Err(Status::invalid_argument("`tool` is required"));
        }
        let input = input.ok_or_else(|| Status::invalid_argument("`input` is required"))?;
        let served = self.driver.call(&tool, input).await?;
        Ok(Response::new(CallToolResponse {
            output: Some(served.output),
            worker_id: served.worker_id,
            queue_wait_seconds: served.queue_wait.as_secs_f64(),
            batch_size: served.batch_size,
        }))
    }

    async fn register_worker(
        &self,
        request: Request<RegisterWorkerRequest>,
    ) -> Result<Response<RegisterWorkerResponse>, Status> {
        let RegisterWorkerRequest {
            worker_id,
            address,
            device,
        } = request.into_inner();
        if worker_id.is_empty() || address.is_empty() {
            return Err(Status::invalid_argument(
                "`worker_id` and `address` are required",
            ));
        }
        let device = device.ok_or_else(|| Status::invalid_argument("`device` is required"))?;
        // Three missed heartbeats is what the reaper waits for too.
        let liveness = std::time::Duration::from_millis(u64::from(self.heartbeat_interval_ms) * 3);
        let (worker, replaced) = self
            .workers
            .register(&worker_id, &address, device, liveness)
            .map_err(|e| match e {
                crate::workers::RegisterError::Taken { .. } => {
                    tracing::warn!(%worker_id, %address, "{e}");
                    Status::already_exists(e.to_string())
                }
                crate::workers::RegisterError::Address(_) => {
                    Status::invalid_argument(e.to_string())
                }
            })?;
        if let Some(old) = replaced {
            self.driver
                .worker_down(old, "the worker registered again".into())
                .await;
        }
        self.driver.worker_up(worker).await;
        tracing::info!(%worker_id, %address, "worker registered");
        Ok(Response::new(RegisterWorkerResponse {
            heartbeat_interval_ms: self.heartbeat_interval_ms,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let HeartbeatRequest { worker_id, stats } = request.into_inner();
        Ok(Response::new(HeartbeatResponse {
            registered: self.workers.heartbeat(&worker_id, stats),
        }))
    }

    async fn list_workers(
        &self,
        _request: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        Ok(Response::new(ListWorkersResponse {
            workers: self.workers.infos(),
        }))
    }
}
