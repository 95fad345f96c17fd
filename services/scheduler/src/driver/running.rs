//! Starting the driver with the model-serving instruments, and finishing it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Driver, Handle};
use crate::config::{ToolConfig, ToolManagerConfig};
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
    manager: &ToolManagerConfig,
    registry: Arc<WorkerRegistry>,
) -> anyhow::Result<Running> {
    let timing = manager.timing().map_err(anyhow::Error::msg)?;
    let deadlines = manager.deadlines().map_err(anyhow::Error::msg)?;
    let cpu_lanes = manager.cpu_lanes(tools.len());
    let published = Arc::new(Mutex::new(Published::default()));
    let gauges = crate::metrics::gauges(published.clone(), registry.clone());
    let metrics = Arc::new(Metrics::new());
    let recent = metrics.recent.clone();
    let (driver, handle) = Driver::new(
        tools,
        timing,
        deadlines,
        cpu_lanes,
        registry,
        metrics,
        published.clone(),
    );
    Ok(Running {
        handle,
        published,
        recent,
        task: tokio::spawn(driver.run()),
        _gauges: gauges,
    })
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
