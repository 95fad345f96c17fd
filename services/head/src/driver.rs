//! The rollout driver: runs each task as one rollout (its own trace, rooted at `nomad.rollout`),
//! at most `concurrency` at a time, and reports one result per task.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nomad_proto::v1::GatewayCallToolRequest;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions, baggage};
use opentelemetry::trace::{FutureExt as _, Link, SpanKind, TraceContextExt as _};
use serde::Serialize;
use serde_json::Value;

use crate::tasks::Task;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RolloutResult {
    pub task_id: String,
    pub rollout_id: String,
    pub run_id: String,
    /// Empty when rollout spans are off.
    pub trace_id: String,
    /// `ok` or `error`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub duration_seconds: f64,
}

/// Large numeric outputs (embeddings) are summarised: shape, first values and L2 norm.
fn summarize(result: Value) -> Value {
    const KEEP: usize = 64;
    match result {
        Value::Object(mut object) => {
            if let Some(Value::Array(values)) = object.get("output")
                && values.len() > KEEP
            {
                let norm = values
                    .iter()
                    .filter_map(Value::as_f64)
                    .map(|v| v * v)
                    .sum::<f64>()
                    .sqrt();
                let first: Vec<Value> = values.iter().take(8).cloned().collect();
                object.insert("output".into(), Value::Array(first));
                object.insert("output_truncated".into(), Value::Bool(true));
                object.insert("l2_norm".into(), serde_json::json!(norm));
            }
            Value::Object(object)
        }
        other => other,
    }
}

pub struct Driver {
    pub gateway: GatewayClient<nomad_rpc::Channel>,
    pub run_id: String,
    pub concurrency: usize,
}

impl Driver {
    /// Runs every task; `on_result` sees each result as it completes (in completion order).
    pub async fn run(
        &self,
        tasks: Vec<Task>,
        mut on_result: impl FnMut(&RolloutResult),
    ) -> Vec<RolloutResult> {
        let run_cx = baggage::with_ids(&Context::new(), &self.run_id, None);
        let job = GroupSpan::start_with(
            SpanGroup::Job,
            "nomad.job",
            &run_cx,
            SpanOptions {
                attributes: vec![KeyValue::new("nomad.job.tasks", tasks.len() as i64)],
                ..Default::default()
            },
        );
        let job_link = job
            .is_recording()
            .then(|| job.context().span().span_context().clone());
        let mut results = Vec::with_capacity(tasks.len());
        let mut stream = futures::stream::iter(tasks)
            .map(|task| self.rollout(task, job_link.clone()))
            .buffer_unordered(self.concurrency.max(1));
        while let Some(result) = stream.next().await {
            on_result(&result);
            results.push(result);
        }
        let failed = results.iter().filter(|r| r.status != "ok").count();
        job.set_attribute(KeyValue::new("nomad.job.failed", failed as i64));
        results
    }

    async fn rollout(
        &self,
        task: Task,
        job: Option<opentelemetry::trace::SpanContext>,
    ) -> RolloutResult {
        let rollout_id = uuid::Uuid::new_v4().simple().to_string();
        let cx = baggage::with_ids(&Context::new(), &self.run_id, Some(&rollout_id));
        let span = GroupSpan::start_with(
            SpanGroup::Rollout,
            "nomad.rollout",
            &cx,
            SpanOptions {
                kind: Some(SpanKind::Internal),
                attributes: vec![
                    KeyValue::new("nomad.task.id", task.id.clone()),
                    KeyValue::new("nomad.gateway.server", task.server.clone()),
                    KeyValue::new("nomad.gateway.tool", task.tool.clone()),
                ],
                links: job.into_iter().map(Link::with_context).collect(),
                new_root: true,
            },
        );
        let started = Instant::now();
        let request = GatewayCallToolRequest {
            server: task.server.clone(),
            tool: task.tool.clone(),
            arguments_json: task.arguments.to_string(),
        };
        let reply = self
            .gateway
            .clone()
            .call_tool(request)
            .with_context(span.context().clone())
            .await;
        let (status, output, error) = match reply {
            Ok(reply) => match serde_json::from_str::<Value>(&reply.get_ref().result_json) {
                Ok(value) => ("ok", Some(summarize(value)), None),
                Err(e) => (
                    "error",
                    None,
                    Some(format!("gateway returned invalid JSON: {e}")),
                ),
            },
            Err(status) => (
                "error",
                None,
                Some(format!("{:?}: {}", status.code(), status.message())),
            ),
        };
        if let Some(e) = &error {
            span.set_error("rollout_failed", e.clone());
        } else {
            span.set_ok();
        }
        RolloutResult {
            task_id: task.id,
            rollout_id,
            run_id: self.run_id.clone(),
            trace_id: span.trace_id().unwrap_or_default(),
            status: status.to_owned(),
            output,
            error,
            duration_seconds: started.elapsed().as_secs_f64(),
        }
    }
}

/// Prints progress to stderr at most once per `every`, and always for the last result.
pub struct Progress {
    total: usize,
    done: usize,
    failed: usize,
    started: Instant,
    last: Option<Instant>,
    every: Duration,
}

impl Progress {
    pub fn new(total: usize) -> Self {
        Self {
            total,
            done: 0,
            failed: 0,
            started: Instant::now(),
            last: None,
            every: Duration::from_secs(1),
        }
    }

    pub fn record(&mut self, result: &RolloutResult) {
        self.done += 1;
        if result.status != "ok" {
            self.failed += 1;
            eprintln!(
                "rollout {} (task {}) failed: {}",
                result.rollout_id,
                result.task_id,
                result.error.as_deref().unwrap_or("unknown error")
            );
        }
        let now = Instant::now();
        let due = self
            .last
            .is_none_or(|t| now.duration_since(t) >= self.every);
        if due || self.done == self.total {
            self.last = Some(now);
            let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
            let rate = self.done as f64 / elapsed;
            let eta = (self.total - self.done) as f64 / rate.max(1e-9);
            eprintln!(
                "[{}/{}] failed={} rate={rate:.1}/s eta={eta:.0}s",
                self.done, self.total, self.failed
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_outputs_are_summarised_short_ones_kept() {
        let short = serde_json::json!({"output": [1.0, 2.0], "shape": [2]});
        assert_eq!(summarize(short.clone()), short);
        let long: Vec<f64> = (0..100).map(|_| 0.1).collect();
        let s = summarize(serde_json::json!({"output": long, "shape": [100]}));
        assert_eq!(s["output"].as_array().unwrap().len(), 8);
        assert_eq!(s["output_truncated"], true);
        assert!((s["l2_norm"].as_f64().unwrap() - 1.0).abs() < 1e-9);
    }
}
