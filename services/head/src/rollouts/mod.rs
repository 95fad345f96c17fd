//! The rollout runner: runs each task as one rollout (its own trace, rooted at `nomad.rollout`),
//! at most `concurrency` at a time: the agent step through the gateway, then verification.

use std::io::{IsTerminal as _, Write};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::{ExecuteCodeRequest, GatewayCallToolRequest};
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup, SpanOptions, baggage};
use opentelemetry::metrics::Histogram;
use opentelemetry::trace::{FutureExt as _, Link, SpanKind, TraceContextExt as _};
use serde::Serialize;
use serde_json::Value;

use crate::tasks::{Step, Task};

mod stop;

use crate::verify::{self, Verify};
use stop::EndsCancelled;
pub use stop::Stop;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Durations {
    pub agent_seconds: f64,
    pub verify_seconds: f64,
    pub total_seconds: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RolloutResult {
    pub task_id: String,
    pub rollout_id: String,
    pub run_id: String,
    /// Empty when rollout spans are off.
    pub trace_id: String,
    /// `ok` when the agent step (and verification) ran, `error` when one failed.
    pub status: String,
    /// None when the task has nothing to verify against, or the rollout failed.
    pub reward: Option<f64>,
    pub passed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// The task's expected answer, beside an output that was verified and did not pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The code's upstream tool calls, in the order they started, when the gateway records
    /// them (`gateway.record_tool_calls`): what a replay of the rollout needs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    pub durations: Durations,
}

/// A recorded tool call as a result line holds it (payloads as JSON, when recorded).
fn call_json(call: &nomad_proto::v1::ToolCallRecord) -> Value {
    let mut json = serde_json::json!({
        "server": call.server,
        "tool": call.tool,
        "status": call.status,
        "start_offset_seconds": call.start_offset_seconds,
        "duration_seconds": call.duration_seconds,
    });
    for (key, text) in [
        ("arguments", &call.arguments_json),
        ("output", &call.output_json),
    ] {
        if !text.is_empty() {
            json[key] = serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()));
        }
    }
    if !call.error.is_empty() {
        json["error"] = Value::String(call.error.clone());
    }
    if !call.code.is_empty() {
        json["code"] = Value::String(call.code.clone());
    }
    json
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

fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... [{} more bytes]", &text[..end], text.len() - end)
}

/// How long a rollout waits for a gateway that cannot be reached (one starting again) before
/// it fails.
const GATEWAY_RETURN_WITHIN: Duration = Duration::from_secs(60);

/// Why a call to the gateway failed, naming the fault when the gateway itself was the fault: a
/// call that never reached it is not run; one lost with it may have run in part, so it is not
/// made again.
fn gateway_failure(status: &tonic::Status) -> String {
    if nomad_rpc::never_sent(status) {
        format!(
            "UNAVAILABLE: the gateway could not be reached within {} s: {}",
            GATEWAY_RETURN_WITHIN.as_secs(),
            status.message()
        )
    } else if nomad_rpc::peer_lost(status) && std::error::Error::source(status).is_some() {
        format!(
            "UNAVAILABLE: the connection to the gateway was lost during the call (it stopped or \
             restarted); not made again, as its code may have run in part: {}",
            status.message()
        )
    } else {
        format!("{:?}: {}", status.code(), status.message())
    }
}

pub struct Runner {
    pub gateway: GatewayClient<nomad_rpc::Channel>,
    pub run_id: String,
    pub concurrency: usize,
    /// The `nomad` tool that embeds texts for `similarity` verification.
    pub embed_tool: String,
    rollout_duration: Histogram<f64>,
    verify_duration: Histogram<f64>,
}

impl Runner {
    pub fn new(
        gateway: GatewayClient<nomad_rpc::Channel>,
        run_id: String,
        concurrency: usize,
        embed_tool: String,
    ) -> Self {
        Self {
            gateway,
            run_id,
            concurrency,
            embed_tool,
            rollout_duration: defs::ROLLOUT_DURATION.f64_histogram(),
            verify_duration: defs::VERIFY_DURATION.f64_histogram(),
        }
    }

    /// Runs every task until `stop`; `on_result` sees each result as it completes (in
    /// completion order): one for every task, `cancelled` for those the stop cut short or
    /// never started.
    pub async fn run(
        &self,
        tasks: Vec<Task>,
        stop: &Stop,
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
        let mut job_open =
            EndsCancelled::new(&job, "the run stopped before all its rollouts finished");
        let mut results = Vec::with_capacity(tasks.len());
        let mut stream = futures::stream::iter(tasks)
            .map(|task| self.rollout(task, job_link.clone(), stop))
            .buffer_unordered(self.concurrency.max(1));
        while let Some(result) = stream.next().await {
            on_result(&result);
            results.push(result);
        }
        let failed = results.iter().filter(|r| r.status != "ok").count();
        job.set_attribute(KeyValue::new("nomad.job.failed", failed as i64));
        // A stopped run's job span says so (the guard does, when it drops).
        job_open.done = stop.reason().is_none();
        results
    }

