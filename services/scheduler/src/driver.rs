//! Runs the core: one task owns it and a bounded command channel; it carries the core's actions
//! out over gRPC (in spawned tasks that report back on the same channel), keeps the callers'
//! reply channels, records the model-serving metrics and spans, and publishes a snapshot for the
//! observable gauges.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nomad_proto::v1::{
    ClearCacheRequest, ExecuteBatchRequest, LoadRequest, ModelSpec, OffloadRequest, PlaceRequest,
    ToolInput, ToolOutput, TraceCarrier, UnloadRequest, execute_batch_response, item_result,
};
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions, propagation};
use opentelemetry::trace::{FutureExt as _, Link, SpanKind, TraceContextExt as _};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::config::ToolConfig;
use crate::core::{
    Action, BatchId, BatchResult, Core, LoadKind, Outcome, Rejection, RequestId, SlotId, Snapshot,
    Timing, ToolId, ToolSpec,
};
use crate::metrics::{Metrics, device_attributes};
use crate::workers::{Worker, WorkerRegistry};

/// Capacity of the command channel: callers wait (backpressure) when it is full.
const CHANNEL_CAPACITY: usize = 8192;
/// How often abandoned requests are swept and the gauges' snapshot refreshed.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// A request's answer.
#[derive(Debug)]
pub struct Served {
    pub output: ToolOutput,
    pub worker_id: String,
    pub queue_wait: Duration,
    pub batch_size: u32,
}

enum Command {
    Submit {
        key: u64,
        tool: String,
        input: ToolInput,
        cx: Context,
        reply: oneshot::Sender<Result<Served, Status>>,
    },
    Cancel {
        key: u64,
    },
    WorkerUp(Worker),
    WorkerDown {
        slot: SlotId,
        reason: String,
    },
    Prepared {
        slot: SlotId,
        tool: ToolId,
        result: Result<(), String>,
        lost: Option<String>,
    },
    BatchDone {
        batch: BatchId,
        result: BatchResult,
        outputs: Vec<Option<ToolOutput>>,
        lost: Option<String>,
    },
    SlotFreed {
        slot: SlotId,
        lost: Option<String>,
    },
    Close,
}

/// The gRPC side's handle on the driver.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
    next_key: Arc<AtomicU64>,
}

/// Sends `Cancel` if the caller goes away before its answer arrives.
struct CancelOnDrop {
    tx: mpsc::Sender<Command>,
    key: u64,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // A full channel is fine: the periodic sweep finds the closed reply channel.
            let _ = self.tx.try_send(Command::Cancel { key: self.key });
        }
    }
}

fn stopped() -> Status {
    Status::unavailable("the scheduler is shutting down")
}

impl Handle {
    /// Runs one request on `tool`; the caller's context is current.
    pub async fn call(&self, tool: &str, input: ToolInput) -> Result<Served, Status> {
        let span = GroupSpan::start(SpanGroup::Tool, "nomad.tool.request", &Context::current());
        span.set_attribute(KeyValue::new("tool", tool.to_owned()));
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                key,
                tool: tool.to_owned(),
                input,
                cx: span.context().clone(),
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        let mut guard = CancelOnDrop {
            tx: self.tx.clone(),
            key,
            armed: true,
        };
        let result = answer.await.unwrap_or_else(|_| Err(stopped()));
        guard.armed = false;
        match &result {
            Ok(served) => {
                span.set_attribute(KeyValue::new(
                    "nomad.tool.queue_wait_seconds",
                    served.queue_wait.as_secs_f64(),
                ));
                span.set_ok();
            }
            Err(status) => span.set_error(format!("{:?}", status.code()), status.message()),
        }
        result
    }

    pub async fn worker_up(&self, worker: Worker) {
        let _ = self.tx.send(Command::WorkerUp(worker)).await;
    }

    pub async fn worker_down(&self, slot: SlotId, reason: String) {
        let _ = self.tx.send(Command::WorkerDown { slot, reason }).await;
    }

    /// Stop accepting requests; accepted ones still finish.
    pub async fn close(&self) {
        let _ = self.tx.send(Command::Close).await;
    }
}

