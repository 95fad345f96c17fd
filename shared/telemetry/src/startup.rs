//! Start-up traces (span group `startup`): the head's `nomad.startup` and each server's
//! `nomad.server.startup`, with a child span per phase. Phases before telemetry is up (reading
//! the config, fetching models, starting telemetry itself) are timed as they happen and become
//! spans afterwards with their real times. A server started by the head continues the head's
//! start-up trace from `TRACEPARENT` in its environment, so one start-up is one trace.

use std::sync::Mutex;
use std::time::SystemTime;

use opentelemetry::{Context, KeyValue};

use crate::groups::SpanGroup;
use crate::spans::{GroupSpan, SpanOptions};

/// Phases timed before the start-up span can exist.
#[derive(Debug, Clone)]
pub struct Phases {
    began: SystemTime,
    last: SystemTime,
    done: Vec<(&'static str, SystemTime, SystemTime)>,
}

impl Default for Phases {
    fn default() -> Self {
        Self::begin()
    }
}

impl Phases {
    /// Start-up begins now.
    pub fn begin() -> Self {
        let now = SystemTime::now();
        Self {
            began: now,
            last: now,
            done: Vec::new(),
        }
    }

    /// The phase `name` ran from the end of the previous one (or the beginning) until now.
    pub fn mark(&mut self, name: &'static str) {
        let now = SystemTime::now();
        self.done.push((name, self.last, now));
        self.last = now;
    }
}

/// A process's start-up span, open until [`Startup::finish`].
#[derive(Debug)]
pub struct Startup {
    root_name: &'static str,
    root: Mutex<Option<GroupSpan>>,
    cx: Context,
}

impl Startup {
    /// The start-up span `root_name`, begun when `phases` began, under `parent` (a remote
    /// context from the environment, or none), with a child span per timed phase.
    pub fn open(
        root_name: &'static str,
        phases: Phases,
        parent: &Context,
        attributes: Vec<KeyValue>,
    ) -> Self {
        let root = GroupSpan::start_with(
            SpanGroup::Startup,
            root_name,
            parent,
            SpanOptions {
                attributes,
                start_time: Some(phases.began),
                ..Default::default()
            },
        );
        let cx = root.context().clone();
        for (name, start, end) in phases.done {
            GroupSpan::start_with(
                SpanGroup::Startup,
                format!("{root_name}.{name}"),
                &cx,
                SpanOptions {
                    start_time: Some(start),
                    ..Default::default()
                },
            )
            .end_at(end);
        }
        Self {
            root_name,
            root: Mutex::new(Some(root)),
            cx,
        }
    }

    /// A start-up that records nothing.
    pub fn disabled() -> Self {
        Self {
            root_name: "",
            root: Mutex::new(None),
            cx: Context::new(),
        }
    }

    /// A phase starting now, as a child of the start-up span (`<root>.<name>`).
    pub fn phase(&self, name: &str, attributes: Vec<KeyValue>) -> GroupSpan {
        if self.root_name.is_empty() {
            return GroupSpan::disabled(&self.cx);
        }
        GroupSpan::start_with(
            SpanGroup::Startup,
            format!("{}.{name}", self.root_name),
            &self.cx,
            SpanOptions {
                attributes,
                ..Default::default()
            },
        )
    }

    /// The start-up span's context: what a process started now should continue.
    pub fn context(&self) -> &Context {
        &self.cx
    }

    /// Ends the start-up span (once; later calls do nothing).
    pub fn finish(&self) {
        let root = self.root.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(root);
    }
}
