//! Runs the core: one task owns it and a bounded command channel. It feeds the core events,
//! carries its actions out (worker calls in `calls`, each in a task that reports back on the
//! same channel), keeps what the core cannot hold (callers' reply channels, inputs, outputs and
//! spans), records the request metrics and publishes a snapshot for the observable gauges.
//!
//! - `handle`: the callers' side (commands, request ids, cancellation);
//! - `dispatch`: a batch the core formed, made into a worker call (its spans, its trace
//!   carriers);
//! - `calls`: the worker RPCs;
//! - `running`: starting the driver with its instruments, and finishing it;
//! - `status`: the core's rejections and outcomes as callers' errors, and a worker call's
//!   failure in the driver's terms.

mod calls;
mod dispatch;
mod handle;
mod recorder;
mod running;
mod status;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nomad_proto::v1::ToolInput;
use nomad_scheduler_core::{
    Action, BatchId, BatchResult, Core, Cost, LoadKind, Outcome, RequestId, SizeChange, SlotId,
    Timing, ToolId, ToolSpec,
};
use nomad_telemetry::{Context, GroupSpan, KeyValue};
use tokio::sync::{mpsc, oneshot};

use self::calls::Maintenance;
use self::handle::Command;
pub use self::handle::{Answer, Handle, Served};
pub use self::running::{Running, start};
use crate::config::{Deadlines, ToolConfig};
use crate::metrics::{Metrics, Published};
use crate::workers::{Worker, WorkerRegistry, lane_slot, worker_of};

/// Capacity of the command channel: callers wait (backpressure) when it is full.
const CHANNEL_CAPACITY: usize = 8192;
/// How often abandoned requests are swept and the gauges' snapshot refreshed.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// What the driver holds for an open request besides the core's record of it.
struct Pending {
    input: ToolInput,
    /// The request span's context (or the caller's, when the `tool` group is off).
    cx: Context,
    reply: oneshot::Sender<Result<Served, crate::error::CallError>>,
    /// Where a streamed generation's text goes.
    text: Option<mpsc::Sender<String>>,
    /// Set while a batch holds the request.
    execution: Option<Execution>,
    /// The worker's answer, held until the core completes the request. Kept here rather than
    /// in a map of its own so that a request cancelled while its batch runs cannot leave an
    /// output behind.
    output: Option<Answer>,
}

/// A request's part in its current batch.
struct Execution {
    batch: BatchId,
    /// Its share of the batch, in its own trace.
    share: GroupSpan,
    worker_id: String,
    queue_wait: Duration,
    batch_size: u32,
}

pub struct Driver {
    core: Core,
    tools: Vec<ToolConfig>,
    rx: mpsc::Receiver<Command>,
    tx: mpsc::Sender<Command>,
    registry: Arc<WorkerRegistry>,
    workers: HashMap<SlotId, Worker>,
    pending: HashMap<RequestId, Pending>,
    metrics: Arc<Metrics>,
    published: Arc<Mutex<Published>>,
    deadlines: Deadlines,
    /// Slots a CPU worker is given (see [`lane_slot`]).
    cpu_lanes: usize,
    /// The worker calls of continuous tools' requests, to stop one whose caller cancels (its
    /// place in the decode loop is freed at the next step).
    continuous_calls: HashMap<BatchId, tokio::task::AbortHandle>,
}

