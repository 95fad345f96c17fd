//! Ending a run early: the stop a run's rollouts watch, and the guard that marks a span
//! cancelled when the work it covers is dropped.

use nomad_telemetry::GroupSpan;

/// A run's stop: once it is given, with why, every rollout still running ends as `cancelled`
/// with that reason, and every task not started yet is written as `cancelled` at once, so that
/// every task of the run has one result.
#[derive(Clone)]
pub struct Stop(tokio::sync::watch::Receiver<Option<String>>);

/// Gives a run its [`Stop`].
pub struct Stopper(tokio::sync::watch::Sender<Option<String>>);

impl Stop {
    pub fn new() -> (Stopper, Stop) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (Stopper(tx), Stop(rx))
    }

    /// Why the run stopped, if it has.
    pub(super) fn reason(&self) -> Option<String> {
        self.0.borrow().clone()
    }

    /// Completes once the run is stopped, with why (never, if it is not).
    pub(super) async fn stopped(&self) -> String {
        let mut rx = self.0.clone();
        // The guard `wait_for` returns is not held across an await.
        let why = rx
            .wait_for(Option::is_some)
            .await
            .map(|why| why.clone().unwrap_or_default());
        match why {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    }
}

impl Stopper {
    pub fn stop(&self, why: impl Into<String>) {
        self.0.send_if_modified(|current| {
            let first = current.is_none();
            if first {
                *current = Some(why.into());
            }
            first
        });
    }
}

/// Marks a span cancelled when the work it covers is dropped before it ends (Ctrl-C, a run
/// stopped early), so its trace says so instead of leaving its status unset.
pub(super) struct EndsCancelled<'a> {
    span: &'a GroupSpan,
    why: &'static str,
    pub(super) done: bool,
}

impl<'a> EndsCancelled<'a> {
    pub(super) fn new(span: &'a GroupSpan, why: &'static str) -> Self {
        Self {
            span,
            why,
            done: false,
        }
    }
}

impl Drop for EndsCancelled<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.span.set_error("cancelled", self.why);
        }
    }
}
