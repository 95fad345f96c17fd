//! Models a worker can run, behind one small trait, and the errors loading and running them
//! can give.

mod architecture;
mod attention;
mod bert_cpu;
mod chat_template;
pub mod cross;
pub mod decoder;
mod decoder_files;
pub mod embed;
mod encoder;
mod exp;
pub mod generate;
mod gguf;
mod host_attention;
mod length_groups;
mod linear;
mod llama;
mod logins;
pub mod mlp;
pub mod open;
mod options;
mod prefix_cache;
pub mod python;
mod rope_scaling;
mod row;
mod sentence;
pub mod sim;
pub use nomad_sources as source;
mod swiglu;
mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use nomad_proto::v1::{ItemResult, ModelSpec, ToolInput, ToolOutput, item_result, tool_output};

/// A model in memory, on the host or on the worker's device.
pub trait Model: Send + Sync + 'static {
    /// Bytes its weights occupy.
    fn bytes(&self) -> u64;
    /// A copy of this model on `device`.
    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError>;
    /// Runs one batch; invalid inputs get their own `invalid_input` result, the rest run together.
    fn execute(
        &self,
        inputs: &[ToolInput],
        limits: &ExecLimits,
    ) -> Result<Vec<ItemResult>, ExecError>;
    /// A model that serves requests one by one as they come (generation's decode loop).
    fn streaming(&self) -> Option<&dyn Streaming> {
        None
    }
    /// Called on the device copy before it is dropped: a model that lives in another process
    /// moves its weights back to host memory there.
    fn offload(&self) -> Result<(), ExecError> {
        Ok(())
    }
    /// Releases cached, unused device memory the model's own allocator holds; the bytes released
    /// when it knows them.
    fn clear_cache(&self) -> Option<u64> {
        None
    }
}

/// A model whose requests each join a running loop and report as they go.
pub trait Streaming: Send + Sync {
    /// Starts request `index`; its text and its end arrive as events.
    fn start(
        &self,
        index: usize,
        input: &ToolInput,
        limits: &ExecLimits,
    ) -> Result<tokio::sync::mpsc::Receiver<decoder::Event>, StartError>;
}

/// Why a request did not start.
#[derive(Debug)]
pub enum StartError {
    /// Its input was refused (an `invalid_input` result).
    Invalid(ItemResult),
    Exec(ExecError),
}

/// Limits a batch runs under.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExecLimits {
    /// Memory a slot may use (weights plus estimated activations). Past it a batch is refused as
    /// out of memory before it runs, as a device would fail it, so the scheduler's batch halving
    /// runs on CPU too.
    pub memory_budget: Option<u64>,
}

