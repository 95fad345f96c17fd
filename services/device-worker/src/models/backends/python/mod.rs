//! The Python backend: a model of the original Nomad's contract (`fmod_models`' TorchModuleTool
//! classes and callable `tools`) run by a model host process in the model's own environment.
//!
//! - `env`: the cached virtual environment of a model's `env` requirements;
//! - `host`: one host process and the frames it speaks;
//! - `frames`: what the frames hold.
//!
//! A host that dies under a batch is started again and the batch runs once more; a second death
//! fails the batch naming how the host ended.

mod env;
mod frames;
mod host;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

pub use self::env::EnvCache;
use self::frames::{Described, FailureKind, Request};
use self::host::{Host, HostError, Launch};
use crate::models::batch;
use crate::models::model::{
    Answer, ExecError, ExecLimits, Hosted, Input, LoadError, Model, PythonEntry, PythonSpec, Spec,
    Value,
};

/// The host program, shipped inside this binary and written into the cache at first use.
const HOST_PROGRAM: &str = include_str!("../../../../../../model-host/nomad_model_host.py");
const HOST_FILE: &str = "nomad_model_host.py";

/// This worker's settings for Python models.
#[derive(Debug, Clone)]
pub struct PythonSettings {
    /// Environments, clones and the host program live here.
    pub cache: PathBuf,
    /// The interpreter a model without its own `python` uses.
    pub python: String,
    /// How long building an environment, or loading a model, may take.
    pub env_timeout: Duration,
    /// `CUDA_VISIBLE_DEVICES` for hosts: this worker's GPU, or none.
    pub visible_devices: String,
    /// Where a placed model goes inside its host: "cuda" (the one GPU it sees) or "cpu".
    pub device: &'static str,
    pub service_name: String,
}

/// What a description gives: the model's own schemas, description and batch size.
#[derive(Debug, Clone, Default)]
pub struct Description {
    pub description: String,
    pub input_schema: String,
    pub output_schema: String,
    pub batch_size: u32,
}

/// A Python spec's own part (the gRPC layer refuses a python spec without one).
fn spec_of(spec: &Spec) -> Result<&PythonSpec, LoadError> {
    spec.python.as_ref().ok_or_else(|| LoadError::Invalid {
        path: spec.source.clone().into(),
        reason: "a python tool's spec has no `python` part".into(),
    })
}

/// The host program in the cache, beside the frame module it imports: one folder per content
/// of the two, written once, so workers of other versions sharing the cache keep their own.
fn host_file(cache: &Path) -> Result<PathBuf, LoadError> {
    use sha2::{Digest as _, Sha256};
    let files = [
        (HOST_FILE, HOST_PROGRAM),
        (nomad_frame::PYTHON_FILE, nomad_frame::PYTHON),
    ];
    let mut digest = Sha256::new();
    for (name, text) in files {
        digest.update(name.as_bytes());
        digest.update([0]);
        digest.update(text.as_bytes());
    }
    let digest: String = digest.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let hosts = cache.join("host");
    let dir = hosts.join(&digest);
    let path = dir.join(HOST_FILE);
    if !path.is_file() {
        // Written whole elsewhere, then renamed into place: a folder seen is a folder complete.
        let write = || -> std::io::Result<()> {
            let partial = hosts.join(format!(".{digest}.{}.partial", std::process::id()));
            std::fs::create_dir_all(&partial)?;
            for (name, text) in files {
                std::fs::write(partial.join(name), text)?;
            }
            match std::fs::rename(&partial, &dir) {
                // Another worker wrote the same folder first.
                Err(_) if path.is_file() => std::fs::remove_dir_all(&partial),
                done => done,
            }
        };
        write().map_err(|e| LoadError::Invalid {
            path: path.clone(),
            reason: format!("writing the model host program: {e}"),
        })?;
    }
    Ok(path)
}

/// Everything a host of `spec` needs before it starts: its source, environment and program.
struct Prepared {
    launch: Launch,
    source: Option<crate::models::source::Resolved>,
}

