//! One request's span, `nomad.tool.request`, kept out of the handle: started in the caller's
//! context (the driver's batch and worker spans are its children) and finished once, answered
//! or failed.

use std::time::Duration;

use crate::error::CallError;
use nomad_proto::v1::GenerationStats;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};

pub(super) struct RequestRecorder {
    span: GroupSpan,
}

impl RequestRecorder {
    /// A request for `tool`; the caller's context is current.
    pub fn start(tool: &str) -> Self {
        let span = GroupSpan::start(SpanGroup::Tool, "nomad.tool.request", &Context::current());
        span.set_attribute(KeyValue::new("tool", tool.to_owned()));
        Self { span }
    }

    /// The context the driver carries the request in.
    pub fn context(&self) -> &Context {
        self.span.context()
    }

    /// The request was answered after waiting `queue_wait` in its queue; a generation's
    /// token counts come with it.
    pub fn answered(self, queue_wait: Duration, generation: Option<&GenerationStats>) {
        let span = self.span;
        span.set_attribute(KeyValue::new(
            "nomad.tool.queue_wait_seconds",
            queue_wait.as_secs_f64(),
        ));
        if let Some(g) = generation {
            span.set_attributes([
                KeyValue::new(
                    "nomad.tool.generate.time_to_first_token_seconds",
                    g.time_to_first_token_seconds,
                ),
                KeyValue::new(
                    "nomad.tool.generate.prompt_tokens",
                    i64::from(g.prompt_tokens),
                ),
                KeyValue::new(
                    "nomad.tool.generate.cached_prompt_tokens",
                    i64::from(g.cached_prompt_tokens),
                ),
                KeyValue::new(
                    "nomad.tool.generate.completion_tokens",
                    i64::from(g.completion_tokens),
                ),
            ]);
        }
        span.set_ok();
    }

    pub fn failed(self, error: &CallError) {
        self.span
            .set_error(format!("{:?}", error.category()), error.to_string());
    }
}
