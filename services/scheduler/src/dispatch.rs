//! Runs one tool request on a registered worker: picks a worker in turn, makes sure the tool is
//! loaded and placed there (once per worker), and executes it as a batch of one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nomad_proto::v1::{
    CallToolResponse, ExecuteBatchRequest, LoadRequest, ModelSpec, PlaceRequest, ToolInput,
    execute_batch_response, item_result,
};
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::trace::FutureExt as _;
use tokio::sync::OnceCell;
use tonic::Status;

use crate::config::ToolConfig;
use crate::metrics::{Metrics, device_attributes};
use crate::workers::{Worker, WorkerRegistry};

type ReadyKey = (String, u64, String);

pub struct Dispatcher {
    tools: HashMap<String, ToolConfig>,
    workers: Arc<WorkerRegistry>,
    next: AtomicUsize,
    /// Per (worker, generation, tool): done once the tool is loaded and placed there.
    ready: Mutex<HashMap<ReadyKey, Arc<OnceCell<()>>>>,
    metrics: Metrics,
}

/// Why a request was turned away before it ran (`reason` attribute of the rejection counter).
fn reject(metrics: &Metrics, tool: &str, reason: &'static str, status: Status) -> Status {
    metrics.request_rejections.add(
        1,
        &[
            KeyValue::new("tool", tool.to_owned()),
            KeyValue::new("reason", reason),
        ],
    );
    status
}

impl Dispatcher {
    pub fn new(tools: Vec<ToolConfig>, workers: Arc<WorkerRegistry>) -> Self {
        Self {
            tools: tools.into_iter().map(|t| (t.name.clone(), t)).collect(),
            workers,
            next: AtomicUsize::new(0),
            ready: Mutex::default(),
            metrics: Metrics::new(),
        }
    }

    pub fn tools(&self) -> Vec<&ToolConfig> {
        let mut tools: Vec<_> = self.tools.values().collect();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        tools
    }

    fn unknown_tool(&self, tool: &str) -> Status {
        let known: Vec<_> = self.tools().iter().map(|t| t.name.as_str()).collect();
        Status::not_found(format!(
            "unknown tool {tool:?}; this scheduler serves: {}",
            known.join(", ")
        ))
    }

    /// Runs `input` on `tool`. The caller's context is current (set by the server layer).
    pub async fn call(&self, tool: &str, input: ToolInput) -> Result<CallToolResponse, Status> {
        let metrics = &self.metrics;
        let Some(config) = self.tools.get(tool) else {
            return Err(reject(
                metrics,
                tool,
                "unknown_tool",
                self.unknown_tool(tool),
            ));
        };
        let workers = self.workers.workers();
        if workers.is_empty() {
            return Err(Status::unavailable(
                "no device worker is registered with the scheduler",
            ));
        }
        let worker = workers[self.next.fetch_add(1, Ordering::Relaxed) % workers.len()].clone();
        let tool_attr = [KeyValue::new("tool", tool.to_owned())];
        metrics.requests.add(1, &tool_attr);

        let started = Instant::now();
        let span = GroupSpan::start(SpanGroup::Tool, "nomad.tool.request", &Context::current());
        span.set_attribute(KeyValue::new("tool", tool.to_owned()));
        let result = self
            .run(config, &worker, input, started)
            .with_context(span.context().clone())
            .await;
        let status = if result.is_ok() { "ok" } else { "error" };
        if let Err(e) = &result {
            span.set_error(format!("{:?}", e.code()), e.message().to_owned());
            metrics.request_errors.add(1, &tool_attr);
        }
        metrics.request_duration.record(
            started.elapsed().as_secs_f64(),
            &[
                KeyValue::new("tool", tool.to_owned()),
                KeyValue::new("status", status),
            ],
        );
        result
    }

