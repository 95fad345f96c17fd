//! The driver's calls to workers, each in its own task, reporting back on the driver's channel:
//! execute a batch, prepare a slot (offload, load, place), and maintenance (evict, unload,
//! clear the cache). Spans and metrics of each call are recorded here.

use std::sync::Arc;
use std::time::Instant;

use nomad_proto::v1::{
    ClearCacheRequest, ExecuteBatchRequest, ExecuteBatchResponse, ItemResult, LoadRequest,
    OffloadRequest, PlaceRequest, UnloadRequest, execute_batch_response, item_result,
};
use nomad_scheduler_core::{BatchId, BatchResult, ItemFailure, LoadKind, SlotId, ToolId};
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions};
use opentelemetry::trace::FutureExt as _;
use tokio::sync::mpsc;
use tonic::Status;

use super::handle::{Answer, Command};

/// Where a call reports (its metrics, and the driver's channel), and its deadlines.
#[derive(Clone)]
pub(super) struct Reporting {
    pub metrics: Arc<Metrics>,
    pub tx: mpsc::Sender<Command>,
    pub deadlines: Deadlines,
}

use super::status::WorkerError;
use crate::config::{Deadlines, ToolConfig};
use crate::metrics::Metrics;
use crate::workers::Worker;

/// `call`, bounded by `deadline`, its failure in the driver's terms: a worker that misses the
/// deadline is as good as gone.
async fn within<T>(
    deadline: std::time::Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, WorkerError> {
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result.map_err(WorkerError::from),
        Err(_) => Err(WorkerError::Lost(format!(
            "no answer to {what} within {} s",
            deadline.as_secs_f64()
        ))),
    }
}

/// One batch to run on a worker, with what its report needs.
pub(super) struct Call {
    pub worker: Worker,
    pub batch: BatchId,
    pub request: ExecuteBatchRequest,
    /// The batch size its metrics and spans record (for a continuous tool, the requests
    /// running together on the worker).
    pub size: u32,
    pub deadline: std::time::Duration,
    pub batch_span: GroupSpan,
    pub attributes: Vec<KeyValue>,
}

/// Runs one batch inside its span and reports `BatchDone`.
pub(super) async fn execute_batch(mut call: Call, reporting: Reporting) {
    let started = Instant::now();
    let mut client = call.worker.client.clone();
    let request = std::mem::take(&mut call.request.inputs);
    let expected = request.len();
    let request = ExecuteBatchRequest {
        inputs: request,
        ..call.request.clone()
    };
    let reply = within(
        call.deadline,
        "a batch (execute_timeout_seconds)",
        client.execute_batch(request),
    )
    .with_context(call.batch_span.context().clone())
    .await
    .map(tonic::Response::into_inner);
    report(call, expected, started, reply, reporting).await;
}

/// Runs one generation as a stream, sending its text on `text` as it comes, and reports
/// `BatchDone` with its outcome as `execute_batch` would.
pub(super) async fn execute_stream(
    mut call: Call,
    text: mpsc::Sender<String>,
    reporting: Reporting,
) {
    use nomad_proto::v1::execute_stream_event::Event;
    let started = Instant::now();
    let mut client = call.worker.client.clone();
    let request = ExecuteBatchRequest {
        inputs: std::mem::take(&mut call.request.inputs),
        ..call.request.clone()
    };
    let streamed = async {
        let mut stream = client.execute_stream(request).await?.into_inner();
        loop {
            match stream.message().await? {
                Some(event) => match event.event {
                    // A caller that went away is cancelled through its request, not here.
                    Some(Event::Text(t)) => {
                        let _ = text.send(t).await;
                    }
                    Some(Event::Done(done)) => {
                        // Read on to the stream's end, so the call ends with the worker's
                        // status rather than as abandoned (and its span with it).
                        while let Ok(Some(_)) = stream.message().await {}
                        return Ok(done);
                    }
                    None => {}
                },
                None => {
                    return Err(Status::internal(
                        "the worker's stream ended without an outcome",
                    ));
                }
            }
        }
    };
    let reply = within(call.deadline, "a batch (execute_timeout_seconds)", streamed)
        .with_context(call.batch_span.context().clone())
        .await;
    report(call, 1, started, reply, reporting).await;
}