    async fn rollout(
        &self,
        task: Task,
        job: Option<opentelemetry::trace::SpanContext>,
        stop: &Stop,
    ) -> RolloutResult {
        let rollout_id = uuid::Uuid::new_v4().simple().to_string();
        let cx = baggage::with_ids(&Context::new(), &self.run_id, Some(&rollout_id));
        let step_kind = match &task.step {
            Step::Code(_) => "code",
            Step::Tool { .. } => "tool",
        };
        let span = GroupSpan::start_with(
            SpanGroup::Rollout,
            "nomad.rollout",
            &cx,
            SpanOptions {
                kind: Some(SpanKind::Internal),
                attributes: vec![
                    KeyValue::new("nomad.task.id", task.id.clone()),
                    KeyValue::new("nomad.rollout.step", step_kind),
                ],
                links: job.into_iter().map(Link::with_context).collect(),
                new_root: true,
                ..Default::default()
            },
        );
        let mut open = EndsCancelled::new(&span, "the run stopped before this rollout finished");
        let started = Instant::now();
        let work = async {
            let mut tool_calls = None;
            let agent = self
                .agent_step(&task.step, &mut tool_calls)
                .with_context(span.context().clone())
                .await;
            let agent_seconds = started.elapsed().as_secs_f64();
            let verify_started = Instant::now();
            let verdict = self.verdict(&task, agent, span.context()).await;
            let verify_seconds = if verdict.2.is_some() || verdict.3.is_some() {
                verify_started.elapsed().as_secs_f64()
            } else {
                0.0
            };
            (verdict, tool_calls, agent_seconds, verify_seconds)
        };
        // A stopped run starts nothing more, and ends what runs as cancelled, with why.
        let outcome = match stop.reason() {
            Some(why) => Err(why),
            None => tokio::select! {
                outcome = work => Ok(outcome),
                why = stop.stopped() => Err(why),
            },
        };
        let ((output, error, reward, passed), tool_calls, agent_seconds, verify_seconds) =
            match outcome {
                Ok(outcome) => outcome,
                Err(why) => {
                    open.done = true;
                    span.set_error("cancelled", &why);
                    let total = started.elapsed().as_secs_f64();
                    self.rollout_duration
                        .record(total, &[KeyValue::new("status", "cancelled")]);
                    return RolloutResult {
                        task_id: task.id.clone(),
                        rollout_id,
                        run_id: self.run_id.clone(),
                        trace_id: span.trace_id().unwrap_or_default(),
                        status: "cancelled".to_owned(),
                        reward: None,
                        passed: None,
                        output: None,
                        expected: None,
                        error: Some(clip(&why, 4000)),
                        tool_calls: None,
                        durations: Durations {
                            agent_seconds: total,
                            verify_seconds: 0.0,
                            total_seconds: total,
                        },
                    };
                }
            };
        let status = if error.is_none() { "ok" } else { "error" };
        open.done = true;
        match &error {
            Some(e) => span.set_error("rollout_failed", e.lines().next().unwrap_or_default()),
            None => span.set_ok(),
        }
        if let Some(r) = reward {
            span.set_attribute(KeyValue::new("nomad.rollout.reward", r));
        }
        let total = started.elapsed().as_secs_f64();
        self.rollout_duration
            .record(total, &[KeyValue::new("status", status)]);
        RolloutResult {
            task_id: task.id.clone(),
            rollout_id,
            run_id: self.run_id.clone(),
            trace_id: span.trace_id().unwrap_or_default(),
            status: status.to_owned(),
            reward,
            passed,
            output: output.map(summarize),
            expected: (passed == Some(false))
                .then(|| task.expected.clone().map(summarize))
                .flatten(),
            error: error.map(|e| clip(&e, 4000)),
            tool_calls,
            durations: Durations {
                agent_seconds,
                verify_seconds,
                total_seconds: total,
            },
        }
    }

