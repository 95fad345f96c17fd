//! Models a worker can run, behind one small trait, and the errors loading and running them
//! can give.

pub mod mlp;
pub mod sim;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use nomad_proto::v1::{ItemResult, ModelSpec, ToolInput, item_result};

/// A model in memory, on the host or on the worker's device.
pub trait Model: Send + Sync + 'static {
    /// Bytes its weights occupy.
    fn bytes(&self) -> u64;
    /// A copy of this model on `device`.
    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError>;
    /// Runs one batch; invalid inputs get their own `invalid_input` result, the rest run together.
    fn execute(&self, inputs: &[ToolInput]) -> Result<Vec<ItemResult>, ExecError>;
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("model source {path}: not found")]
    NotFound { path: PathBuf },
    #[error("model source {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("unknown model kind {0:?} (this worker runs: mlp)")]
    UnknownKind(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The batch does not fit in device memory; the scheduler halves it and retries.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Failed(String),
}

impl From<candle_core::Error> for ExecError {
    fn from(e: candle_core::Error) -> Self {
        let text = e.to_string();
        if text.contains("out of memory") || text.contains("OUT_OF_MEMORY") {
            ExecError::OutOfMemory(text)
        } else {
            ExecError::Failed(text)
        }
    }
}

/// What runs the models: candle, or the simulator.
#[derive(Debug, Clone)]
pub enum Backend {
    Candle,
    Sim(Arc<sim::SimDevice>),
}

/// Reads a model from `spec.source` into host memory.
pub fn load(spec: &ModelSpec, backend: &Backend) -> Result<Arc<dyn Model>, LoadError> {
    if let Backend::Sim(device) = backend {
        return Ok(Arc::new(sim::SimModel::load(&spec.tool, device)));
    }
    let path = Path::new(&spec.source);
    if !path.exists() {
        return Err(LoadError::NotFound {
            path: path.to_owned(),
        });
    }
    match spec.kind.as_str() {
        "mlp" => Ok(Arc::new(mlp::Mlp::load(path)?)),
        other => Err(LoadError::UnknownKind(other.to_owned())),
    }
}

pub(crate) fn invalid(index: usize, message: impl std::fmt::Display) -> ItemResult {
    ItemResult {
        result: Some(item_result::Result::InvalidInput(format!(
            "request {index}: {message}"
        ))),
    }
}
