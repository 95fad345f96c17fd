//! Opening a model from its spec: the source found (cloned, or read from the Hugging Face cache)
//! first, then the backend that runs its kind — candle for the built-in kinds, a model host for
//! `python`, the simulator under `--backend sim`.

use std::path::Path;
use std::sync::Arc;

use nomad_proto::kinds::Kind;

use crate::models::backends::python::{self, PythonSettings};
use crate::models::load::{self, Backend};
use crate::models::model::{LoadError, Model, Spec};

/// What describing a tool found.
#[derive(Debug, Default)]
pub struct Described {
    /// A Python model's own schemas, description and batch size (empty for a built-in kind).
    pub own: python::Description,
    /// The README.md of the model's directory.
    pub model_card: Option<String>,
    /// The source pinned to what was read (a commit, a digest), or empty.
    pub pinned_source: String,
}

/// The longest model card a description carries.
const MAX_MODEL_CARD: u64 = 1 << 20;

/// Reads a model from its source into host memory.
pub async fn open(
    mut spec: Spec,
    backend: Arc<Backend>,
    settings: &PythonSettings,
) -> Result<Arc<dyn Model>, LoadError> {
    if !matches!(*backend, Backend::Sim(_)) {
        if spec.kind == Kind::Python {
            return Ok(Arc::new(python::load(&spec, settings).await?));
        }
        let resolved = spec.resolve(&settings.cache).await?;
        spec.source = resolved.path.to_string_lossy().into_owned();
    }
    off_thread("loading", move || load::load(&spec, &backend)).await
}

/// `work` on the blocking pool (it reads files and builds tokenizers), off the async threads.
async fn off_thread<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T, LoadError> + Send + 'static,
) -> Result<T, LoadError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| LoadError::Host {
            tool: String::new(),
            reason: format!("the {what} task failed: {e}"),
        })?
}

/// What a tool is, without loading it: for a Python model its own schemas and description (its
/// environment built and its class imported), for every kind its model card; a source that is
/// missing fails here, as loading it would.
pub async fn describe(
    spec: &Spec,
    backend: &Backend,
    settings: &PythonSettings,
) -> Result<Described, LoadError> {
    if matches!(backend, Backend::Sim(_)) {
        return Ok(Described::default());
    }
    let kind = spec.kind;
    let (description, resolved) = if kind == Kind::Python {
        python::describe(spec, settings).await?
    } else {
        let resolved = spec.resolve(&settings.cache).await?;
        let path = resolved.path.clone();
        off_thread("checking", move || load::check(kind, &path)).await?;
        (python::Description::default(), Some(resolved))
    };
    Ok(Described {
        model_card: resolved.as_ref().and_then(|r| model_card(&r.path)),
        pinned_source: resolved.map(|r| r.pinned).unwrap_or_default(),
        own: description,
    })
}

/// The README.md of a model directory (cut at [`MAX_MODEL_CARD`]).
fn model_card(dir: &Path) -> Option<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(dir.join("README.md")).ok()?;
    let mut text = Vec::new();
    file.take(MAX_MODEL_CARD).read_to_end(&mut text).ok()?;
    Some(String::from_utf8_lossy(&text).into_owned())
}