    /// The agent step's outcome, verified against the task's expected answer where it has one:
    /// (output, error, reward, passed).
    async fn verdict(
        &self,
        task: &Task,
        agent: Result<Value, String>,
        cx: &Context,
    ) -> (Option<Value>, Option<String>, Option<f64>, Option<bool>) {
        let verify_started = Instant::now();
        match agent {
            Err(e) => (None, Some(e), None, None),
            Ok(output) => match (&task.verify, &task.expected) {
                (Verify::None, _) | (_, None) => (Some(output), None, None, None),
                (kind, Some(expected)) => {
                    let verdict = self.verify(kind, &output, expected, cx).await;
                    let outcome = match &verdict {
                        Ok((_, true)) => "passed",
                        Ok((_, false)) => "failed",
                        Err(_) => "error",
                    };
                    self.verify_duration.record(
                        verify_started.elapsed().as_secs_f64(),
                        &[
                            KeyValue::new("nomad.verify.kind", kind.name()),
                            KeyValue::new("nomad.verify.outcome", outcome),
                        ],
                    );
                    match verdict {
                        Ok((reward, passed)) => (Some(output), None, Some(reward), Some(passed)),
                        Err(e) => (
                            Some(output),
                            Some(format!("verification failed: {e}")),
                            None,
                            None,
                        ),
                    }
                }
            },
        }
    }

    /// The agent step's output, or why it failed; the code's recorded tool calls go to
    /// `tool_calls`.
    async fn agent_step(
        &self,
        step: &Step,
        tool_calls: &mut Option<Vec<Value>>,
    ) -> Result<Value, String> {
        match step {
            Step::Code(code) => {
                let request = ExecuteCodeRequest {
                    code: code.clone(),
                    env: Default::default(),
                };
                let reply = nomad_rpc::while_unreachable(GATEWAY_RETURN_WITHIN, || {
                    let (mut gateway, request) = (self.gateway.clone(), request.clone());
                    async move { gateway.execute_code(request).await }
                })
                .await
                .map_err(|s| gateway_failure(&s))?
                .into_inner();
                if !reply.tool_calls.is_empty() {
                    *tool_calls = Some(reply.tool_calls.iter().map(call_json).collect());
                }
                if !reply.error.is_empty() {
                    return Err(reply.error);
                }
                serde_json::from_str(&reply.result_json)
                    .map_err(|e| format!("the gateway returned invalid JSON: {e}"))
            }
            Step::Tool {
                server,
                tool,
                arguments,
            } => self.call_tool(server, tool, arguments).await,
        }
    }

    async fn call_tool(
        &self,
        server: &str,
        tool: &str,
        arguments: &Value,
    ) -> Result<Value, String> {
        let request = GatewayCallToolRequest {
            server: server.to_owned(),
            tool: tool.to_owned(),
            arguments_json: arguments.to_string(),
        };
        let reply = nomad_rpc::while_unreachable(GATEWAY_RETURN_WITHIN, || {
            let (mut gateway, request) = (self.gateway.clone(), request.clone());
            async move { gateway.call_tool(request).await }
        })
        .await
        .map_err(|s| gateway_failure(&s))?;
        serde_json::from_str(&reply.get_ref().result_json)
            .map_err(|e| format!("the gateway returned invalid JSON: {e}"))
    }

    /// `(reward, passed)` under a `nomad.verify` span.
    async fn verify(
        &self,
        kind: &Verify,
        output: &Value,
        expected: &Value,
        parent: &Context,
    ) -> Result<(f64, bool), String> {
        let span = GroupSpan::start(SpanGroup::Verify, "nomad.verify", parent);
        span.set_attribute(KeyValue::new("nomad.verify.kind", kind.name()));
        let verdict = match kind {
            Verify::Similarity { threshold } => self
                .similarity(output, expected)
                .with_context(span.context().clone())
                .await
                .map(|cos| (cos.clamp(0.0, 1.0), cos >= *threshold)),
            other => verify::score(other, output, expected),
        };
        match &verdict {
            Ok((reward, passed)) => {
                span.set_attributes([
                    KeyValue::new("nomad.verify.reward", *reward),
                    KeyValue::new("nomad.verify.passed", *passed),
                ]);
                span.set_ok();
            }
            Err(e) => span.set_error("verify_failed", e.clone()),
        }
        verdict
    }

    /// Cosine similarity of the embeddings of the two texts (through the `embed` tool).
    async fn similarity(&self, output: &Value, expected: &Value) -> Result<f64, String> {
        let embed = |value: &Value| {
            let text = verify::as_text(value);
            async move {
                let reply = self
                    .call_tool(
                        "nomad",
                        &self.embed_tool,
                        &serde_json::json!({ "text": text }),
                    )
                    .await?;
                reply["output"]
                    .as_array()
                    .map(|v| v.iter().filter_map(Value::as_f64).collect::<Vec<f64>>())
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| format!("the {} tool returned no vector", self.embed_tool))
            }
        };
        let (a, b) = futures::try_join!(embed(output), embed(expected))?;
        Ok(verify::cosine(&a, &b))
    }
}