impl Driver {
    /// Creates the driver and its handle; run it with [`Driver::run`].
    pub fn new(
        tools: Vec<ToolConfig>,
        timing: Timing,
        deadlines: Deadlines,
        cpu_lanes: usize,
        registry: Arc<WorkerRegistry>,
        metrics: Arc<Metrics>,
        published: Arc<Mutex<Published>>,
    ) -> (Self, Handle) {
        let specs = tools
            .iter()
            .map(|t| ToolSpec {
                continuous: t.continuous,
                batch_size: if t.continuous {
                    t.max_running.unwrap_or(1)
                } else {
                    t.batch_size
                },
                max_batch_bytes: t.max_batch_bytes,
                max_batch_tokens: t.max_batch_tokens,
                group_by_size: nomad_proto::kinds::kind(&t.kind).is_some_and(|k| k.pads),
                oom_regrow_after: t.oom_regrow_after,
                ..ToolSpec::new(&t.name, t.batch_size, t.max_devices, t.max_pending)
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
            metrics,
            published,
            deadlines,
            cpu_lanes: cpu_lanes.max(1),
            continuous_calls: HashMap::new(),
        };
        let handle = Handle {
            tx,
            next_request: Arc::new(AtomicU64::new(0)),
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
        }
        self.publish();
    }

    fn handle(&mut self, command: Command) {
        let now = Instant::now();
        match command {
            Command::Submit {
                request,
                tool,
                input,
                cx,
                reply,
                text,
            } => match self.core.submit(request, &tool, cost_of(&input), now) {
                Ok(()) => {
                    self.metrics
                        .requests
                        .add(1, &[KeyValue::new("tool", tool.clone())]);
                    self.pending.insert(
                        request,
                        Pending {
                            input,
                            cx,
                            reply,
                            text,
                            execution: None,
                            output: None,
                        },
                    );
                }
                Err(rejection) => {
                    // A name no tool has is a caller's, not a label: it would let any caller
                    // grow the metric's attribute sets without bound.
                    let label = match rejection {
                        nomad_scheduler_core::Rejection::UnknownTool => "unknown".to_owned(),
                        _ => tool.clone(),
                    };
                    self.metrics.request_rejections.add(
                        1,
                        &[
                            KeyValue::new("tool", label),
                            KeyValue::new("reason", rejection.reason()),
                        ],
                    );
                    let _ = reply.send(Err(status::rejection(rejection, &tool, &self.tools)));
                }
            },
            Command::Cancel { request } => self.core.cancel(request, now),
            Command::WorkerUp(worker) => {
                let generation = worker.generation;
                let lanes = if worker.device.r#type == "cpu" {
                    self.cpu_lanes
                } else {
                    1
                };
                if lanes > 1 {
                    tracing::info!(worker_id = %worker.id, lanes, "a CPU worker: up to {lanes} tools at once");
                }
                for lane in 0..lanes as u64 {
                    let slot = lane_slot(generation, lane);
                    self.workers.insert(slot, worker.clone());
                    self.core.lane_registered(slot, generation, now);
                }
            }
            Command::SetBatchSize { tool, batch_size } => {
                if let Some(id) = self.core.tool_id(&tool) {
                    self.core.set_batch_size(id, batch_size);
                    self.tools[id].batch_size = batch_size;
                    tracing::info!(%tool, batch_size, "batch size from the model");
                }
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
            } => self.batch_done(batch, result, outputs, lost, now),
            Command::SlotFreed { slot, lost } => match lost {
                Some(reason) => self.worker_lost(slot, &reason, now),
                None => self.core.slot_freed(slot, now),
            },
            Command::Close => self.core.close(),
        }
    }

    fn batch_done(
        &mut self,
        batch: BatchId,
        result: BatchResult,
        outputs: Vec<Option<Answer>>,
        lost: Option<String>,
        now: Instant,
    ) {
        self.continuous_calls.remove(&batch);
        let Some(info) = self.core.batch(batch) else {
            return;
        };
        let (slot, requests) = (info.slot, info.requests.clone());
        let ended = |pending: &mut HashMap<RequestId, Pending>, kind: &str, detail: &str| {
            for request in &requests {
                if let Some(execution) = pending.get_mut(request).and_then(|p| p.execution.take()) {
                    execution
                        .share
                        .set_error(kind.to_owned(), detail.to_owned());
                }
            }
        };
        if let Some(reason) = lost {
            ended(&mut self.pending, "worker_lost", &reason);
            self.worker_lost(slot, &reason, now);
            return;
        }
        for (request, output) in requests.iter().zip(outputs) {
            // A request cancelled while its batch ran is already answered.
            if let Some(p) = self.pending.get_mut(request) {
                p.output = output;
            }
        }
        if let BatchResult::OutOfMemory(detail) = &result {
            ended(&mut self.pending, "out_of_memory", detail);
        }
        self.core.batch_finished(batch, result, now);
    }