async fn prepare(
    spec: &Spec,
    python: &PythonSpec,
    settings: &PythonSettings,
) -> Result<Prepared, LoadError> {
    let source = match spec.source.trim() {
        "" => None,
        _ => Some(spec.resolve(&settings.cache).await?),
    };
    let cache = EnvCache {
        root: settings.cache.clone(),
        timeout: settings.env_timeout,
    };
    let interpreter = python.python.as_ref().unwrap_or(&settings.python);
    let interpreter = cache
        .ensure(&spec.tool, interpreter, &python.requirements)
        .await
        .map_err(|source| LoadError::Environment {
            tool: spec.tool.clone(),
            source: Box::new(source),
        })?
        .python;
    Ok(Prepared {
        launch: Launch {
            tool: spec.tool.clone(),
            python: interpreter,
            host_file: host_file(&settings.cache)?,
            import_paths: python.import_paths.iter().map(PathBuf::from).collect(),
            visible_devices: settings.visible_devices.clone(),
            service_name: format!("{}/host/{}", settings.service_name, spec.tool),
        },
        source,
    })
}

impl Prepared {
    /// The host's `load` request for `python` from this source (instantiated, or only imported
    /// when `instantiate` is off).
    fn load_frame(&self, python: &PythonSpec, instantiate: bool) -> Bytes {
        let entry = match python.entry {
            PythonEntry::Callable => "callable",
            PythonEntry::ModelClass => "model_class",
        };
        let source = self.source.as_ref().map(|r| r.path.as_path());
        frames::encode(&Request::Load {
            entry,
            target: &python.target,
            source: source.map(|p| p.to_string_lossy().into_owned()),
            tool_kwargs: frames::kwargs(&python.tool_kwargs_json),
            instantiate,
            device: "cpu",
        })
    }
}

fn host_load_error(tool: &str, e: impl std::fmt::Display) -> LoadError {
    LoadError::Host {
        tool: tool.to_owned(),
        reason: e.to_string(),
    }
}

/// Starts a host and loads the model in it (or, with `instantiate` false, only as far as
/// describing it needs).
async fn start(
    spec: &Spec,
    prepared: &Prepared,
    frame: Bytes,
    timeout: Duration,
) -> Result<(Host, Described), LoadError> {
    let host = Host::start(&prepared.launch).map_err(|e| host_load_error(&spec.tool, e))?;
    let reply = host
        .call(frame, timeout)
        .await
        .map_err(|e| host_load_error(&spec.tool, e))?;
    let described = frames::decode::<Described>(&reply)
        .map_err(|e| host_load_error(&spec.tool, e))?
        .map_err(|failure| host_load_error(&spec.tool, failure.message))?;
    Ok((host, described))
}

/// Describes a Python tool: its environment is built and its class imported (instantiated only
/// when the class alone does not say what it takes).
pub async fn describe(
    spec: &Spec,
    settings: &PythonSettings,
) -> Result<(Description, Option<crate::models::source::Resolved>), LoadError> {
    let python = spec_of(spec)?;
    let prepared = prepare(spec, python, settings).await?;
    let frame = prepared.load_frame(python, false);
    let (host, described) = start(spec, &prepared, frame, settings.env_timeout).await?;
    drop(host);
    Ok((described.into_description(), prepared.source))
}

/// Loads a Python model into a fresh host, on the CPU.
pub async fn load(spec: &Spec, settings: &PythonSettings) -> Result<PythonModel, LoadError> {
    let python = spec_of(spec)?;
    let prepared = prepare(spec, python, settings).await?;
    let frame = prepared.load_frame(python, true);
    let (host, described) = start(spec, &prepared, frame.clone(), settings.env_timeout).await?;
    tracing::info!(tool = %spec.tool, pid = host.pid, python = %prepared.launch.python.display(), name = %described.name, bytes = described.bytes, "model host ready");
    Ok(PythonModel {
        inner: Arc::new(Inner {
            tool: spec.tool.clone(),
            launch: prepared.launch,
            load_frame: frame,
            batch_timeout: python.batch_timeout.unwrap_or(settings.env_timeout),
            load_timeout: settings.env_timeout,
            bytes: described.bytes,
            device: settings.device,
            runtime: tokio::runtime::Handle::current(),
            state: tokio::sync::Mutex::new(State {
                host: Some(host),
                on_device: false,
            }),
        }),
    })
}