impl ExecLimits {
    pub fn check(
        &self,
        model_bytes: u64,
        activation_bytes: u64,
        batch: usize,
    ) -> Result<(), ExecError> {
        match self.memory_budget {
            Some(budget) if model_bytes.saturating_add(activation_bytes) > budget => {
                Err(ExecError::OutOfMemory(format!(
                    "a batch of {batch} needs about {} bytes (weights {model_bytes} + activations \
                     {activation_bytes}), over the slot's memory budget of {budget}",
                    model_bytes.saturating_add(activation_bytes)
                )))
            }
            _ => Ok(()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("model source {path}: not found ({hint})", hint = source::missing_hint(&.path.to_string_lossy()))]
    NotFound { path: PathBuf },
    #[error("model source {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("unknown model kind {0:?} (this worker runs: {kinds})", kinds = nomad_proto::kinds::names().join(", "))]
    UnknownKind(String),
    #[error(transparent)]
    Source(#[from] source::SourceError),
    #[error("{tool}: {source}")]
    Environment {
        tool: String,
        #[source]
        source: Box<python::EnvError>,
    },
    #[error("{tool}: loading the model in its host failed: {reason}")]
    Host { tool: String, reason: String },
}

#[derive(Debug, Clone, thiserror::Error)]
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
        "embed" => Ok(Arc::new(embed::Embedder::load(path, &Device::Cpu)?)),
        "rerank" => Ok(Arc::new(cross::Scorer::load(
            path,
            &Device::Cpu,
            cross::Task::Rerank,
        )?)),
        "classify" => Ok(Arc::new(cross::Scorer::load(
            path,
            &Device::Cpu,
            cross::Task::Classify,
        )?)),
        "generate" => {
            let config = generate::DecodeConfig {
                max_running: match spec.max_running {
                    0 => generate::DEFAULT_MAX_RUNNING,
                    n => n as usize,
                },
                kv_budget_bytes: (spec.kv_budget_bytes > 0).then_some(spec.kv_budget_bytes),
                dense_prefill: spec.dense_prefill,
            };
            Ok(Arc::new(generate::Generator::load_configured(
                path,
                &Device::Cpu,
                generate::requantize_q4_1(),
                config,
            )?))
        }
        other => Err(LoadError::UnknownKind(other.to_owned())),
    }
}

/// What loading the model of `kind` at `path` would refuse, found from its config files alone
/// (checked when the tool is described, so `nomad up` says it at start-up).
pub fn check(kind: &str, path: &Path) -> Result<(), LoadError> {
    let refused = |reason: String| LoadError::Invalid {
        path: path.to_owned(),
        reason,
    };
    match kind {
        "embed" => embed::Embedder::check(path).map_err(refused),
        "rerank" => cross::Scorer::check(path, cross::Task::Rerank).map_err(refused),
        "classify" => cross::Scorer::check(path, cross::Task::Classify).map_err(refused),
        "generate" => generate::Generator::check(path),
        // An MLP is its weights file alone: reading it is loading it.
        "mlp" => Ok(()),
        // Every kind has its arm: one added to the kinds table without it fails here, in its
        // first test, rather than going unchecked.
        other => Err(LoadError::UnknownKind(other.to_owned())),
    }
}

pub(crate) fn invalid(index: usize, message: impl std::fmt::Display) -> ItemResult {
    ItemResult {
        result: Some(item_result::Result::InvalidInput(format!(
            "request {index}: {message}"
        ))),
        generation: None,
    }
}

/// A vector output (an embedding, an MLP's last layer).
pub(crate) fn vector(values: &[f32]) -> ItemResult {
    ItemResult {
        result: Some(item_result::Result::Output(ToolOutput {
            value: Some(tool_output::Value::Tensor(
                nomad_proto::v1::Tensor::from_f32(values, vec![values.len() as u64]),
            )),
        })),
        generation: None,
    }
}

/// The vector of an output, in tests.
#[cfg(test)]
pub(crate) fn vector_of(result: &ItemResult) -> Vec<f32> {
    match &result.result {
        Some(item_result::Result::Output(ToolOutput {
            value: Some(tool_output::Value::Tensor(t)),
        })) => t.to_f32_vec().unwrap(),
        other => panic!("expected a vector, got {other:?}"),
    }
}

/// The fetched default models (`scripts/fetch-models`), for tests that need them.
#[cfg(test)]
pub(crate) fn test_models_dir() -> PathBuf {
    let dir = std::env::var_os("NOMAD_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    assert!(
        dir.join("all-minilm-l6-v2/model.safetensors").is_file(),
        "the default models are missing from {}: run scripts/fetch-models first",
        dir.display()
    );
    dir
}

/// The device tests run models on: `NOMAD_TEST_DEVICE` (e.g. `cuda:0`), CPU by default.
#[cfg(test)]
pub(crate) fn test_device() -> Device {
    let spec: crate::device::DeviceSpec = std::env::var("NOMAD_TEST_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse()
        .expect("NOMAD_TEST_DEVICE");
    spec.open().expect("opening NOMAD_TEST_DEVICE")
}

#[cfg(test)]
mod tests {
    /// Every built-in kind of the kinds table has its start-up check (a Python model is
    /// described by its host instead); an unknown kind is refused by name.
    #[test]
    fn every_built_in_kind_is_checked_at_start_up() {
        let missing = std::path::Path::new("/nonexistent/model");
        for kind in nomad_proto::kinds::names() {
            if kind == nomad_proto::kinds::PYTHON.name {
                continue;
            }
            let checked = super::check(kind, missing);
            assert!(
                !matches!(checked, Err(super::LoadError::UnknownKind(_))),
                "{kind} has no start-up check"
            );
        }
        assert!(matches!(
            super::check("nope", missing),
            Err(super::LoadError::UnknownKind(_))
        ));
    }
}