    /// The worker of `slot` is gone, with every lane it had.
    fn worker_lost(&mut self, slot: SlotId, reason: &str, now: Instant) {
        let generation = worker_of(slot);
        if let Some(worker) = self.workers.get(&generation) {
            tracing::warn!(worker_id = %worker.id, %reason, "worker lost");
            self.registry.forget(&worker.id, worker.generation);
        }
        let mut lanes: Vec<SlotId> = self
            .workers
            .keys()
            .copied()
            .filter(|s| worker_of(*s) == generation)
            .collect();
        if lanes.is_empty() {
            lanes.push(slot);
        }
        for lane in lanes {
            self.workers.remove(&lane);
            self.core.worker_lost(lane, reason, now);
        }
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
            .map(|(slot, w)| (*slot, w.device_attributes()))
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
            for action in actions {
                self.carry_out(action);
            }
        }
    }

    fn carry_out(&mut self, action: Action) {
        match action {
            Action::Complete {
                request,
                tool,
                outcome,
                duration,
            } => self.complete(request, tool, outcome, duration),
            Action::Dispatch {
                batch,
                slot,
                tool,
                requests,
                queue_waits,
                running,
            } => self.dispatch(batch, slot, tool, &requests, &queue_waits, running),
            Action::Prepare {
                slot,
                tool,
                offload,
                load,
            } => self.prepare(slot, tool, offload, load),
            Action::Evict { slot, tool } => {
                self.maintain(slot, Maintenance::Evict(self.tools[tool].name.clone()))
            }
            Action::Unload { slot, tool } => {
                self.maintain(slot, Maintenance::Unload(self.tools[tool].name.clone()))
            }
            Action::ClearCache { slot } => self.maintain(slot, Maintenance::ClearCache),
            Action::BatchSizeChanged {
                tool,
                old,
                new,
                cause,
            } => {
                let name = &self.tools[tool].name;
                let attributes = [
                    KeyValue::new("tool", name.clone()),
                    KeyValue::new("old_batch_size", i64::from(old)),
                    KeyValue::new("new_batch_size", i64::from(new)),
                ];
                match cause {
                    SizeChange::OutOfMemory => {
                        tracing::warn!(tool = %name, old, new, "out of memory: batch size halved");
                        self.metrics.batch_oom_reductions.add(1, &attributes);
                    }
                    SizeChange::Regrown => {
                        tracing::info!(tool = %name, old, new, "batch size doubled back after good batches");
                        self.metrics.batch_regrowths.add(1, &attributes);
                    }
                }
            }
        }
    }

    fn complete(&mut self, request: RequestId, tool: ToolId, outcome: Outcome, duration: Duration) {
        let Some(p) = self.pending.remove(&request) else {
            return;
        };
        let tool = &self.tools[tool].name;
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
        self.metrics.recent.request(tool, duration, Instant::now());
        self.metrics.request_duration.record(
            duration.as_secs_f64(),
            &[tool_attr[0].clone(), KeyValue::new("status", status)],
        );
        // A continuous request cancelled while it runs: stop its call, which frees its place.
        if outcome == Outcome::Cancelled
            && let Some(execution) = &p.execution
            && let Some(call) = self.continuous_calls.remove(&execution.batch)
        {
            call.abort();
            self.core.batch_finished(
                execution.batch,
                BatchResult::Failed("cancelled by its caller".into()),
                Instant::now(),
            );
        }
        if let (
            Outcome::Ok,
            Some(Answer {
                generation: Some(g),
                ..
            }),
        ) = (&outcome, &p.output)
        {
            self.metrics
                .generate_time_to_first_token
                .record(g.time_to_first_token_seconds, &tool_attr);
            for (phase, tokens) in [
                (
                    "prefill",
                    g.prompt_tokens.saturating_sub(g.cached_prompt_tokens),
                ),
                ("decode", g.completion_tokens),
            ] {
                self.metrics.generate_tokens.add(
                    u64::from(tokens),
                    &[tool_attr[0].clone(), KeyValue::new("phase", phase)],
                );
            }
        }
        let result = match (outcome, p.output, &p.execution) {
            (Outcome::Ok, Some(answer), Some(execution)) => Ok(Served {
                output: answer.output,
                worker_id: execution.worker_id.clone(),
                queue_wait: execution.queue_wait,
                batch_size: execution.batch_size,
                generation: answer.generation,
            }),
            (outcome, _, _) => Err(status::failure(outcome, tool)),
        };
        if let Some(execution) = p.execution {
            match &result {
                Ok(_) => execution.share.set_ok(),
                Err(e) => execution
                    .share
                    .set_error(format!("{:?}", e.category()), e.to_string()),
            }
        }
        let _ = p.reply.send(result);
    }

    fn reporting(&self) -> calls::Reporting {
        calls::Reporting {
            metrics: self.metrics.clone(),
            tx: self.tx.clone(),
            deadlines: self.deadlines,
        }
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
        tokio::spawn(calls::prepare(
            worker,
            slot,
            tool,
            self.tools[tool].clone(),
            offload.map(|t| self.tools[t].name.clone()),
            load,
            self.reporting(),
        ));
    }

    fn maintain(&mut self, slot: SlotId, what: Maintenance) {
        let Some(worker) = self.workers.get(&slot).cloned() else {
            return;
        };
        tokio::spawn(calls::maintain(worker, slot, what, self.reporting()));
    }
}

/// Drops workers that miss three heartbeats in a row, telling the driver (runs until aborted).
pub async fn reap(registry: Arc<WorkerRegistry>, driver: Handle, heartbeat: Duration) {
    let mut tick = tokio::time::interval(heartbeat);
    loop {
        tick.tick().await;
        for worker in registry.reap(heartbeat * 3) {
            tracing::warn!(worker_id = %worker.id, "worker missed its heartbeats: dropped");
            driver
                .worker_down(worker.generation, "it stopped heartbeating".into())
                .await;
        }
    }
}

/// What a request weighs: its input's encoded bytes, and for a text an estimate of its tokens
/// (UTF-8 bytes / 4, as subword tokenizers average on English, plus the two special tokens).
fn cost_of(input: &ToolInput) -> Cost {
    use prost::Message as _;
    let tokens = match &input.value {
        Some(nomad_proto::v1::tool_input::Value::Text(text)) => text.len().div_ceil(4) as u64 + 2,
        _ => 0,
    };
    Cost {
        bytes: input.encoded_len() as u64,
        tokens,
    }
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
