//! The boundary every backend implements: a model in memory (`Model`), one that serves requests
//! as they come (`Streaming`, with the events it reports), the limits a batch runs under and the
//! errors loading and running give.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use nomad_proto::kinds::{InputForm, Kind};

/// A tool's model as a load or describe request gives it (the gRPC layer converts it once).
#[derive(Debug, Clone)]
pub struct Spec {
    pub tool: String,
    pub kind: Kind,
    /// Where the weights are (`nomad_sources` reads it); empty for a Python callable.
    pub source: String,
    /// Where a relative `source` is found from.
    pub base_dir: String,
    /// Generation: sequences decoded together at most (`None`: the worker's default).
    pub max_running: Option<usize>,
    /// Generation: KV cache all running sequences may reserve (`None`: the slot's budget).
    pub kv_budget_bytes: Option<u64>,
    /// Generation: also keep the linear weights as f32 for prompt rows.
    pub dense_prefill: bool,
    /// Kind `python`'s own part; always there for that kind.
    pub python: Option<PythonSpec>,
    /// The logins of `oras://` sources' registries (environment variable names).
    pub registries: nomad_config::registries::Registries,
}

impl Spec {
    /// Its source found (cloned, fetched, or read from the Hugging Face cache into `cache`).
    pub async fn resolve(
        &self,
        cache: &std::path::Path,
    ) -> Result<nomad_sources::Resolved, LoadError> {
        Ok(nomad_sources::resolve(&self.source, &self.base_dir, cache, &self.registries).await?)
    }
}

/// A Python model: what its host imports and the environment it runs in.
#[derive(Debug, Clone)]
pub struct PythonSpec {
    pub entry: PythonEntry,
    /// The dotted path of the class or callable (never empty).
    pub target: String,
    /// A callable factory's keyword arguments, a JSON object's text (empty: none).
    pub tool_kwargs_json: String,
    /// PEP 508 requirements of its environment.
    pub requirements: Vec<String>,
    /// The interpreter (`None`: the worker's default).
    pub python: Option<String>,
    pub import_paths: Vec<String>,
    /// How long one batch may run (`None`: the worker's default).
    pub batch_timeout: Option<Duration>,
}

/// What a Python model's target is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PythonEntry {
    /// A TorchModuleTool-like class, batched through preprocess, `_forward` and postprocess.
    ModelClass,
    /// A plain callable, called once per input.
    Callable,
}

/// A model in memory, on the host or on the worker's device.
pub trait Model: Send + Sync + 'static {
    /// Bytes its weights occupy.
    fn bytes(&self) -> u64;
    /// A copy of this model on `device`.
    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError>;
    /// Runs one batch, one answer per input in order: invalid inputs get their own
    /// `Answer::Invalid`, the rest run together (`batch::run`).
    fn execute(&self, inputs: &[Input], limits: &ExecLimits) -> Result<Vec<Answer>, ExecError>;
    /// A model that serves requests one by one as they come (generation's decode loop).
    fn streaming(&self) -> Option<&dyn Streaming> {
        None
    }
    /// A model whose batches run in another process: awaited, holding no thread meanwhile.
    fn hosted(&self) -> Option<&dyn Hosted> {
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

/// A model read again for another device, as `Model::to_device` answers it.
pub fn reloaded<M: Model>(loaded: Result<M, LoadError>) -> Result<Arc<dyn Model>, ExecError> {
    loaded
        .map(|m| Arc::new(m) as Arc<dyn Model>)
        .map_err(|e| ExecError::Failed(e.to_string()))
}

/// A model whose requests each join a running loop and report as they go.
pub trait Streaming: Send + Sync {
    /// Starts request `index`; its text and its end arrive as events.
    fn start(
        &self,
        index: usize,
        input: &Input,
        limits: &ExecLimits,
    ) -> Result<tokio::sync::mpsc::Receiver<Event>, StartError>;
}

/// A model run by another process (a model host): its batch is a message there and back.
pub trait Hosted: Send + Sync {
    /// `Model::execute`, awaited.
    fn execute_hosted<'a>(
        &'a self,
        inputs: &'a [Input],
    ) -> futures::future::BoxFuture<'a, Result<Vec<Answer>, ExecError>>;
}

/// One request of a batch, as the worker reads it (the gRPC layer converts it once; no model
/// sees protobuf).
#[derive(Debug, Clone, PartialEq)]
pub struct Input {
    pub value: Value,
    /// The request's options: a JSON object's text, empty for none; its kind checks them
    /// (`kinds::options`).
    pub options: String,
}

/// What a request holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Text(String),
    /// A tensor's values as f32, row-major, and its shape.
    Tensor {
        values: Vec<f32>,
        shape: Vec<u64>,
    },
    /// A JSON object's text (a Python model's arguments).
    Json(String),
    /// The request held nothing.
    Missing,
    /// A value the worker could not read (a tensor whose bytes do not fit its type and shape):
    /// refused with this message, whatever the kind (`batch::run`).
    Unreadable(String),
}

impl Value {
    /// The form it came in, for the kinds table's rule of what each kind takes.
    pub fn form(&self) -> InputForm {
        match self {
            Value::Text(_) => InputForm::Text,
            // Only a tensor can be unreadable.
            Value::Tensor { .. } | Value::Unreadable(_) => InputForm::Tensor,
            Value::Json(_) => InputForm::Json,
            Value::Missing => InputForm::Missing,
        }
    }
}

/// One request's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Output(Output),
    /// What was wrong with this input, naming it (`request 2: ...`).
    Invalid(String),
    /// The model failed on this input alone; its batch-mates were served.
    Failed(String),
}

/// What a model answers with.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// A vector (an embedding, an MLP's last layer) or a tensor, with its shape.
    Tensor {
        values: Vec<f32>,
        shape: Vec<u64>,
    },
    Text(String),
    /// A generation's text and what it took.
    Generated(Finished),
    /// A JSON document (a ranking, labels, a Python model's output).
    Json(String),
}

/// What a running request reports, in order: text as it is made, then its end.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Result<Finished, ExecError>),
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens copied from a kept cache rather than computed.
    pub cached_prompt_tokens: usize,
    pub completion_tokens: usize,
    /// From submission to the first generated token (queueing and prefill).
    pub time_to_first_token: Duration,
    /// From the first generated token to the end.
    pub decode: Duration,
}

/// Why a request did not start.
#[derive(Debug)]
pub enum StartError {
    /// Its input was refused (an `Answer::Invalid`).
    Invalid(Answer),
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
    #[error("model source {path}: not found ({hint})", hint = nomad_sources::missing_hint(&.path.to_string_lossy()))]
    NotFound { path: PathBuf },
    #[error("model source {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("unknown model kind {0:?} (this worker runs: {kinds})", kinds = nomad_proto::kinds::names().join(", "))]
    UnknownKind(String),
    #[error(transparent)]
    Source(#[from] nomad_sources::SourceError),
    #[error("{tool}: {source}")]
    Environment {
        tool: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
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
