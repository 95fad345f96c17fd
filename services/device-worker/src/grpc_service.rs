//! The DeviceWorker gRPC service: a thin adapter from the wire to the model store.

use std::sync::Arc;
use std::time::Instant;

use nomad_proto::v1::device_worker_server::DeviceWorker;
use nomad_proto::v1::{
    ClearCacheRequest, ClearCacheResponse, DescribeRequest, ExecuteBatchRequest,
    ExecuteBatchResponse, LoadRequest, LoadResponse, OffloadRequest, OffloadResponse, PlaceRequest,
    PlaceResponse, StatsRequest, ToolDescription, UnloadRequest, UnloadResponse, WorkerStats,
    execute_batch_response,
};
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions};
use opentelemetry::trace::{FutureExt as _, Link, TraceContextExt as _};
use tonic::{Request, Response, Status};

use crate::models::backends::python::PythonSettings;
use crate::models::kinds::generate;
use crate::models::load::Backend;
use crate::models::model::{ExecError, ExecLimits, Input, LoadError};
use crate::models::{open, source};
use crate::store::{ModelStore, StoreError};
use crate::wire;

pub struct WorkerService {
    pub store: Arc<ModelStore>,
    pub backend: Arc<Backend>,
    pub limits: ExecLimits,
    pub device_name: String,
    pub on_accelerator: bool,
    pub python: PythonSettings,
}

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::NotLoaded(_) | StoreError::NotPlaced(_) => {
            Status::failed_precondition(e.to_string())
        }
        StoreError::Exec(ExecError::OutOfMemory(m)) => {
            Status::resource_exhausted(format!("out of memory: {m}"))
        }
        StoreError::Exec(ExecError::Failed(m)) => Status::internal(m),
    }
}

fn load_status(e: LoadError) -> Status {
    use source::SourceError;
    match e {
        LoadError::NotFound { .. } | LoadError::Source(SourceError::NotFound(_)) => {
            Status::not_found(e.to_string())
        }
        LoadError::Source(SourceError::NotCached { .. }) => Status::not_found(e.to_string()),
        LoadError::Source(SourceError::Registry { failure, .. }) => {
            use source::RegistryFailure;
            let message = e.to_string();
            match failure {
                RegistryFailure::NotFound => Status::not_found(message),
                RegistryFailure::Denied => Status::permission_denied(message),
                // Not UNAVAILABLE: that says the worker itself is gone.
                RegistryFailure::Unreachable
                | RegistryFailure::Digest
                | RegistryFailure::Artifact
                | RegistryFailure::Other => Status::failed_precondition(message),
            }
        }
        LoadError::Source(SourceError::Cache { .. }) => Status::internal(e.to_string()),
        LoadError::Environment { .. } | LoadError::Host { .. } => {
            Status::failed_precondition(e.to_string())
        }
        LoadError::Invalid { .. } | LoadError::UnknownKind(_) | LoadError::Source(_) => {
            Status::invalid_argument(e.to_string())
        }
    }
}

fn required_tool(tool: &str) -> Result<&str, Status> {
    if tool.is_empty() {
        Err(Status::invalid_argument("`tool` is required"))
    } else {
        Ok(tool)
    }
}

impl WorkerService {
    fn device_span(&self, operation: &'static str, tool: &str) -> GroupSpan {
        let span = GroupSpan::start(SpanGroup::Device, operation, &Context::current());
        span.set_attributes([
            KeyValue::new("tool", tool.to_owned()),
            KeyValue::new("device", self.device_name.clone()),
        ]);
        span
    }

    /// Moves `tool`'s model between host and device memory off the async threads (the copy can
    /// take seconds), in a span named `operation` that records a failure as `error_type`.
    async fn move_model(
        &self,
        tool: &str,
        (operation, error_type): (&'static str, &'static str),
        move_it: fn(&ModelStore, &str) -> Result<(), StoreError>,
    ) -> Result<(), Status> {
        let span = self.device_span(operation, tool);
        let (store, tool) = (self.store.clone(), tool.to_owned());
        blocking(move || move_it(&store, &tool))
            .await?
            .map_err(|e| {
                span.set_error(error_type, e.to_string());
                store_status(e)
            })
    }
}

