//! The original Nomad's Python tools: `fmod_models:` entries (a TorchModuleTool-like class with
//! `from_pretrained`) and callable `tools:` entries (a dotted path, or `tool:` with `name` and
//! `tool_kwargs`), with Nomad's additions: `env` (the model's own environment), `python` and the
//! scheduling limits every tool has. `model_host:` holds the fleet-wide defaults.

use nomad_proto::v1::PythonModel;
use nomad_proto::v1::python_model::Entry;
use serde::Deserialize;

use super::{Limits, ToolConfig, ToolConfigError, ToolManagerConfig};

/// Fleet-wide settings of Python tools.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelHostConfig {
    /// The interpreter of Python tools that name none (default: the worker's, `python3`).
    pub python: Option<String>,
}

/// `env`: one PEP 508 requirement, a list of them, or a requirements file (`requirements.txt`,
/// `pyproject.toml`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
enum Requirements {
    One(String),
    Many(Vec<String>),
}

impl Requirements {
    fn into_vec(self) -> Vec<String> {
        match self {
            Requirements::One(r) => vec![r],
            Requirements::Many(rs) => rs,
        }
    }
}

/// One `fmod_models:` entry, with the original's keys first.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FmodModel {
    /// Dotted path of a class with a `from_pretrained` constructor.
    model_class: String,
    /// Where its weights are (passed to `from_pretrained` once resolved).
    name_or_path: String,
    /// The tool's name (default: the class name).
    tool_name: Option<String>,
    /// Inputs one batch holds at most (default: the model's own `batch_size`).
    batch_size: Option<u32>,
    /// The model's environment: PEP 508 requirements (or a requirements file) installed into a
    /// cached virtualenv.
    env: Option<Requirements>,
    /// The interpreter of that environment (or of the host, without `env`).
    python: Option<String>,
    /// Overrides the model's own description.
    description: Option<String>,
    #[serde(default)]
    max_devices: u32,
    #[serde(default)]
    max_pending: u32,
    execute_timeout_seconds: Option<f64>,
    max_batch_bytes: Option<u64>,
}

/// One callable `tools:` entry in its long form.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CallableTool {
    /// Dotted path of the callable (or of a factory, with `tool_kwargs`).
    tool: String,
    name: Option<String>,
    /// Keyword arguments the factory is called with.
    tool_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    env: Option<Requirements>,
    python: Option<String>,
    description: Option<String>,
    /// Calls sent to the host together (run one after another there; default 16).
    batch_size: Option<u32>,
    #[serde(default)]
    max_devices: u32,
    #[serde(default)]
    max_pending: u32,
    execute_timeout_seconds: Option<f64>,
    max_batch_bytes: Option<u64>,
}

/// Calls of a callable sent to its host together unless the entry says otherwise.
const CALLABLE_BATCH: u32 = 16;

/// What every Python entry is read against.
pub(super) struct Context<'a> {
    pub host: &'a ModelHostConfig,
    pub base_dir: &'a str,
    pub manager: &'a ToolManagerConfig,
}

/// The original's tool-name rule: ASCII letters and digits kept, `.` -> `p`, `/` and `\` ->
/// `---`, anything else `_`.
pub fn sanitize_mcp_name(raw: &str) -> String {
    raw.chars()
        .map(|c| match c {
            c if c.is_ascii_alphanumeric() => c.to_string(),
            '.' => "p".into(),
            '/' | '\\' => "---".into(),
            _ => "_".into(),
        })
        .collect()
}

/// A `tools:` entry that is a callable: a bare string, or a mapping with `tool`.
pub(super) fn callable_entry(entry: &nomad_config::Value) -> Option<&nomad_config::Value> {
    match entry {
        nomad_config::Value::String(..) => Some(entry),
        nomad_config::Value::Dict(_, dict) if dict.contains_key("tool") => Some(entry),
        _ => None,
    }
}

fn dotted(at: &str, field: &str, path: &str) -> Result<(), ToolConfigError> {
    let ok = path.contains('.')
        && path
            .split('.')
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || c == '_'));
    if ok {
        Ok(())
    } else {
        Err(ToolConfigError::entry(
            at,
            format!("`{field}` must be a dotted path (package.module.Name); got {path:?}"),
        ))
    }
}

/// A Python entry as read, before it is checked.
struct Parts {
    name: String,
    source: String,
    description: Option<String>,
    batch_size: Option<u32>,
    limits: Limits,
    entry: Entry,
    target: String,
    kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    env: Option<Requirements>,
    python: Option<String>,
}