/// Records a batch's outcome (span, metrics) and reports `BatchDone`.
async fn report(
    call: Call,
    expected: usize,
    started: Instant,
    reply: Result<ExecuteBatchResponse, WorkerError>,
    reporting: Reporting,
) {
    let Reporting { metrics, tx, .. } = reporting;
    let Call {
        worker,
        batch,
        size,
        batch_span,
        mut attributes,
        ..
    } = call;
    let (result, outputs, lost_reason) = match reply {
        Ok(reply) => match reply.outcome {
            Some(execute_batch_response::Outcome::Results(results)) => {
                let (outputs, items) = split_items(results.items, expected);
                (BatchResult::Done(items), outputs, None)
            }
            Some(execute_batch_response::Outcome::OutOfMemory(oom)) => {
                (BatchResult::OutOfMemory(oom.detail), vec![], None)
            }
            None => (
                BatchResult::Failed("the worker returned an empty batch outcome".into()),
                vec![],
                None,
            ),
        },
        Err(WorkerError::Lost(message)) => (
            BatchResult::Failed(message.clone()),
            vec![],
            Some(format!(
                "worker {} unreachable during a batch: {message}",
                worker.id
            )),
        ),
        Err(failed) => (BatchResult::Failed(failed.to_string()), vec![], None),
    };
    let status = match (&result, &lost_reason) {
        (BatchResult::Done(_), None) => "ok",
        _ => "error",
    };
    match (&result, &lost_reason) {
        (_, Some(reason)) => batch_span.set_error("worker_lost", reason.clone()),
        (BatchResult::OutOfMemory(d), _) => batch_span.set_error("out_of_memory", d.clone()),
        (BatchResult::Failed(m), _) => batch_span.set_error("execution_failed", m.clone()),
        (BatchResult::Done(_), _) => batch_span.set_ok(),
    }
    attributes.push(KeyValue::new("status", status));
    metrics
        .batch_duration
        .record(started.elapsed().as_secs_f64(), &attributes);
    metrics.batch_size.record(size as u64, &attributes);
    if let Some(tool) = attributes.iter().find(|kv| kv.key.as_str() == "tool") {
        metrics.recent.batch(&tool.value.as_str(), size, started);
    }
    drop(batch_span);
    let _ = tx
        .send(Command::BatchDone {
            batch,
            result,
            outputs,
            lost: lost_reason,
        })
        .await;
}

/// Per item: the answer, or why the model did not give one.
fn split_items(
    items: Vec<ItemResult>,
    expected: usize,
) -> (Vec<Option<Answer>>, Vec<Option<ItemFailure>>) {
    let mut outputs = Vec::with_capacity(expected);
    let mut refusals = Vec::with_capacity(expected);
    for item in items {
        match item.result {
            Some(item_result::Result::Output(output)) => {
                outputs.push(Some(Answer {
                    output,
                    generation: item.generation,
                }));
                refusals.push(None);
            }
            Some(item_result::Result::InvalidInput(m)) => {
                outputs.push(None);
                refusals.push(Some(ItemFailure::InvalidInput(m)));
            }
            Some(item_result::Result::Error(m)) => {
                outputs.push(None);
                refusals.push(Some(ItemFailure::Failed(m)));
            }
            None => {
                outputs.push(None);
                refusals.push(Some(ItemFailure::Failed(
                    "the worker returned an empty result".into(),
                )));
            }
        }
    }
    (outputs, refusals)
}

/// Makes `config`'s tool runnable on `worker` and reports `Prepared`.
pub(super) async fn prepare(
    worker: Worker,
    slot: SlotId,
    tool: ToolId,
    config: ToolConfig,
    offload: Option<String>,
    load: Option<LoadKind>,
    Reporting {
        metrics,
        tx,
        deadlines,
    }: Reporting,
) {
    let mut attributes = worker.tool_attributes(&config.name);
    if let Some(o) = &offload {
        attributes.push(KeyValue::new("nomad.tool.offload", o.clone()));
    }
    if let Some(kind) = load {
        attributes.push(KeyValue::new("load.kind", kind.as_str()));
    }
    let span = GroupSpan::start_with(
        SpanGroup::Device,
        "nomad.tool.prepare",
        &Context::new(),
        SpanOptions {
            attributes,
            ..Default::default()
        },
    );
    let outcome = within(
        deadlines.prepare,
        "preparing a slot (prepare_timeout_seconds)",
        prepare_on_worker(&worker, &config, offload, load, &metrics),
    )
    .with_context(span.context().clone())
    .await;
    let (result, lost_reason) = match outcome {
        Ok(()) => (Ok(()), None),
        Err(WorkerError::Lost(message)) => (
            Err(message.clone()),
            Some(format!("worker {} unreachable: {message}", worker.id)),
        ),
        Err(failed) => (Err(failed.message().to_owned()), None),
    };
    if let Err(e) = &result {
        span.set_error("prepare_failed", e.clone());
        tracing::warn!(tool = %config.name, worker_id = %worker.id, "preparing failed: {e}");
    }
    drop(span);
    let _ = tx
        .send(Command::Prepared {
            slot,
            tool,
            result,
            lost: lost_reason,
        })
        .await;
}