/// A link to the batch's own span (the current one), when it records.
fn batch_link() -> Vec<Link> {
    let cx = Context::current();
    let span = cx.span();
    let sc = span.span_context();
    if sc.is_valid() {
        vec![Link::with_context(sc.clone())]
    } else {
        Vec::new()
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Status::internal(format!("worker task failed: {e}")))
}

#[tonic::async_trait]
impl DeviceWorker for WorkerService {
    async fn load(&self, request: Request<LoadRequest>) -> Result<Response<LoadResponse>, Status> {
        let spec = request
            .into_inner()
            .model
            .ok_or_else(|| Status::invalid_argument("`model` is required"))?;
        let tool = required_tool(&spec.tool)?.to_owned();
        let spec = wire::spec(spec).map_err(load_status)?;
        if self.store.contains(&tool) {
            let bytes = self
                .store
                .models()
                .into_iter()
                .find(|m| m.tool == tool)
                .map_or(0, |m| m.bytes);
            return Ok(Response::new(LoadResponse {
                bytes,
                loaded: false,
            }));
        }
        let span = self.device_span("nomad.device.load", &tool);
        let started = Instant::now();
        let loaded = open::open(spec, self.backend.clone(), &self.python).await;
        let model = loaded.map_err(|e| {
            span.set_error("load_failed", e.to_string());
            load_status(e)
        })?;
        let (bytes, inserted) = self.store.insert(&tool, model);
        span.set_attribute(KeyValue::new("nomad.model.bytes", bytes as i64));
        tracing::info!(%tool, bytes, elapsed = ?started.elapsed(), "model loaded");
        Ok(Response::new(LoadResponse {
            bytes,
            loaded: inserted,
        }))
    }

    async fn place(
        &self,
        request: Request<PlaceRequest>,
    ) -> Result<Response<PlaceResponse>, Status> {
        let tool = required_tool(&request.get_ref().tool)?;
        self.move_model(
            tool,
            ("nomad.device.place", "place_failed"),
            ModelStore::place,
        )
        .await?;
        Ok(Response::new(PlaceResponse {}))
    }

    async fn offload(
        &self,
        request: Request<OffloadRequest>,
    ) -> Result<Response<OffloadResponse>, Status> {
        let tool = required_tool(&request.get_ref().tool)?;
        self.move_model(
            tool,
            ("nomad.device.offload", "offload_failed"),
            ModelStore::offload,
        )
        .await?;
        Ok(Response::new(OffloadResponse {}))
    }

    async fn unload(
        &self,
        request: Request<UnloadRequest>,
    ) -> Result<Response<UnloadResponse>, Status> {
        let tool = required_tool(&request.get_ref().tool)?;
        let _span = self.device_span("nomad.device.unload", tool);
        self.store.unload(tool);
        Ok(Response::new(UnloadResponse {}))
    }

    async fn execute_batch(
        &self,
        request: Request<ExecuteBatchRequest>,
    ) -> Result<Response<ExecuteBatchResponse>, Status> {
        let ExecuteBatchRequest {
            tool,
            inputs,
            traces,
        } = request.into_inner();
        required_tool(&tool)?;
        if inputs.is_empty() {
            return Err(Status::invalid_argument("a batch needs at least one input"));
        }
        if !traces.is_empty() && traces.len() != inputs.len() {
            return Err(Status::invalid_argument(format!(
                "{} trace carriers for {} inputs: give one per input or none",
                traces.len(),
                inputs.len()
            )));
        }
        let model = self.store.placed(&tool).map_err(store_status)?;
        // Each request's share of the batch, in that request's own trace.
        let shares: Vec<GroupSpan> = traces
            .iter()
            .map(|carrier| {
                let parent = nomad_telemetry::propagation::extract_map(&carrier.fields);
                let span = GroupSpan::start_with(
                    SpanGroup::Batch,
                    "nomad.device.execute",
                    &parent,
                    SpanOptions {
                        links: batch_link(),
                        ..Default::default()
                    },
                );
                span.set_attributes([
                    KeyValue::new("tool", tool.clone()),
                    KeyValue::new("device", self.device_name.clone()),
                    KeyValue::new("nomad.tool.batch.size", inputs.len() as i64),
                ]);
                span
            })
            .collect();
        let inputs: Vec<Input> = inputs.into_iter().map(wire::input).collect();
        let limits = self.limits;
        // A model in another process joins the first request's trace (its host sees the W3C
        // context of the current span).
        let joined = shares.first().map(|s| s.context().clone());
        let executed = if let Some(streaming) = model.streaming() {
            generate::run_batch(streaming, &inputs, &limits).await
        } else if let Some(hosted) = model.hosted() {
            let joined = joined.unwrap_or_else(Context::current);
            hosted.execute_hosted(&inputs).with_context(joined).await
        } else {
            blocking(move || {
                let _joined = joined.map(Context::attach);
                model.execute(&inputs, &limits)
            })
            .await?
        };
        let outcome = match wire::outcome(executed) {
            Ok(outcome) => outcome,
            Err(message) => {
                for span in &shares {
                    span.set_error("execution_failed", message.clone());
                }
                return Err(Status::internal(format!("{tool}: {message}")));
            }
        };
        if let execute_batch_response::Outcome::OutOfMemory(oom) = &outcome {
            for span in &shares {
                span.set_error("out_of_memory", oom.detail.clone());
            }
        }
        Ok(Response::new(ExecuteBatchResponse {
            outcome: Some(outcome),
        }))
    }

