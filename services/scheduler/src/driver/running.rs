//! Starting the driver with the model-serving instruments, and finishing it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nomad_scheduler_core::Timing;

use super::{Driver, Handle};
use crate::config::{Deadlines, ToolConfig};
use crate::metrics::{Metrics, Published};
use crate::workers::WorkerRegistry;

/// The running driver: its handle, its task, and the gauges that read what it publishes.
pub struct Running {
    pub handle: Handle,
    /// What the driver last published, and its recent requests and batches (`Snapshot`).
    pub published: Arc<Mutex<Published>>,
    pub recent: Arc<crate::recent::Recent>,
    task: tokio::task::JoinHandle<()>,
    _gauges: crate::metrics::Gauges,
}

/// Starts the driver for `tools`, with the model-serving instruments.
pub fn start(
    tools: Vec<ToolConfig>,
    timing: Timing,
    deadlines: Deadlines,
    registry: Arc<WorkerRegistry>,
) -> Running {
    let published = Arc::new(Mutex::new(Published::default()));
    let gauges = crate::metrics::gauges(published.clone(), registry.clone());
    let metrics = Arc::new(Metrics::new());
    let recent = metrics.recent.clone();
    let (driver, handle) = Driver::new(
        tools,
        timing,
        deadlines,
        registry,
        metrics,
        published.clone(),
    );
    Running {
        handle,
        published,
        recent,
        task: tokio::spawn(driver.run()),
        _gauges: gauges,
    }
}

impl Running {
    /// Refuses new requests and waits (at most `within`) for the accepted ones to be answered.
    pub async fn finish(self, within: Duration) {
        self.handle.close().await;
        if tokio::time::timeout(within, self.task).await.is_err() {
            tracing::warn!("requests still open after {within:?}; stopping anyway");
        }
    }
}