/// Offload what the slot holds, load from disk when the worker lacks a host copy, place.
async fn prepare_on_worker(
    worker: &Worker,
    config: &ToolConfig,
    offload: Option<String>,
    load: Option<LoadKind>,
    metrics: &Metrics,
) -> Result<(), Status> {
    let mut client = worker.client.clone();
    if let Some(other) = offload {
        metrics
            .device_offloads
            .add(1, &worker.tool_attributes(&other));
        client.offload(OffloadRequest { tool: other }).await?;
    }
    if let Some(kind) = load {
        let attributes = [
            KeyValue::new("tool", config.name.clone()),
            KeyValue::new("load.kind", kind.as_str()),
        ];
        metrics.disk_loads.add(1, &attributes);
        let started = Instant::now();
        client
            .load(LoadRequest {
                model: Some(config.model_spec()),
            })
            .await?;
        metrics
            .disk_load_duration
            .record(started.elapsed().as_secs_f64(), &attributes);
    }
    let started = Instant::now();
    client
        .place(PlaceRequest {
            tool: config.name.clone(),
        })
        .await?;
    metrics.device_load_duration.record(
        started.elapsed().as_secs_f64(),
        &worker.tool_attributes(&config.name),
    );
    Ok(())
}

/// Maintenance on a slot.
#[derive(Clone, Debug)]
pub(super) enum Maintenance {
    /// Idle eviction of this tool's device allocation.
    Evict(String),
    /// Disk unload of this tool's host copy.
    Unload(String),
    ClearCache,
}

/// Carries out `what` on `worker` and reports `SlotFreed`.
pub(super) async fn maintain(
    worker: Worker,
    slot: SlotId,
    what: Maintenance,
    Reporting {
        metrics,
        tx,
        deadlines,
    }: Reporting,
) {
    let (name, attributes) = match &what {
        Maintenance::Evict(t) => ("nomad.tool.evict", worker.tool_attributes(t)),
        Maintenance::Unload(t) => ("nomad.tool.unload", worker.tool_attributes(t)),
        Maintenance::ClearCache => ("nomad.device.cache_clear", worker.device_attributes()),
    };
    let span = GroupSpan::start_with(
        SpanGroup::Device,
        name,
        &Context::new(),
        SpanOptions {
            attributes: attributes.clone(),
            ..Default::default()
        },
    );
    let mut client = worker.client.clone();
    let cx = span.context().clone();
    let deadline = deadlines.maintain;
    let step = "maintenance (maintain_timeout_seconds)";
    let result = match what {
        Maintenance::Evict(tool) => {
            metrics.device_idle_evictions.add(1, &attributes);
            metrics.device_offloads.add(1, &attributes);
            within(deadline, step, client.offload(OffloadRequest { tool }))
                .with_context(cx)
                .await
                .map(|_| ())
        }
        Maintenance::Unload(tool) => {
            metrics
                .disk_unloads
                .add(1, &[KeyValue::new("tool", tool.clone())]);
            within(deadline, step, client.unload(UnloadRequest { tool }))
                .with_context(cx)
                .await
                .map(|_| ())
        }
        Maintenance::ClearCache => {
            metrics.cache_clears.add(1, &attributes);
            let started = Instant::now();
            let r = within(deadline, step, client.clear_cache(ClearCacheRequest {}))
                .with_context(cx)
                .await
                .map(|_| ());
            metrics
                .cache_clear_duration
                .record(started.elapsed().as_secs_f64(), &attributes);
            r
        }
    };
    let lost_reason = match &result {
        Err(WorkerError::Lost(message)) => {
            Some(format!("worker {} unreachable: {message}", worker.id))
        }
        Err(WorkerError::Failed { code, message }) => {
            span.set_error(code.clone(), message.clone());
            tracing::warn!(worker_id = %worker.id, "{name} failed: {message}");
            None
        }
        Ok(()) => None,
    };
    drop(span);
    let _ = tx
        .send(Command::SlotFreed {
            slot,
            lost: lost_reason,
        })
        .await;
}