    type ExecuteStreamStream = crate::streaming::EventStream;

    async fn execute_stream(
        &self,
        request: Request<ExecuteBatchRequest>,
    ) -> Result<Response<Self::ExecuteStreamStream>, Status> {
        let ExecuteBatchRequest {
            tool,
            mut inputs,
            traces,
        } = request.into_inner();
        required_tool(&tool)?;
        if inputs.len() != 1 || traces.len() > 1 {
            return Err(Status::invalid_argument(format!(
                "a stream runs one input (with at most one trace carrier); got {} inputs and {} \
                 carriers",
                inputs.len(),
                traces.len()
            )));
        }
        let model = self.store.placed(&tool).map_err(store_status)?;
        let Some(streaming) = model.streaming() else {
            return Err(Status::failed_precondition(format!(
                "{tool} does not stream: only generation tools do; call ExecuteBatch"
            )));
        };
        let parent = traces
            .first()
            .map(|c| nomad_telemetry::propagation::extract_map(&c.fields))
            .unwrap_or_else(Context::current);
        let span = GroupSpan::start_with(
            SpanGroup::Batch,
            "nomad.device.execute",
            &parent,
            SpanOptions::default(),
        );
        span.set_attributes([
            KeyValue::new("tool", tool.clone()),
            KeyValue::new("device", self.device_name.clone()),
            KeyValue::new("nomad.tool.streamed", true),
        ]);
        let input = wire::input(inputs.remove(0));
        let stream = crate::streaming::run_stream(streaming, &input, &self.limits, move |error| {
            if let Some(e) = error {
                span.set_error("execution_failed", e.to_owned());
            }
        });
        Ok(Response::new(stream))
    }

    async fn clear_cache(
        &self,
        _request: Request<ClearCacheRequest>,
    ) -> Result<Response<ClearCacheResponse>, Status> {
        let _span = self.device_span("nomad.device.cache_clear", "");
        // Candle keeps no allocator cache, a model host's torch does; the simulated device
        // releases its reserve.
        let released_bytes = match self.backend.as_ref() {
            Backend::Sim(device) => {
                Some(device.clear_cache(crate::stats::placed_bytes(&self.store)))
            }
            Backend::Candle => {
                let store = self.store.clone();
                blocking(move || store.clear_caches()).await?
            }
        };
        Ok(Response::new(ClearCacheResponse { released_bytes }))
    }

    async fn stats(
        &self,
        _request: Request<StatsRequest>,
    ) -> Result<Response<WorkerStats>, Status> {
        Ok(Response::new(crate::stats::collect(
            &self.store,
            &self.backend,
            self.on_accelerator,
        )))
    }

    async fn describe(
        &self,
        request: Request<DescribeRequest>,
    ) -> Result<Response<ToolDescription>, Status> {
        let spec = request
            .into_inner()
            .model
            .ok_or_else(|| Status::invalid_argument("`model` is required"))?;
        required_tool(&spec.tool)?;
        let span = self.device_span("nomad.device.describe", &spec.tool);
        let described = match wire::spec(spec) {
            Ok(spec) => open::describe(&spec, &self.backend, &self.python).await,
            Err(e) => Err(e),
        };
        let described = described.map_err(|e| {
            span.set_error("describe_failed", e.to_string());
            load_status(e)
        })?;
        Ok(Response::new(wire::description(described)))
    }
}