/// Progress on stderr: a bar redrawn in place on a terminal, a line a second otherwise.
pub struct Progress {
    total: usize,
    done: usize,
    failed: usize,
    reward_sum: f64,
    rewarded: usize,
    started: Instant,
    last: Option<Instant>,
    tty: bool,
}

impl Progress {
    pub fn new(total: usize) -> Self {
        Self {
            total,
            done: 0,
            failed: 0,
            reward_sum: 0.0,
            rewarded: 0,
            started: Instant::now(),
            last: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub fn record(&mut self, result: &RolloutResult) {
        self.done += 1;
        if let Some(r) = result.reward {
            self.reward_sum += r;
            self.rewarded += 1;
        }
        if result.status != "ok" {
            self.failed += 1;
            let error = result.error.as_deref().unwrap_or("unknown error");
            if self.tty {
                eprint!("\r\x1b[2K");
            }
            eprintln!(
                "rollout {} (task {}) failed: {}",
                result.rollout_id,
                result.task_id,
                error.lines().next().unwrap_or_default()
            );
        }
        let now = Instant::now();
        let every = if self.tty {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(1)
        };
        if self.last.is_none_or(|t| now.duration_since(t) >= every) || self.done == self.total {
            self.last = Some(now);
            self.draw();
        }
    }

    fn draw(&self) {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = self.done as f64 / elapsed;
        let eta = (self.total - self.done) as f64 / rate.max(1e-9);
        let reward = if self.rewarded > 0 {
            format!(
                ", mean reward {:.2}",
                self.reward_sum / self.rewarded as f64
            )
        } else {
            String::new()
        };
        // A rate over less than a second is noise (the first result alone reads as thousands a
        // second): until then the line shows the count alone, and a run over within the second
        // its time.
        let pace = if elapsed >= 1.0 {
            format!(", {rate:.1} rollouts/s, eta {eta:.0} s")
        } else if self.done == self.total {
            format!(", in {elapsed:.1} s")
        } else {
            String::new()
        };
        let stats = format!(
            "{}/{} done, {} failed{pace}{reward}",
            self.done, self.total, self.failed
        );
        if self.tty {
            let width = 30;
            let filled = width * self.done / self.total.max(1);
            eprint!(
                "\r\x1b[2K[{}{}] {stats}",
                "#".repeat(filled),
                "-".repeat(width - filled)
            );
            if self.done == self.total {
                eprintln!();
            }
        } else {
            eprintln!("[{stats}]");
        }
    }
}

/// The objects of a JSONL file (results, tasks); none when it is missing, and a line that is
/// not JSON (one being written) is skipped.
pub fn read_jsonl(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Runs `tasks` with a progress bar until `stop`, writing each result to `out` (`-`: stdout;
/// appended to with `append`, else written afresh) as it finishes and keeping it in `finished`: one line for every task, those the stop cut short
/// or never started as `cancelled` with why.
pub async fn run_to_file(
    runner: &Runner,
    tasks: Vec<Task>,
    out: &std::path::Path,
    append: bool,
    finished: &mut Vec<RolloutResult>,
    stop: &Stop,
) -> anyhow::Result<()> {
    let mut sink: Box<dyn Write + Send> = if out.as_os_str() == "-" {
        Box::new(std::io::stdout())
    } else {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .append(append)
            .truncate(!append)
            .open(out)
            .map_err(|e| anyhow::anyhow!("opening results file {}: {e}", out.display()))?;
        Box::new(file)
    };
    let mut progress = Progress::new(tasks.len());
    let mut write_error = None;
    runner
        .run(tasks, stop, |result| {
            progress.record(result);
            finished.push(result.clone());
            if write_error.is_none() {
                let line = serde_json::to_string(result).expect("results serialize");
                if let Err(e) = writeln!(sink, "{line}").and_then(|_| sink.flush()) {
                    write_error = Some(e);
                }
            }
        })
        .await;
    if let Some(e) = write_error {
        anyhow::bail!("writing results to {}: {e}", out.display());
    }
    Ok(())
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

    #[test]
    fn clipping_keeps_char_boundaries() {
        assert_eq!(clip("short", 10), "short");
        let clipped = clip("ééééé", 3);
        assert!(clipped.starts_with('é') && clipped.contains("more bytes"));
    }
}
