//! A `tools:` entry with a `kind`: a model Nomad runs itself (embed, rerank, classify, generate,
//! mlp).

use serde::Deserialize;

use super::{DEFAULT_MAX_RUNNING, Limits, ToolConfig, ToolConfigError, ToolManagerConfig};

/// The entry as written.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    name: String,
    kind: String,
    /// Directory (or file) holding the weights, as the workers see it (a relative path is
    /// found from the config file's directory).
    source: String,
    #[serde(default)]
    description: String,
    #[serde(default = "default_batch_size")]
    batch_size: u32,
    #[serde(default)]
    max_devices: u32,
    #[serde(default)]
    max_pending: u32,
    #[serde(default)]
    execute_timeout_seconds: Option<f64>,
    /// Bytes of inputs one batch carries at most (default 16 MiB, under the worker hop's
    /// 64 MiB message limit).
    #[serde(default)]
    max_batch_bytes: Option<u64>,
    /// Estimated tokens one batch carries at most (UTF-8 bytes / 4 per text input); 0: none.
    #[serde(default)]
    max_batch_tokens: u64,
    /// Generation: requests decoded together on one worker at most (default 8).
    #[serde(default)]
    max_running: Option<u32>,
    /// Generation: KV cache the running requests on one worker may reserve (0: the worker's
    /// memory budget less the weights, else unbounded).
    #[serde(default)]
    kv_budget_bytes: u64,
    /// Generation: prompt rows through f32 copies of the weights (faster prefill on CPU, four
    /// bytes a weight more host memory).
    #[serde(default)]
    dense_prefill: bool,
}

fn default_batch_size() -> u32 {
    8
}

/// Reads and checks one entry.
pub(super) fn tool(
    entry: &nomad_config::Value,
    at: &str,
    manager: &ToolManagerConfig,
    base_dir: &str,
) -> Result<ToolConfig, ToolConfigError> {
    let raw: RawTool = entry.deserialize().map_err(|e| {
        if entry.as_dict().is_some_and(|d| !d.contains_key("kind")) {
            ToolConfigError::entry(
                at,
                "an entry needs `kind` (a model Nomad runs: embed, rerank, classify, generate, \
                 mlp) or `tool` (the dotted path of a Python callable); a Python model class goes \
                 under `fmod_models:`",
            )
        } else {
            ToolConfigError::Read(nomad_config::explain(&e, at))
        }
    })?;
    check(raw, at, manager, base_dir)
}

fn check(
    raw: RawTool,
    at: &str,
    manager: &ToolManagerConfig,
    base_dir: &str,
) -> Result<ToolConfig, ToolConfigError> {
    let at = format!("{at} ({})", raw.name);
    if raw.name.trim().is_empty() {
        return Err(ToolConfigError::entry(&at, "`name` is empty"));
    }
    let kind = nomad_proto::kinds::kind(&raw.kind)
        .filter(|k| k.name != nomad_proto::kinds::PYTHON.name)
        .ok_or_else(|| {
            ToolConfigError::entry(
                &at,
                format!(
                    "unknown kind {:?}; kinds: {} (a Python model goes under `fmod_models:`, a \
                     Python callable as a `tool:` entry)",
                    raw.kind,
                    nomad_proto::kinds::names()
                        .into_iter()
                        .filter(|k| *k != nomad_proto::kinds::PYTHON.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
    if !kind.continuous {
        let field = match (raw.max_running, raw.kv_budget_bytes, raw.dense_prefill) {
            (Some(_), _, _) => Some("max_running"),
            (None, b, _) if b > 0 => Some("kv_budget_bytes"),
            (None, _, true) => Some("dense_prefill"),
            _ => None,
        };
        if let Some(field) = field {
            return Err(ToolConfigError::entry(
                &at,
                format!(
                    "`{field}` applies to continuous kinds (generate), not {}",
                    kind.name
                ),
            ));
        }
    }
    let max_running = match raw.max_running {
        Some(0) => {
            return Err(ToolConfigError::entry(
                &at,
                "`max_running` must be at least 1",
            ));
        }
        None if kind.continuous => Some(DEFAULT_MAX_RUNNING),
        other => other,
    };
    if raw.source.trim().is_empty() {
        return Err(ToolConfigError::entry(&at, "`source` is empty"));
    }
    if raw.batch_size == 0 {
        return Err(ToolConfigError::entry(
            &at,
            "`batch_size` must be at least 1",
        ));
    }
    let limits = Limits {
        max_devices: raw.max_devices,
        max_pending: raw.max_pending,
        execute_timeout_seconds: raw.execute_timeout_seconds,
        max_batch_bytes: raw.max_batch_bytes,
    }
    .check(&at, manager)?;
    Ok(ToolConfig {
        name: raw.name,
        kind: kind.name.to_owned(),
        source: raw.source,
        base_dir: base_dir.to_owned(),
        description: raw.description,
        batch_size: raw.batch_size,
        batch_size_from_model: false,
        max_devices: limits.max_devices,
        max_pending: limits.max_pending,
        execute_timeout: limits.execute_timeout,
        max_batch_bytes: limits.max_batch_bytes,
        max_batch_tokens: raw.max_batch_tokens,
        max_running,
        kv_budget_bytes: raw.kv_budget_bytes,
        dense_prefill: raw.dense_prefill,
        continuous: kind.continuous,
        oom_regrow_after: manager.oom_regrow_after.max(1),
        python: None,
        registries: Default::default(),
    })
}
