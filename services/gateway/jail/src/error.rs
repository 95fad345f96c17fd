//! A failed step, named: `nomad sandbox-init: <step>: <error>` is what the gateway shows.

/// Why a jail could not be set up: the step and the kernel's answer.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Failed(pub String);

/// Names the step a `Result` belongs to.
pub trait Step<T> {
    fn step(self, what: &str) -> Result<T, Failed>;
}

impl<T, E: std::fmt::Display> Step<T> for Result<T, E> {
    fn step(self, what: &str) -> Result<T, Failed> {
        self.map_err(|e| Failed(format!("{what}: {e}")))
    }
}

/// The last OS error, as a failed `what`.
pub fn last_os_error(what: &str) -> Failed {
    Failed(format!("{what}: {}", std::io::Error::last_os_error()))
}