/// Checks `parts`; without a `batch_size`, a callable takes `default_batch` and a model class
/// (`None`) the one the model reports when it is described.
fn python_tool(
    parts: Parts,
    default_batch: Option<u32>,
    at: &str,
    context: &Context<'_>,
) -> Result<ToolConfig, ToolConfigError> {
    if parts.name.trim().is_empty() {
        return Err(ToolConfigError::entry(at, "the tool name is empty"));
    }
    if parts.batch_size == Some(0) {
        return Err(ToolConfigError::entry(
            at,
            "`batch_size` must be at least 1",
        ));
    }
    let limits = parts.limits.check(at, context.manager)?;
    let requirements = match parts.env {
        Some(Requirements::One(file)) if nomad_config::requirements::is_file(&file) => {
            nomad_config::requirements::read(&file, context.base_dir)
                .map_err(|e| ToolConfigError::entry(at, e))?
        }
        env => env.map(Requirements::into_vec).unwrap_or_default(),
    };
    if requirements.iter().any(|r| r.trim().is_empty()) {
        return Err(ToolConfigError::entry(
            at,
            "`env` holds an empty requirement",
        ));
    }
    let python = PythonModel {
        entry: parts.entry as i32,
        target: parts.target,
        tool_kwargs_json: parts
            .kwargs
            .map(|k| serde_json::Value::Object(k).to_string())
            .unwrap_or_default(),
        requirements,
        python: parts
            .python
            .or_else(|| context.host.python.clone())
            .unwrap_or_default(),
        import_paths: if context.base_dir.is_empty() {
            Vec::new()
        } else {
            vec![context.base_dir.to_owned()]
        },
        // The host stops a batch a little before the scheduler gives up on the worker, so the
        // caller hears why.
        batch_timeout_ms: limits.execute_timeout.mul_f64(0.9).as_millis() as u64,
    };
    Ok(ToolConfig {
        name: parts.name,
        kind: nomad_proto::kinds::PYTHON.name.to_owned(),
        source: parts.source,
        base_dir: context.base_dir.to_owned(),
        description: parts.description.unwrap_or_default(),
        batch_size: parts.batch_size.or(default_batch).unwrap_or(1),
        batch_size_from_model: parts.batch_size.is_none() && default_batch.is_none(),
        max_devices: limits.max_devices,
        max_pending: limits.max_pending,
        execute_timeout: limits.execute_timeout,
        max_batch_bytes: limits.max_batch_bytes,
        max_batch_tokens: 0,
        max_running: None,
        kv_budget_bytes: 0,
        dense_prefill: false,
        continuous: false,
        oom_regrow_after: context.manager.oom_regrow_after.max(1),
        python: Some(python),
        registries: Default::default(),
    })
}

pub(super) fn fmod_model(
    entry: &nomad_config::Value,
    at: &str,
    context: &Context<'_>,
) -> Result<ToolConfig, ToolConfigError> {
    let raw: FmodModel = entry
        .deserialize()
        .map_err(|e| ToolConfigError::Read(nomad_config::explain(&e, at)))?;
    dotted(at, "model_class", &raw.model_class)?;
    if raw.name_or_path.trim().is_empty() {
        return Err(ToolConfigError::entry(at, "`name_or_path` is empty"));
    }
    let class = raw.model_class.rsplit('.').next().unwrap_or_default();
    let name = match (&raw.tool_name, raw.name_or_path.strip_prefix("hf://")) {
        (Some(name), _) => sanitize_mcp_name(name),
        // As the original names a model from the Hugging Face hub: by its repository.
        (None, Some(repo)) => sanitize_mcp_name(repo.split(['@', '#']).next().unwrap_or(repo)),
        (None, None) => sanitize_mcp_name(class),
    };
    let at = format!("{at} ({name})");
    let parts = Parts {
        name,
        source: raw.name_or_path,
        description: raw.description,
        batch_size: raw.batch_size,
        limits: Limits {
            max_devices: raw.max_devices,
            max_pending: raw.max_pending,
            execute_timeout_seconds: raw.execute_timeout_seconds,
            max_batch_bytes: raw.max_batch_bytes,
        },
        entry: Entry::ModelClass,
        target: raw.model_class,
        kwargs: None,
        env: raw.env,
        python: raw.python,
    };
    python_tool(parts, None, &at, context)
}

pub(super) fn callable(
    entry: &nomad_config::Value,
    at: &str,
    context: &Context<'_>,
) -> Result<ToolConfig, ToolConfigError> {
    let raw = match entry {
        nomad_config::Value::String(_, path) => {
            dotted(at, "tool", path)?;
            CallableTool {
                name: Some(sanitize_mcp_name(path.rsplit('.').next().unwrap_or(path))),
                tool: path.clone(),
                tool_kwargs: None,
                env: None,
                python: None,
                description: None,
                batch_size: None,
                max_devices: 0,
                max_pending: 0,
                execute_timeout_seconds: None,
                max_batch_bytes: None,
            }
        }
        _ => entry
            .deserialize::<CallableTool>()
            .map_err(|e| ToolConfigError::Read(nomad_config::explain(&e, at)))?,
    };
    dotted(at, "tool", &raw.tool)?;
    // The original names a callable entry without `name` by its whole dotted path.
    let name = raw
        .name
        .clone()
        .unwrap_or_else(|| sanitize_mcp_name(&raw.tool));
    let at = format!("{at} ({name})");
    let parts = Parts {
        name,
        source: String::new(),
        description: raw.description,
        batch_size: raw.batch_size,
        limits: Limits {
            max_devices: raw.max_devices,
            max_pending: raw.max_pending,
            execute_timeout_seconds: raw.execute_timeout_seconds,
            max_batch_bytes: raw.max_batch_bytes,
        },
        entry: Entry::Callable,
        target: raw.tool,
        kwargs: raw.tool_kwargs,
        env: raw.env,
        python: raw.python,
    };
    python_tool(parts, Some(CALLABLE_BATCH), &at, context)
}