/// What the gauges read: the core's snapshot and each slot's device.
#[derive(Default)]
pub struct Published {
    pub core: Snapshot,
    pub devices: HashMap<SlotId, Vec<KeyValue>>,
}

struct Pending {
    key: u64,
    tool: ToolId,
    input: ToolInput,
    /// The request span's context (or the caller's, when the `tool` group is off).
    cx: Context,
    reply: oneshot::Sender<Result<Served, Status>>,
    submitted: Instant,
    queue_wait: Duration,
    /// This request's share of its current batch, in its own trace.
    share: Option<GroupSpan>,
    worker_id: String,
    batch_size: u32,
    /// The worker's answer, held until the core completes the request. Kept here rather than
    /// in a map of its own so that a request cancelled while its batch runs cannot leave an
    /// output behind.
    output: Option<ToolOutput>,
}

struct BatchInfo {
    requests: Vec<RequestId>,
    slot: SlotId,
}

pub struct Driver {
    core: Core,
    tools: Vec<ToolConfig>,
    rx: mpsc::Receiver<Command>,
    tx: mpsc::Sender<Command>,
    registry: Arc<WorkerRegistry>,
    workers: HashMap<SlotId, Worker>,
    pending: HashMap<RequestId, Pending>,
    keys: HashMap<u64, RequestId>,
    batches: HashMap<BatchId, BatchInfo>,
    metrics: Arc<Metrics>,
    published: Arc<Mutex<Published>>,
}

fn rejection_status(rejection: Rejection, tool: &str, known: &[ToolConfig]) -> Status {
    match rejection {
        Rejection::ManagerClosed => stopped(),
        Rejection::UnknownTool => {
            let names: Vec<&str> = known.iter().map(|t| t.name.as_str()).collect();
            Status::not_found(format!(
                "unknown tool {tool:?}; this scheduler serves: {}",
                names.join(", ")
            ))
        }
        Rejection::QueueFull => {
            let limit = known
                .iter()
                .find(|t| t.name == tool)
                .map_or(0, |t| t.max_pending);
            Status::resource_exhausted(format!(
                "tool {tool:?} already has {limit} requests queued (its max_pending); retry later"
            ))
        }
    }
}

