//! Run and rollout ids: carried as W3C baggage across every hop, and copied onto every span
//! started while they are in the context.

use opentelemetry::baggage::BaggageExt;
use opentelemetry::trace::Span as _;
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};

pub const RUN_ID: &str = "nomad.run.id";
pub const ROLLOUT_ID: &str = "nomad.rollout.id";

/// `cx` with the run id (and, when given, the rollout id) added to its baggage.
pub fn with_ids(cx: &Context, run_id: &str, rollout_id: Option<&str>) -> Context {
    let mut entries = vec![KeyValue::new(RUN_ID, run_id.to_owned())];
    if let Some(rollout) = rollout_id {
        entries.push(KeyValue::new(ROLLOUT_ID, rollout.to_owned()));
    }
    cx.with_baggage(entries)
}

/// The run id in `cx`'s baggage.
pub fn run_id(cx: &Context) -> Option<String> {
    cx.baggage().get(RUN_ID).map(|v| v.to_string())
}

/// The rollout id in `cx`'s baggage.
pub fn rollout_id(cx: &Context) -> Option<String> {
    cx.baggage().get(ROLLOUT_ID).map(|v| v.to_string())
}

/// Copies `nomad.run.id` / `nomad.rollout.id` from the parent context's baggage onto each span.
/// A process that belongs to one run (started by `nomad up`) falls back to that run's id.
#[derive(Debug, Default)]
pub struct RunIdSpanProcessor {
    pub process_run_id: Option<String>,
}

impl SpanProcessor for RunIdSpanProcessor {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        let baggage = cx.baggage();
        match baggage.get(RUN_ID) {
            Some(run) => span.set_attribute(KeyValue::new(RUN_ID, run.to_string())),
            None => {
                if let Some(run) = &self.process_run_id {
                    span.set_attribute(KeyValue::new(RUN_ID, run.clone()));
                }
            }
        }
        if let Some(rollout) = baggage.get(ROLLOUT_ID) {
            span.set_attribute(KeyValue::new(ROLLOUT_ID, rollout.to_string()));
        }
    }

    fn on_end(&self, _span: SpanData) {}

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: std::time::Duration) -> OTelSdkResult {
        Ok(())
    }
}
