//! `supervise:`: whether and how soon a server that exits on its own is started again, and when
//! that is a crash loop.

use std::time::Duration;

use serde::Deserialize;

/// `supervise:`: when a child that exits on its own is started again.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    /// Start again a child that exits on its own with a failure (killed, crashed, exited
    /// non-zero); off: its exit stops the fleet.
    pub restart: bool,
    /// The wait before a first restart, doubled for each further one within `window_seconds`.
    pub backoff_seconds: f64,
    /// The longest wait before a restart.
    pub max_backoff_seconds: f64,
    /// More restarts of one child than this within `window_seconds` is a crash loop: the fleet
    /// stops, naming the child.
    pub max_restarts: u32,
    pub window_seconds: f64,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            restart: true,
            backoff_seconds: 0.5,
            max_backoff_seconds: 10.0,
            max_restarts: 5,
            window_seconds: 60.0,
        }
    }
}

/// The policy with its durations checked.
#[derive(Debug, Clone, Copy)]
pub struct Restarts {
    pub restart: bool,
    pub(super) backoff: Duration,
    pub(super) max_backoff: Duration,
    pub(super) max_restarts: u32,
    pub(super) window: Duration,
}

impl RestartPolicy {
    pub fn checked(&self) -> Result<Restarts, String> {
        let seconds = |field: &str, v: f64| nomad_config::seconds(&format!("supervise.{field}"), v);
        Ok(Restarts {
            restart: self.restart,
            backoff: seconds("backoff_seconds", self.backoff_seconds)?,
            max_backoff: seconds("max_backoff_seconds", self.max_backoff_seconds)?,
            max_restarts: self.max_restarts,
            window: seconds("window_seconds", self.window_seconds)?,
        })
    }
}

#[cfg(test)]
impl Restarts {
    /// Never restart (a child's exit stops the fleet).
    pub fn never() -> Self {
        Self {
            restart: false,
            backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
            max_restarts: 0,
            window: Duration::ZERO,
        }
    }
}
