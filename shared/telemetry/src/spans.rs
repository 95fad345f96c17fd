//! Spans by group. A span whose group is off is never started: the caller's context passes
//! through unchanged, so propagation does not depend on which groups record.

use std::borrow::Cow;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use opentelemetry::baggage::BaggageExt;
use opentelemetry::trace::{Link, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use crate::groups::{SpanGroup, SpanGroups};

static GROUPS: AtomicU32 = AtomicU32::new(0);
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Called once by `init` when traces are exported.
pub(crate) fn install(tracer: SdkTracer, groups: SpanGroups) {
    if TRACER.set(tracer).is_ok() {
        GROUPS.store(groups.bits(), Ordering::Release);
    }
}

/// Whether spans of `group` are recorded in this process (false until telemetry is on).
pub fn enabled(group: SpanGroup) -> bool {
    SpanGroups::from_bits(GROUPS.load(Ordering::Relaxed)).contains(group)
}

/// A span that exists only when its group is on. When it does not, every method is a no-op and
/// `context()` is the parent context.
#[derive(Debug)]
pub struct GroupSpan {
    cx: Context,
    recording: bool,
}

/// Options for a span beyond its name: kind, start attributes and links.
#[derive(Debug, Default)]
pub struct SpanOptions {
    pub kind: Option<SpanKind>,
    pub attributes: Vec<KeyValue>,
    pub links: Vec<Link>,
    /// Start a new trace instead of a child of the parent's span (the parent's baggage is kept).
    pub new_root: bool,
    /// When the work began, if before now (phases timed before telemetry was up).
    pub start_time: Option<std::time::SystemTime>,
}

impl GroupSpan {
    /// A child of `parent` (an internal span with no attributes yet).
    pub fn start(group: SpanGroup, name: impl Into<Cow<'static, str>>, parent: &Context) -> Self {
        Self::start_with(group, name, parent, SpanOptions::default())
    }

    pub fn start_with(
        group: SpanGroup,
        name: impl Into<Cow<'static, str>>,
        parent: &Context,
        options: SpanOptions,
    ) -> Self {
        let tracer = match TRACER.get() {
            Some(tracer) if enabled(group) => tracer,
            _ => return Self::disabled(parent),
        };
        let builder = tracer
            .span_builder(name)
            .with_kind(options.kind.unwrap_or(SpanKind::Internal))
            .with_attributes(options.attributes)
            .with_links(options.links);
        let builder = match options.start_time {
            Some(t) => builder.with_start_time(t),
            None => builder,
        };
        let span = if options.new_root {
            // A root keeps the parent's baggage (run and rollout ids) but no span at all: an
            // empty span context would read as an unsampled parent and drop the whole trace.
            let baggage: Vec<KeyValue> = parent
                .baggage()
                .iter()
                .map(|(k, (v, _))| KeyValue::new(k.clone(), v.clone()))
                .collect();
            let root_parent = Context::new().with_baggage(baggage);
            tracer.build_with_context(builder, &root_parent)
        } else {
            tracer.build_with_context(builder, parent)
        };
        Self {
            cx: parent.with_span(span),
            recording: true,
        }
    }

    /// A span that records nothing; `context()` is `parent`.
    pub fn disabled(parent: &Context) -> Self {
        Self {
            cx: parent.clone(),
            recording: false,
        }
    }

    /// The context to run child work in: this span's when recording, else the parent's.
    pub fn context(&self) -> &Context {
        &self.cx
    }

    pub fn is_recording(&self) -> bool {
        self.recording
    }

    pub fn set_attribute(&self, kv: KeyValue) {
        if self.recording {
            self.cx.span().set_attribute(capped(kv));
        }
    }

    pub fn set_attributes(&self, kvs: impl IntoIterator<Item = KeyValue>) {
        if self.recording {
            self.cx.span().set_attributes(kvs.into_iter().map(capped));
        }
    }

    pub fn add_event(&self, name: impl Into<Cow<'static, str>>, attributes: Vec<KeyValue>) {
        if self.recording {
            self.cx.span().add_event(name, attributes);
        }
    }

    /// Marks the span failed with `error.type` and a message (never user data).
    pub fn set_error(&self, error_type: impl Into<String>, message: impl Into<String>) {
        if self.recording {
            let span = self.cx.span();
            span.set_attribute(KeyValue::new("error.type", cap(error_type.into())));
            span.set_status(Status::error(cap(message.into())));
        }
    }

    pub fn set_ok(&self) {
        if self.recording {
            self.cx.span().set_status(Status::Ok);
        }
    }

    /// The span's trace id as hex, when it records.
    pub fn trace_id(&self) -> Option<String> {
        self.recording
            .then(|| self.cx.span().span_context().trace_id().to_string())
    }

    pub fn end(self) {
        // Drop ends it.
    }

    /// Ends the span at `time` (work timed before the span could be made).
    pub fn end_at(self, time: std::time::SystemTime) {
        if self.recording {
            self.cx.span().end_with_timestamp(time);
        }
        // Drop's end() is then a no-op: the span has ended.
    }
}

/// The longest attribute string or status message a span keeps, in bytes: names and messages
/// that callers choose reach every exporter, which must not carry megabytes for them.
pub const MAX_ATTRIBUTE_BYTES: usize = 1024;

/// `text` cut to [`MAX_ATTRIBUTE_BYTES`] at a character boundary, marked with `…` when cut.
pub fn cap(mut text: String) -> String {
    if text.len() > MAX_ATTRIBUTE_BYTES {
        let mut end = MAX_ATTRIBUTE_BYTES - '…'.len_utf8();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

fn capped(kv: KeyValue) -> KeyValue {
    match kv.value {
        opentelemetry::Value::String(s) if s.as_str().len() > MAX_ATTRIBUTE_BYTES => {
            KeyValue::new(kv.key, cap(s.as_str().to_owned()))
        }
        _ => kv,
    }
}

impl Drop for GroupSpan {
    fn drop(&mut self) {
        if self.recording {
            self.cx.span().end();
        }
    }
}

#[cfg(test)]
mod cap_tests {
    use super::*;

    #[test]
    fn long_strings_are_cut_at_a_character_boundary() {
        assert_eq!(cap("short".into()), "short");
        let long = "é".repeat(2000);
        let cut = cap(long);
        assert!(cut.len() <= MAX_ATTRIBUTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        let kv = capped(KeyValue::new("k", "x".repeat(5000)));
        assert!(kv.value.as_str().len() <= MAX_ATTRIBUTE_BYTES);
    }
}
