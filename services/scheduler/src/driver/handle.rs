//! The callers' side of the driver: a cheap clone per gRPC handler. It allocates request ids
//! (so a cancellation can name its request before the driver has seen it), sends commands and
//! waits for answers, and cancels a request whose caller goes away.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::CallError;
use nomad_proto::v1::{GenerationStats, ToolInput, ToolOutput};
use nomad_scheduler_core::{BatchId, BatchResult, RequestId, SlotId, ToolId};
use nomad_telemetry::Context;
use tokio::sync::{mpsc, oneshot};

use super::recorder::RequestRecorder;
use crate::workers::Worker;

/// A request's answer.
#[derive(Debug)]
pub struct Served {
    pub output: ToolOutput,
    pub worker_id: String,
    pub queue_wait: Duration,
    pub batch_size: u32,
    /// What a generation took, as its worker reported it.
    pub generation: Option<GenerationStats>,
}

/// A worker's answer to one request of a batch.
#[derive(Debug, Clone)]
pub struct Answer {
    pub output: ToolOutput,
    pub generation: Option<GenerationStats>,
}

/// What the driver's loop receives: from callers, and from its own worker-call tasks.
pub(super) enum Command {
    Submit {
        request: RequestId,
        tool: String,
        input: ToolInput,
        cx: Context,
        reply: oneshot::Sender<Result<Served, CallError>>,
        /// Where a streamed generation's text goes as it is made.
        text: Option<mpsc::Sender<String>>,
    },
    Cancel {
        request: RequestId,
    },
    WorkerUp(Worker),
    /// A tool's model reported its own batch size.
    SetBatchSize {
        tool: String,
        batch_size: u32,
    },
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
        outputs: Vec<Option<Answer>>,
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
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) next_request: Arc<AtomicU64>,
}

/// Sends `Cancel` if the caller goes away before its answer arrives.
struct CancelOnDrop {
    tx: mpsc::Sender<Command>,
    request: RequestId,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // A full channel is fine: the periodic sweep finds the closed reply channel.
            let _ = self.tx.try_send(Command::Cancel {
                request: self.request,
            });
        }
    }
}

impl Handle {
    /// Runs one request on `tool`; the caller's context is current.
    pub async fn call(&self, tool: &str, input: ToolInput) -> Result<Served, CallError> {
        self.call_streaming(tool, input, None).await
    }

    /// Runs one request on `tool`, sending a generation's text to `text` as it is made (other
    /// kinds send none); the answer is the whole of it.
    pub async fn call_streaming(
        &self,
        tool: &str,
        input: ToolInput,
        text: Option<mpsc::Sender<String>>,
    ) -> Result<Served, CallError> {
        let recorder = RequestRecorder::start(tool);
        let request = self.next_request.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Submit {
                request,
                tool: tool.to_owned(),
                input,
                cx: recorder.context().clone(),
                reply,
                text,
            })
            .await
            .map_err(|_| CallError::Stopped)?;
        let mut guard = CancelOnDrop {
            tx: self.tx.clone(),
            request,
            armed: true,
        };
        let result = answer.await.unwrap_or(Err(CallError::Stopped));
        guard.armed = false;
        match &result {
            Ok(served) => recorder.answered(served.queue_wait, served.generation.as_ref()),
            Err(status) => recorder.failed(status),
        }
        result
    }

    pub async fn worker_up(&self, worker: Worker) {
        let _ = self.tx.send(Command::WorkerUp(worker)).await;
    }

    /// Makes `batch_size` the tool's configured batch size (its model said so).
    pub async fn set_batch_size(&self, tool: &str, batch_size: u32) {
        let _ = self
            .tx
            .send(Command::SetBatchSize {
                tool: tool.to_owned(),
                batch_size,
            })
            .await;
    }

    pub async fn worker_down(&self, slot: SlotId, reason: String) {
        let _ = self.tx.send(Command::WorkerDown { slot, reason }).await;
    }

    /// Stop accepting requests; accepted ones still finish.
    pub async fn close(&self) {
        let _ = self.tx.send(Command::Close).await;
    }
}