/// A worker RPC failure that means the worker is gone (as opposed to an answer it gave).
fn lost(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

impl Driver {
    /// Creates the driver and its handle; run it with [`Driver::run`].
    pub fn new(
        tools: Vec<ToolConfig>,
        timing: Timing,
        registry: Arc<WorkerRegistry>,
        metrics: Arc<Metrics>,
        published: Arc<Mutex<Published>>,
    ) -> (Self, Handle) {
        let specs = tools
            .iter()
            .map(|t| ToolSpec {
                name: t.name.clone(),
                batch_size: t.batch_size,
                max_devices: t.max_devices,
                max_pending: t.max_pending,
            })
            .collect();
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let driver = Driver {
            core: Core::new(specs, timing, Instant::now()),
            tools,
            rx,
            tx: tx.clone(),
            registry,
            workers: HashMap::new(),
            pending: HashMap::new(),
            keys: HashMap::new(),
            batches: HashMap::new(),
            metrics,
            published,
        };
        let handle = Handle {
            tx,
            next_key: Arc::new(AtomicU64::new(0)),
        };
        (driver, handle)
    }

    /// Runs until closed and every accepted request has been answered.
    pub async fn run(mut self) {
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.core.is_closed() && self.core.open_requests() == 0 {
                break;
            }
            let deadline = self.core.next_deadline();
            tokio::select! {
                command = self.rx.recv() => match command {
                    Some(command) => self.handle(command),
                    None => break,
                },
                _ = sleep_until(deadline), if deadline.is_some() => {
                    self.core.tick(Instant::now());
                }
                _ = sweep.tick() => {
                    self.sweep();
                    self.publish();
                }
            }
            self.execute();
            // Everything the driver holds for a request lives in `pending`, so this is what
            // keeps a long-running scheduler's memory flat.
            debug_assert_eq!(self.pending.len(), self.core.open_requests());
            debug_assert_eq!(self.keys.len(), self.pending.len());
        }
        self.publish();
    }

    fn handle(&mut self, command: Command) {
        let now = Instant::now();
        match command {
            Command::Submit {
                key,
                tool,
                input,
                cx,
                reply,
            } => match self.core.submit(&tool, now) {
                Ok(request) => {
                    let tool_id = self.core.tool_id(&tool).expect("accepted tools exist");
                    self.metrics
                        .requests
                        .add(1, &[KeyValue::new("tool", tool.clone())]);
                    self.keys.insert(key, request);
                    self.pending.insert(
                        request,
                        Pending {
                            key,
                            tool: tool_id,
                            input,
                            cx,
                            reply,
                            submitted: now,
                            queue_wait: Duration::ZERO,
                            share: None,
                            worker_id: String::new(),
                            batch_size: 0,
                            output: None,
                        },
                    );
                }
                Err(rejection) => {
                    self.metrics.request_rejections.add(
                        1,
                        &[
                            KeyValue::new("tool", tool.clone()),
                            KeyValue::new("reason", rejection.reason()),
                        ],
                    );
                    let _ = reply.send(Err(rejection_status(rejection, &tool, &self.tools)));
                }
            },
            Command::Cancel { key } => {
                if let Some(request) = self.keys.get(&key).copied() {
                    self.core.cancel(request, now);
                }
            }
            Command::WorkerUp(worker) => {
                let slot = worker.generation;
                self.workers.insert(slot, worker);
                self.core.worker_registered(slot, now);
            }
            Command::WorkerDown { slot, reason } => self.worker_lost(slot, &reason, now),
            Command::Prepared {
                slot,
                tool,
                result,
                lost,
            } => match lost {
                Some(reason) => self.worker_lost(slot, &reason, now),
                None => self.core.prepare_finished(slot, tool, result, now),
            },
            Command::BatchDone {
                batch,
                result,
                outputs,
                lost,
            } => {
                let Some(info) = self.batches.remove(&batch) else {
                    return;
                };
                if let Some(reason) = lost {
                    for request in &info.requests {
                        if let Some(p) = self.pending.get_mut(request)
                            && let Some(share) = p.share.take()
                        {
                            share.set_error("worker_lost", reason.clone());
                        }
                    }
                    self.worker_lost(info.slot, &reason, now);
                    return;
                }
                for (request, output) in info.requests.iter().zip(outputs) {
                    // A request cancelled while its batch ran is already answered.
                    if let Some(p) = self.pending.get_mut(request) {
                        p.output = output;
                    }
                }
                if let BatchResult::OutOfMemory(detail) = &result {
                    for request in &info.requests {
                        if let Some(p) = self.pending.get_mut(request)
                            && let Some(share) = p.share.take()
                        {
                            share.set_error("out_of_memory", detail.clone());
                        }
                    }
                }
                self.core.batch_finished(batch, result, now);
            }
            Command::SlotFreed { slot, lost } => match lost {
                Some(reason) => self.worker_lost(slot, &reason, now),
                None => self.core.slot_freed(slot, now),
            },
            Command::Close => self.core.close(),
        }
    }

    fn worker_lost(&mut self, slot: SlotId, reason: &str, now: Instant) {
        if let Some(worker) = self.workers.remove(&slot) {
            tracing::warn!(worker_id = %worker.id, %reason, "worker lost");
            self.registry.forget(&worker.id, worker.generation);
        }
        self.core.worker_lost(slot, reason, now);
    }

    /// Cancels requests whose callers went away without a `Cancel` getting through.
    fn sweep(&mut self) {
        let now = Instant::now();
        let abandoned: Vec<RequestId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.reply.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for request in abandoned {
            self.core.cancel(request, now);
        }
    }

    fn publish(&self) {
        let devices = self
            .workers
            .iter()
            .map(|(slot, w)| (*slot, slot_attributes(w)))
            .collect();
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        *published = Published {
            core: self.core.snapshot(),
            devices,
        };
    }

    fn execute(&mut self) {
        // Carrying out an action can feed the core an event (a dispatch to a vanished worker),
        // whose actions are carried out in the same pass.
        loop {
            let actions = self.core.take_actions();
            if actions.is_empty() {
                return;
            }
            self.carry_out(actions);
        }
    }

    fn carry_out(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Complete { request, outcome } => self.complete(request, outcome),
                Action::Dispatch {
                    batch,
                    slot,
                    tool,
                    requests,
                } => self.dispatch(batch, slot, tool, requests),
                Action::Prepare {
                    slot,
                    tool,
                    offload,
                    load,
                } => self.prepare(slot, tool, offload, load),
                Action::Evict { slot, tool } => self.maintain(slot, Maintenance::Evict(tool)),
                Action::Unload { slot, tool } => self.maintain(slot, Maintenance::Unload(tool)),
                Action::ClearCache { slot } => self.maintain(slot, Maintenance::ClearCache),
                Action::OomReduced { tool, old, new } => {
                    tracing::warn!(tool = %self.tools[tool].name, old, new, "out of memory: batch size halved");
                    self.metrics.batch_oom_reductions.add(
                        1,
                        &[
                            KeyValue::new("tool", self.tools[tool].name.clone()),
                            KeyValue::new("old_batch_size", i64::from(old)),
                            KeyValue::new("new_batch_size", i64::from(new)),
                        ],
                    );
                }
            }
        }
    }

    fn complete(&mut self, request: RequestId, outcome: Outcome) {
        let Some(p) = self.pending.remove(&request) else {
            return;
        };
        self.keys.remove(&p.key);
        let tool = &self.tools[p.tool].name;
        let status = match &outcome {
            Outcome::Ok => "ok",
            Outcome::Cancelled => "cancelled",
            _ => "error",
        };
        let tool_attr = [KeyValue::new("tool", tool.clone())];
        match status {
            "error" => self.metrics.request_errors.add(1, &tool_attr),
            "cancelled" => self.metrics.request_cancellations.add(1, &tool_attr),
            _ => {}
        }
        self.metrics.request_duration.record(
            p.submitted.elapsed().as_secs_f64(),
            &[tool_attr[0].clone(), KeyValue::new("status", status)],
        );
        let result = match (outcome, p.output) {
            (Outcome::Ok, Some(output)) => Ok(Served {
                output,
                worker_id: p.worker_id,
                queue_wait: p.queue_wait,
                batch_size: p.batch_size,
            }),
            (Outcome::Ok, None) => Err(Status::internal(format!(
                "{tool}: the worker reported success without an output"
            ))),
            (Outcome::InvalidInput(m), _) => Err(Status::invalid_argument(format!("{tool}: {m}"))),
            (Outcome::OutOfMemory(m), _) => Err(Status::resource_exhausted(format!(
                "{tool}: out of memory even with a batch of one: {m}"
            ))),
            (Outcome::Failed(m), _) => Err(Status::internal(format!("{tool}: {m}"))),
            (Outcome::Unavailable(m), _) => Err(Status::unavailable(format!("{tool}: {m}"))),
            (Outcome::Cancelled, _) => Err(Status::cancelled("the request was cancelled")),
        };
        if let Some(share) = p.share {
            match &result {
                Ok(_) => share.set_ok(),
                Err(s) => share.set_error(format!("{:?}", s.code()), s.message()),
            }
        }
        let _ = p.reply.send(result);
    }

    fn dispatch(&mut self, batch: BatchId, slot: SlotId, tool: ToolId, requests: Vec<RequestId>) {
        let Some(worker) = self.workers.get(&slot).cloned() else {
            // The core only dispatches to slots it knows, and they are added with the worker.
            self.core.batch_finished(
                batch,
                BatchResult::Failed("no worker for the slot".into()),
                Instant::now(),
            );
            return;
        };
        let now = Instant::now();
        let name = self.tools[tool].name.clone();
        let size = requests.len() as u32;
        let mut attributes = device_attributes(&name, &worker);

        // The batch span starts its own trace, linked to every request it serves.
        let links: Vec<Link> = requests
            .iter()
            .filter_map(|r| self.pending.get(r))
            .map(|p| p.cx.span().span_context().clone())
            .filter(|sc| sc.is_valid())
            .map(Link::with_context)
            .collect();
        let batch_span = GroupSpan::start_with(
            SpanGroup::Batch,
            "nomad.tool.batch",
            &Context::new(),
            SpanOptions {
                kind: Some(SpanKind::Internal),
                attributes: attributes
                    .iter()
                    .cloned()
                    .chain([KeyValue::new("nomad.tool.batch.size", i64::from(size))])
                    .collect(),
                links,
                new_root: true,
            },
        );
        let batch_link: Vec<Link> = {
            let sc = batch_span.context().span().span_context().clone();
            if sc.is_valid() {
                vec![Link::with_context(sc)]
            } else {
                vec![]
            }
        };

        let mut inputs = Vec::with_capacity(requests.len());
        let mut traces = Vec::with_capacity(requests.len());
        for request in &requests {
            let Some(p) = self.pending.get_mut(request) else {
                continue;
            };
            p.queue_wait = now.duration_since(p.submitted);
            p.worker_id = worker.id.clone();
            p.batch_size = size;
            self.metrics.request_queue_wait.record(
                p.queue_wait.as_secs_f64(),
                &[KeyValue::new("tool", name.clone())],
            );
            let share = GroupSpan::start_with(
                SpanGroup::Batch,
                "nomad.tool.execute",
                &p.cx,
                SpanOptions {
                    attributes: vec![
                        KeyValue::new("tool", name.clone()),
                        KeyValue::new("nomad.tool.batch.size", i64::from(size)),
                        KeyValue::new("nomad.tool.queue_wait_seconds", p.queue_wait.as_secs_f64()),
                    ],
                    links: batch_link.clone(),
                    ..Default::default()
                },
            );
            traces.push(TraceCarrier {
                fields: propagation::inject_map(share.context()),
            });
            p.share = Some(share);
            inputs.push(p.input.clone());
        }
        // With telemetry off there is no context to carry: send none rather than empty maps.
        if traces.iter().all(|t| t.fields.is_empty()) {
            traces.clear();
        }
        self.batches.insert(batch, BatchInfo { requests, slot });

        let tx = self.tx.clone();
        let metrics = self.metrics.clone();
        let mut client = worker.client.clone();
        let request = ExecuteBatchRequest {
            tool: name.clone(),
            inputs,
            traces,
        };
        let expected = size as usize;
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = client
                .execute_batch(request)
                .with_context(batch_span.context().clone())
                .await;
            let (result, outputs, lost_reason) = match reply {
                Ok(reply) => match reply.into_inner().outcome {
                    Some(execute_batch_response::Outcome::Results(results)) => {
                        let mut outputs = Vec::with_capacity(expected);
                        let mut items = Vec::with_capacity(expected);
                        for item in results.items {
                            match item.result {
                                Some(item_result::Result::Output(o)) => {
                                    outputs.push(Some(o));
                                    items.push(None);
                                }
                                Some(item_result::Result::InvalidInput(m)) => {
                                    outputs.push(None);
                                    items.push(Some(m));
                                }
                                None => {
                                    outputs.push(None);
                                    items.push(Some("the worker returned an empty result".into()));
                                }
                            }
                        }
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
                Err(status) if lost(&status) => (
                    BatchResult::Failed(status.message().to_owned()),
                    vec![],
                    Some(format!(
                        "worker {} unreachable during a batch: {}",
                        worker.id,
                        status.message()
                    )),
                ),
                Err(status) => (
                    BatchResult::Failed(format!("{:?}: {}", status.code(), status.message())),
                    vec![],
                    None,
                ),
            };
            let status = match (&result, &lost_reason) {
                (BatchResult::Done(_), None) => "ok",
                _ => "error",
            };
            match (&result, &lost_reason) {
                (_, Some(reason)) => batch_span.set_error("worker_lost", reason.clone()),
                (BatchResult::OutOfMemory(d), _) => {
                    batch_span.set_error("out_of_memory", d.clone())
                }
                (BatchResult::Failed(m), _) => batch_span.set_error("execution_failed", m.clone()),
                (BatchResult::Done(_), _) => batch_span.set_ok(),
            }
            attributes.push(KeyValue::new("status", status));
            metrics
                .batch_duration
                .record(started.elapsed().as_secs_f64(), &attributes);
            metrics.batch_size.record(u64::from(size), &attributes);
            drop(batch_span);
            let _ = tx
                .send(Command::BatchDone {
                    batch,
                    result,
                    outputs,
                    lost: lost_reason,
                })
                .await;
        });
    }

    fn prepare(
        &mut self,
        slot: SlotId,
        tool: ToolId,
        offload: Option<ToolId>,
        load: Option<LoadKind>,
    ) {
        let Some(worker) = self.workers.get(&slot).cloned() else {
            return;
        };
        let config = self.tools[tool].clone();
        let offload = offload.map(|t| self.tools[t].name.clone());
        let tx = self.tx.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let span = GroupSpan::start_with(
                SpanGroup::Device,
                "nomad.tool.prepare",
                &Context::new(),
                SpanOptions {
                    attributes: {
                        let mut a = device_attributes(&config.name, &worker);
                        if let Some(o) = &offload {
                            a.push(KeyValue::new("nomad.tool.offload", o.clone()));
                        }
                        if let Some(kind) = load {
                            a.push(KeyValue::new("load.kind", kind.as_str()));
                        }
                        a
                    },
                    ..Default::default()
                },
            );
            let outcome = prepare_on_worker(&worker, &config, offload, load, &metrics)
                .with_context(span.context().clone())
                .await;
            let (result, lost_reason) = match outcome {
                Ok(()) => (Ok(()), None),
                Err(status) if lost(&status) => (
                    Err(status.message().to_owned()),
                    Some(format!(
                        "worker {} unreachable: {}",
                        worker.id,
                        status.message()
                    )),
                ),
                Err(status) => (Err(status.message().to_owned()), None),
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
        });
    }

    fn maintain(&mut self, slot: SlotId, what: Maintenance) {
        let Some(worker) = self.workers.get(&slot).cloned() else {
            return;
        };
        let tool = match what {
            Maintenance::Evict(t) | Maintenance::Unload(t) => Some(self.tools[t].name.clone()),
            Maintenance::ClearCache => None,
        };
        let tx = self.tx.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let name = match what {
                Maintenance::Evict(_) => "nomad.tool.evict",
                Maintenance::Unload(_) => "nomad.tool.unload",
                Maintenance::ClearCache => "nomad.device.cache_clear",
            };
            let attributes = match &tool {
                Some(t) => device_attributes(t, &worker),
                None => slot_attributes(&worker),
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
            let started = Instant::now();
            let cx = span.context().clone();
            let result = match (&what, &tool) {
                (Maintenance::Evict(_), Some(t)) => {
                    metrics.device_idle_evictions.add(1, &attributes);
                    metrics.device_offloads.add(1, &attributes);
                    client
                        .offload(OffloadRequest { tool: t.clone() })
                        .with_context(cx)
                        .await
                        .map(|_| ())
                }
                (Maintenance::Unload(_), Some(t)) => {
                    metrics
                        .disk_unloads
                        .add(1, &[KeyValue::new("tool", t.clone())]);
                    client
                        .unload(UnloadRequest { tool: t.clone() })
                        .with_context(cx)
                        .await
                        .map(|_| ())
                }
                _ => {
                    metrics.cache_clears.add(1, &attributes);
                    let r = client
                        .clear_cache(ClearCacheRequest {})
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
                Err(status) if lost(status) => Some(format!(
                    "worker {} unreachable: {}",
                    worker.id,
                    status.message()
                )),
                Err(status) => {
                    span.set_error(format!("{:?}", status.code()), status.message());
                    tracing::warn!(worker_id = %worker.id, "{name} failed: {}", status.message());
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
        });
    }
}

#[derive(Clone, Copy)]
enum Maintenance {
    Evict(ToolId),
    Unload(ToolId),
    ClearCache,
}

/// `device`, `device.type`, `device.index` and the worker's id.
pub fn slot_attributes(worker: &Worker) -> Vec<KeyValue> {
    let mut attributes = device_attributes("", worker);
    attributes.remove(0); // no tool
    attributes
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
            .add(1, &device_attributes(&other, worker));
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
                model: Some(ModelSpec {
                    tool: config.name.clone(),
                    kind: config.kind.clone(),
                    source: config.source.clone(),
                }),
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
        &device_attributes(&config.name, worker),
    );
    Ok(())
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        // A deadline already due still yields once, so a stuck timer cannot starve the loop.
        Some(d) => {
            tokio::time::sleep_until(
                tokio::time::Instant::from_std(d)
                    .max(tokio::time::Instant::now() + Duration::from_micros(50)),
            )
            .await
        }
        None => std::future::pending().await,
    }
}