    async fn run(
        &self,
        config: &ToolConfig,
        worker: &Worker,
        input: ToolInput,
        started: Instant,
    ) -> Result<CallToolResponse, Status> {
        self.ensure_ready(config, worker).await?;
        let queue_wait = started.elapsed().as_secs_f64();
        self.metrics
            .request_queue_wait
            .record(queue_wait, &[KeyValue::new("tool", config.name.clone())]);

        let mut attributes = device_attributes(&config.name, &worker.device);
        let span = GroupSpan::start(SpanGroup::Batch, "nomad.tool.batch", &Context::current());
        span.set_attributes(attributes.clone());
        span.set_attribute(KeyValue::new("nomad.tool.batch.size", 1));
        let batch_started = Instant::now();
        let mut client = worker.client.clone();
        let reply = client
            .execute_batch(ExecuteBatchRequest {
                tool: config.name.clone(),
                inputs: vec![input],
                traces: vec![],
            })
            .with_context(span.context().clone())
            .await;
        let outcome = match reply {
            Ok(reply) => reply.into_inner().outcome,
            Err(status) => {
                span.set_error(format!("{:?}", status.code()), status.message().to_owned());
                return Err(worker_failure(worker, status));
            }
        };
        let result = match outcome {
            Some(execute_batch_response::Outcome::Results(results)) => {
                match results.items.into_iter().next().and_then(|i| i.result) {
                    Some(item_result::Result::Output(output)) => Ok(CallToolResponse {
                        output: Some(output),
                        worker_id: worker.id.clone(),
                        queue_wait_seconds: queue_wait,
                        batch_size: 1,
                    }),
                    Some(item_result::Result::InvalidInput(message)) => Err(
                        Status::invalid_argument(format!("{}: {message}", config.name)),
                    ),
                    None => Err(Status::internal(format!(
                        "worker {} returned no result for the request",
                        worker.id
                    ))),
                }
            }
            Some(execute_batch_response::Outcome::OutOfMemory(oom)) => {
                Err(Status::resource_exhausted(format!(
                    "{} ran out of memory on worker {}: {}",
                    config.name, worker.id, oom.detail
                )))
            }
            None => Err(Status::internal(format!(
                "worker {} returned an empty batch outcome",
                worker.id
            ))),
        };
        let status = if result.is_ok() { "ok" } else { "error" };
        attributes.push(KeyValue::new("status", status));
        self.metrics
            .batch_duration
            .record(batch_started.elapsed().as_secs_f64(), &attributes);
        self.metrics.batch_size.record(1, &attributes);
        result
    }

    /// Loads and places `config` on `worker` unless that already happened in this worker's life.
    async fn ensure_ready(&self, config: &ToolConfig, worker: &Worker) -> Result<(), Status> {
        let key = (worker.id.clone(), worker.generation, config.name.clone());
        let cell = self
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default()
            .clone();
        cell.get_or_try_init(|| self.load_and_place(config, worker))
            .await
            .map(|_| ())
    }

    async fn load_and_place(&self, config: &ToolConfig, worker: &Worker) -> Result<(), Status> {
        let mut client = worker.client.clone();
        let tool_attr = KeyValue::new("tool", config.name.clone());
        let load_attrs = [tool_attr.clone(), KeyValue::new("load.kind", "resident")];
        let started = Instant::now();
        self.metrics.disk_loads.add(1, &load_attrs);
        client
            .load(LoadRequest {
                model: Some(ModelSpec {
                    tool: config.name.clone(),
                    kind: config.kind.clone(),
                    source: config.source.clone(),
                }),
            })
            .await
            .map_err(|s| worker_failure(worker, s))?;
        self.metrics
            .disk_load_duration
            .record(started.elapsed().as_secs_f64(), &load_attrs);
        let placing = Instant::now();
        client
            .place(PlaceRequest {
                tool: config.name.clone(),
            })
            .await
            .map_err(|s| worker_failure(worker, s))?;
        self.metrics.device_load_duration.record(
            placing.elapsed().as_secs_f64(),
            &device_attributes(&config.name, &worker.device),
        );
        Ok(())
    }
}

/// A worker's error as the caller should see it: its own status when it answered, UNAVAILABLE
/// naming the worker when it could not be reached.
fn worker_failure(worker: &Worker, status: Status) -> Status {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            Status::unavailable(format!(
                "device worker {} ({}) is unreachable: {}",
                worker.id,
                worker.address,
                status.message()
            ))
        }
        _ => status,
    }
}