/// A model served by a host process; clones share the process.
#[derive(Clone)]
pub struct PythonModel {
    inner: Arc<Inner>,
}

struct Inner {
    tool: String,
    launch: Launch,
    /// The request that loads the model, for a host started again.
    load_frame: Bytes,
    batch_timeout: Duration,
    load_timeout: Duration,
    bytes: u64,
    device: &'static str,
    runtime: tokio::runtime::Handle,
    /// One call at a time: the host answers its frames in order.
    state: tokio::sync::Mutex<State>,
}

struct State {
    /// `None` after the host died, until the next call starts another.
    host: Option<Host>,
    on_device: bool,
}

impl Inner {
    /// The running host, started (and loaded, and placed where the model was) when there is none.
    async fn host<'a>(&self, state: &'a mut State) -> Result<&'a Host, ExecError> {
        if state.host.is_none() {
            let host = Host::start(&self.launch).map_err(|e| ExecError::Failed(e.to_string()))?;
            tracing::info!(tool = %self.tool, pid = host.pid, "model host started again");
            let reply = host
                .call(self.load_frame.clone(), self.load_timeout)
                .await
                .map_err(|e| ExecError::Failed(format!("starting the model host again: {e}")))?;
            frames::decode::<Described>(&reply)
                .map_err(|e| ExecError::Failed(e.to_string()))?
                .map_err(|f| {
                    ExecError::Failed(format!("loading the model again: {}", f.message))
                })?;
            if state.on_device {
                let to = Request::To {
                    device: self.device,
                };
                call::<frames::Empty>(&host, &self.tool, to, self.load_timeout).await?;
            }
            state.host = Some(host);
        }
        Ok(state.host.as_ref().expect("started above"))
    }

    /// One request on the running host; a host that died is forgotten (the next call starts one).
    async fn request<T: serde::de::DeserializeOwned>(
        &self,
        request: Request<'_>,
        timeout: Duration,
    ) -> Result<T, ExecError> {
        let mut state = self.state.lock().await;
        let host = self.host(&mut state).await?;
        let result = call(host, &self.tool, request, timeout).await;
        if let Err(Lost(_)) = &result {
            state.host = None;
        }
        result.map_err(ExecError::from)
    }

    /// `request` from a blocking thread (the store's placing, offloading and cache clearing).
    fn request_blocking<T: serde::de::DeserializeOwned>(
        &self,
        request: Request<'_>,
        timeout: Duration,
    ) -> Result<T, ExecError> {
        self.runtime.block_on(self.request(request, timeout))
    }
}

/// A call's failure: the host's own answer, or the host lost under it.
enum CallError {
    Answered(ExecError),
    Lost(ExecError),
}
use CallError::{Answered, Lost};

impl From<CallError> for ExecError {
    fn from(e: CallError) -> Self {
        match e {
            Answered(e) | Lost(e) => e,
        }
    }
}

/// Sends `request` and reads the host's answer as `T`.
async fn call<T: serde::de::DeserializeOwned>(
    host: &Host,
    tool: &str,
    request: Request<'_>,
    timeout: Duration,
) -> Result<T, CallError> {
    let reply = host
        .call(frames::encode(&request), timeout)
        .await
        .map_err(|e| Lost(ExecError::Failed(format!("{tool}: {e}"))))?;
    answer(tool, &reply).map_err(Answered)
}

/// The host's answer as `T`, or its failure as an execution error.
fn answer<T: serde::de::DeserializeOwned>(tool: &str, reply: &[u8]) -> Result<T, ExecError> {
    match frames::decode::<T>(reply) {
        Err(e) => Err(ExecError::Failed(format!("{tool}: {e}"))),
        Ok(Ok(value)) => Ok(value),
        Ok(Err(failure)) => Err(match failure.kind {
            FailureKind::OutOfMemory => ExecError::OutOfMemory(failure.message),
            FailureKind::Failed | FailureKind::BadRequest => ExecError::Failed(failure.message),
        }),
    }
}

