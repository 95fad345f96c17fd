//! The Scheduler gRPC service: converts between the wire and the dispatcher and registry.

use std::sync::Arc;

use nomad_proto::v1::scheduler_server::Scheduler;
use nomad_proto::v1::{
    CallToolRequest, CallToolResponse, CallToolStreamEvent, GetModelCardRequest, HeartbeatRequest,
    HeartbeatResponse, ListToolsRequest, ListToolsResponse, ListWorkersRequest,
    ListWorkersResponse, ModelCard, RegisterWorkerRequest, RegisterWorkerResponse,
    SchedulerSnapshot, SchedulerSnapshotRequest, ToolActivity, ToolInput, call_tool_stream_event,
};
use tonic::{Request, Response, Status};

use crate::catalog::Catalog;
use crate::driver::{Handle, Served};
use crate::error::{CallError, Category};

/// Text events a streamed call buffers before its worker call waits for the caller to read.
const STREAM_BUFFER: usize = 64;

/// The status a caller gets for the scheduler's error: its words, its category's code.
fn status(error: CallError) -> Status {
    let code = match error.category() {
        Category::InvalidArgument => tonic::Code::InvalidArgument,
        Category::NotFound => tonic::Code::NotFound,
        Category::FailedPrecondition => tonic::Code::FailedPrecondition,
        Category::ResourceExhausted => tonic::Code::ResourceExhausted,
        Category::Unavailable => tonic::Code::Unavailable,
        Category::Internal => tonic::Code::Internal,
        Category::Cancelled => tonic::Code::Cancelled,
    };
    Status::new(code, error.to_string())
}

fn request_parts(request: CallToolRequest) -> Result<(String, ToolInput), Status> {
    let CallToolRequest { tool, input } = request;
    if tool.is_empty() {
        return Err(Status::invalid_argument("`tool` is required"));
    }
    let input = input.ok_or_else(|| Status::invalid_argument("`input` is required"))?;
    Ok((tool, input))
}

fn response(served: Served) -> CallToolResponse {
    CallToolResponse {
        output: Some(served.output),
        worker_id: served.worker_id,
        queue_wait_seconds: served.queue_wait.as_secs_f64(),
        batch_size: served.batch_size,
        generation: served.generation,
    }
}
use crate::workers::WorkerRegistry;

pub struct SchedulerService {
    pub catalog: Arc<Catalog>,
    pub driver: Handle,
    pub workers: Arc<WorkerRegistry>,
    pub heartbeat_interval_ms: u32,
    pub published: Arc<std::sync::Mutex<crate::metrics::Published>>,
    pub recent: Arc<crate::recent::Recent>,
}

impl SchedulerService {
    pub fn new(
        catalog: Arc<Catalog>,
        driver: &crate::driver::Running,
        workers: Arc<WorkerRegistry>,
        manager: &crate::config::ToolManagerConfig,
    ) -> Self {
        Self {
            catalog,
            driver: driver.handle.clone(),
            workers,
            heartbeat_interval_ms: manager.heartbeat_interval_ms.max(50),
            published: driver.published.clone(),
            recent: driver.recent.clone(),
        }
    }
}

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    async fn list_tools(
        &self,
        _request: Request<ListToolsRequest>,
    ) -> Result<Response<ListToolsResponse>, Status> {
        Ok(Response::new(ListToolsResponse {
            tools: self.catalog.infos(),
        }))
    }

    async fn call_tool(
        &self,
        request: Request<CallToolRequest>,
    ) -> Result<Response<CallToolResponse>, Status> {
        let (tool, input) = request_parts(request.into_inner())?;
        self.catalog
            .ready_for_call(&tool, &input)
            .await
            .map_err(status)?;
        let served = self.driver.call(&tool, input).await.map_err(status)?;
        Ok(Response::new(response(served)))
    }

    type CallToolStreamStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<CallToolStreamEvent, Status>> + Send>>;

    async fn call_tool_stream(
        &self,
        request: Request<CallToolRequest>,
    ) -> Result<Response<Self::CallToolStreamStream>, Status> {
        use opentelemetry::trace::FutureExt as _;
        let (tool, input) = request_parts(request.into_inner())?;
        self.catalog
            .ready_for_call(&tool, &input)
            .await
            .map_err(status)?;
        let (text, texts) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let driver = self.driver.clone();
        // Dropping the stream drops the call, which cancels the request.
        let call: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> = Box::pin(
            async move { driver.call_streaming(&tool, input, Some(text)).await }
                .with_context(nomad_telemetry::Context::current()),
        );
        enum State<F> {
            Running(F, tokio::sync::mpsc::Receiver<String>),
            /// The answer came: what text is left, then the answer.
            Ending(std::collections::VecDeque<Result<CallToolStreamEvent, Status>>),
        }
        let event = |e| CallToolStreamEvent { event: Some(e) };
        let stream = futures::stream::unfold(
            State::Running(call, texts),
            move |state| async move {
                match state {
                    State::Running(mut call, mut texts) => tokio::select! {
                        // Text first: what the worker sent before its outcome goes out before it.
                        biased;
                        Some(t) = texts.recv() => Some((
                            Ok(event(call_tool_stream_event::Event::Text(t))),
                            State::Running(call, texts),
                        )),
                        result = &mut call => {
                            let mut rest = std::collections::VecDeque::new();
                            while let Ok(t) = texts.try_recv() {
                                rest.push_back(Ok(event(call_tool_stream_event::Event::Text(t))));
                            }
                            rest.push_back(
                                result
                                    .map(|s| event(call_tool_stream_event::Event::Done(response(s))))
                                    .map_err(status),
                            );
                            let first = rest.pop_front().expect("the answer is there");
                            Some((first, State::Ending(rest)))
                        }
                    },
                    State::Ending(mut rest) => rest.pop_front().map(|e| (e, State::Ending(rest))),
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
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
        self.driver.worker_up(worker.clone()).await;
        tracing::info!(%worker_id, %address, "worker registered");
        self.catalog.describe_on(worker, self.driver.clone());
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

    async fn snapshot(
        &self,
        _request: Request<SchedulerSnapshotRequest>,
    ) -> Result<Response<SchedulerSnapshot>, Status> {
        let now = std::time::Instant::now();
        let core = self
            .published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .core
            .clone();
        let tools = core
            .tools
            .iter()
            .map(|t| {
                let recent = self.recent.activity(&t.name, now);
                ToolActivity {
                    name: t.name.clone(),
                    queue_length: t.queue_length as u32,
                    in_flight: t.inflight,
                    configured_batch_size: t.batch_size,
                    recent_batch_size: recent.mean_batch_size,
                    requests_per_second: recent.requests_per_second,
                    latency_p50_seconds: recent.latency_p50_seconds,
                    latency_p99_seconds: recent.latency_p99_seconds,
                }
            })
            .collect();
        Ok(Response::new(SchedulerSnapshot {
            tools,
            workers: self.workers.infos(),
            window_seconds: crate::recent::WINDOW.as_secs_f64(),
        }))
    }

    async fn get_model_card(
        &self,
        request: Request<GetModelCardRequest>,
    ) -> Result<Response<ModelCard>, Status> {
        let tool = request.into_inner().tool;
        let text = self.catalog.model_card(&tool).map_err(status)?;
        Ok(Response::new(ModelCard { tool, text }))
    }
}
