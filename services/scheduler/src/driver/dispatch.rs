//! A batch the core formed, made into a worker call: the batch span (its own trace, linked to
//! each request), each request's `nomad.tool.execute` share and trace carrier, and the call's
//! task (a stream for a continuous tool's single request).

use std::time::{Duration, Instant};

use nomad_proto::v1::{ExecuteBatchRequest, TraceCarrier};
use nomad_scheduler_core::{BatchId, BatchResult, RequestId, SlotId, ToolId};
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions, propagation};
use opentelemetry::trace::{Link, SpanKind, TraceContextExt as _};

use super::{Driver, Execution, calls};

impl Driver {
    pub(super) fn dispatch(
        &mut self,
        batch: BatchId,
        slot: SlotId,
        tool: ToolId,
        requests: &[RequestId],
        queue_waits: &[Duration],
        running: u32,
    ) {
        let Some(worker) = self.workers.get(&slot).cloned() else {
            // The core only dispatches to slots it knows, and they are added with the worker.
            self.core.batch_finished(
                batch,
                BatchResult::Failed("no worker for the slot".into()),
                Instant::now(),
            );
            return;
        };
        let name = self.tools[tool].name.clone();
        // For a continuous tool, the requests running together on the worker.
        let size = running;
        let attributes = worker.tool_attributes(&name);
        let batch_span = self.batch_span(requests, &attributes, size);
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
        for (request, &queue_wait) in requests.iter().zip(queue_waits) {
            let Some(p) = self.pending.get_mut(request) else {
                continue;
            };
            self.metrics.request_queue_wait.record(
                queue_wait.as_secs_f64(),
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
                        KeyValue::new("nomad.tool.queue_wait_seconds", queue_wait.as_secs_f64()),
                    ],
                    links: batch_link.clone(),
                    ..Default::default()
                },
            );
            traces.push(TraceCarrier {
                fields: propagation::inject_map(share.context()),
            });
            p.execution = Some(Execution {
                batch,
                share,
                worker_id: worker.id.clone(),
                queue_wait,
                batch_size: size,
            });
            inputs.push(p.input.clone());
        }
        // With telemetry off there is no context to carry: send none rather than empty maps.
        if traces.iter().all(|t| t.fields.is_empty()) {
            traces.clear();
        }
        let request = ExecuteBatchRequest {
            tool: name,
            inputs,
            traces,
        };
        let call = calls::Call {
            worker,
            batch,
            request,
            size,
            deadline: self.tools[tool].execute_timeout,
            batch_span,
            attributes,
        };
        let text = match requests {
            [only] => self.pending.get(only).and_then(|p| p.text.clone()),
            _ => None,
        };
        let task = match text {
            Some(text) if self.tools[tool].continuous => {
                tokio::spawn(calls::execute_stream(call, text, self.reporting()))
            }
            _ => tokio::spawn(calls::execute_batch(call, self.reporting())),
        };
        if self.tools[tool].continuous {
            self.continuous_calls.insert(batch, task.abort_handle());
        }
    }

    /// The batch span starts its own trace, linked to every request it serves.
    fn batch_span(&self, requests: &[RequestId], attributes: &[KeyValue], size: u32) -> GroupSpan {
        let links: Vec<Link> = requests
            .iter()
            .filter_map(|r| self.pending.get(r))
            .map(|p| p.cx.span().span_context().clone())
            .filter(|sc| sc.is_valid())
            .map(Link::with_context)
            .collect();
        GroupSpan::start_with(
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
                ..Default::default()
            },
        )
    }
}