impl Model for PythonModel {
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }

    fn to_device(&self, _device: &candle_core::Device) -> Result<Arc<dyn Model>, ExecError> {
        let inner = &self.inner;
        let to = Request::To {
            device: inner.device,
        };
        inner.request_blocking::<frames::Empty>(to, inner.load_timeout)?;
        inner.state.blocking_lock().on_device = true;
        Ok(Arc::new(self.clone()))
    }

    fn offload(&self) -> Result<(), ExecError> {
        let inner = &self.inner;
        if !inner.state.blocking_lock().on_device {
            return Ok(());
        }
        inner
            .request_blocking::<frames::Empty>(Request::To { device: "cpu" }, inner.load_timeout)?;
        inner.state.blocking_lock().on_device = false;
        Ok(())
    }

    fn clear_cache(&self) -> Option<u64> {
        let inner = &self.inner;
        inner
            .request_blocking::<frames::Released>(Request::ClearCache, inner.load_timeout)
            .ok()
            .and_then(|r| r.released_bytes)
    }

    /// From a blocking thread; the worker awaits `execute_hosted` instead.
    fn execute(&self, inputs: &[Input], _limits: &ExecLimits) -> Result<Vec<Answer>, ExecError> {
        self.inner.runtime.block_on(self.execute_hosted(inputs))
    }

    fn hosted(&self) -> Option<&dyn Hosted> {
        Some(self)
    }
}

impl Hosted for PythonModel {
    fn execute_hosted<'a>(
        &'a self,
        inputs: &'a [Input],
    ) -> futures::future::BoxFuture<'a, Result<Vec<Answer>, ExecError>> {
        Box::pin(async move {
            let (items, places) = batch::split(inputs, |index, input| {
                arguments(input).map_err(|message| batch::invalid(index, message))
            });
            if items.is_empty() {
                return places.join(Vec::new());
            }
            let trace =
                nomad_telemetry::propagation::inject_map(&nomad_telemetry::Context::current());
            let frame = frames::encode(&Request::Batch {
                items: &items,
                trace,
            });
            let batch = self.run_with_restart(&frame).await?;
            if batch.results.len() != items.len() {
                return Err(ExecError::Failed(format!(
                    "{}: the model host answered {} results for {} inputs",
                    self.inner.tool,
                    batch.results.len(),
                    items.len()
                )));
            }
            let answers = places
                .positions()
                .iter()
                .zip(batch.results)
                .map(|(&position, item)| item.into_answer(position))
                .collect();
            places.join(answers)
        })
    }
}

impl PythonModel {
    /// Runs a batch; a host that dies under it is started again and the batch runs once more.
    async fn run_with_restart(&self, frame: &Bytes) -> Result<frames::Batch, ExecError> {
        let inner = &self.inner;
        let tool = &inner.tool;
        let mut first_death: Option<String> = None;
        loop {
            let mut state = inner.state.lock().await;
            let host = inner.host(&mut state).await?;
            let how = match host.call(frame.clone(), inner.batch_timeout).await {
                Ok(reply) => return answer(tool, &reply),
                Err(HostError::Exited(how)) => how,
                Err(e) => {
                    state.host = None;
                    return Err(ExecError::Failed(format!("{tool}: {e}")));
                }
            };
            state.host = None;
            drop(state);
            if let Some(first) = first_death {
                return Err(ExecError::Failed(format!(
                    "{tool}: the model host exited ({first}) under this batch, and again ({how}) \
                     when it ran once more on a new host; see the worker's log for its output"
                )));
            }
            tracing::warn!(%tool, exit = %how, "the model host died under a batch; starting it again and running the batch once more");
            first_death = Some(how);
        }
    }
}

/// A request's JSON arguments, checked to be one JSON object.
fn arguments(input: &Input) -> Result<Box<serde_json::value::RawValue>, String> {
    if let Some(refusal) = nomad_proto::kinds::PYTHON.input_refusal(input.value.form()) {
        return Err(refusal);
    }
    let Value::Json(text) = &input.value else {
        return Err("no arguments: a Python tool takes a JSON object of arguments (`json`)".into());
    };
    let raw: Box<serde_json::value::RawValue> =
        serde_json::from_str(text).map_err(|e| format!("the arguments are not valid JSON: {e}"))?;
    if !raw.get().trim_start().starts_with('{') {
        return Err("the arguments must be a JSON object".into());
    }
    Ok(raw)
}
