//! The scheduler's config: the `tools:` it serves and the `tool_manager:` settings.

use std::collections::HashSet;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    pub name: String,
    pub kind: String,
    /// Directory (or file) holding the weights, as the workers see it.
    pub source: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// At most this many device slots hold the tool at once (0: the manager's default).
    #[serde(default)]
    pub max_devices: u32,
    /// At most this many queued requests (0: the manager's default).
    #[serde(default)]
    pub max_pending: u32,
    /// How long one batch of this tool may run (default: the manager's); a worker that takes
    /// longer is treated as lost.
    #[serde(default)]
    pub execute_timeout_seconds: Option<f64>,
    /// Bytes of inputs one batch carries at most (default 16 MiB, under the worker hop's
    /// 64 MiB message limit).
    #[serde(default = "default_max_batch_bytes")]
    pub max_batch_bytes: u64,
    /// Estimated tokens one batch carries at most (UTF-8 bytes / 4 per text input); 0: none.
    #[serde(default)]
    pub max_batch_tokens: u64,
    /// Generation: requests decoded together on one worker at most (default 8).
    #[serde(default)]
    pub max_running: Option<u32>,
    /// Generation: KV cache the running requests on one worker may reserve (0: the worker's
    /// memory budget less the weights, else unbounded).
    #[serde(default)]
    pub kv_budget_bytes: u64,
    /// Generation: prompt rows through f32 copies of the weights (faster prefill on CPU, four
    /// bytes a weight more host memory).
    #[serde(default)]
    pub dense_prefill: bool,
    /// `execute_timeout_seconds` resolved (filled in by [`validate`]).
    #[serde(skip)]
    pub execute_timeout: std::time::Duration,
    /// The kind is served continuously (filled in by [`validate`] from the kinds table).
    #[serde(skip)]
    pub continuous: bool,
    /// `tool_manager.oom_regrow_after` (filled in by [`validate`]).
    #[serde(skip)]
    pub oom_regrow_after: u32,
}

/// Requests a generation tool decodes together on one worker unless configured.
pub const DEFAULT_MAX_RUNNING: u32 = 8;

fn default_batch_size() -> u32 {
    8
}

fn default_max_batch_bytes() -> u64 {
    nomad_scheduler_core::DEFAULT_MAX_BATCH_BYTES
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ToolManagerConfig {
    /// A device slot unused this long gives its allocation back (idle eviction).
    pub idle_seconds: f64,
    /// A tool with no slot, nothing queued and nothing in flight this long leaves host memory.
    pub disk_idle_seconds: f64,
    /// After the whole server is idle this long, accelerator caches are cleared.
    pub gc_idle_seconds: f64,
    /// How long a partial batch may wait to fill while a slot holding the tool is free; 0 (the
    /// default) dispatches it at once: a batch forms while the worker is busy.
    pub max_batch_delay_ms: f64,
    /// Good batches at a size an out-of-memory reduced before it doubles back toward the
    /// configured `batch_size`.
    pub oom_regrow_after: u32,
    /// Default `max_pending` of a tool.
    pub max_pending_per_tool: u32,
    /// Default `max_devices` of a tool.
    pub max_devices_per_tool: u32,
    /// How often workers heartbeat; one silent for three intervals is dropped.
    pub heartbeat_interval_ms: u32,
    /// How long one batch may run on a worker before the worker is treated as lost (its batch
    /// requeued once, as for a dead worker); per tool: `execute_timeout_seconds`.
    pub execute_timeout_seconds: f64,
    /// How long preparing a slot (offload, load from disk, place) may take.
    pub prepare_timeout_seconds: f64,
    /// How long an eviction, unload or cache clear may take.
    pub maintain_timeout_seconds: f64,
}

/// Deadlines of the driver's calls to workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadlines {
    pub prepare: std::time::Duration,
    pub maintain: std::time::Duration,
}

impl Default for ToolManagerConfig {
    fn default() -> Self {
        Self {
            idle_seconds: 300.0,
            disk_idle_seconds: 600.0,
            gc_idle_seconds: 300.0,
            max_batch_delay_ms: 0.0,
            oom_regrow_after: 50,
            max_pending_per_tool: 1024,
            max_devices_per_tool: 1,
            heartbeat_interval_ms: 1000,
            execute_timeout_seconds: 300.0,
            prepare_timeout_seconds: 600.0,
            maintain_timeout_seconds: 60.0,
        }
    }
}

impl ToolManagerConfig {
    /// The core's timers; every duration must be finite and not negative.
    pub fn timing(&self) -> Result<nomad_scheduler_core::Timing, String> {
        let duration = |name: &str, seconds: f64| {
            nomad_config::seconds_or_zero(&format!("tool_manager.{name}"), seconds)
        };
        Ok(nomad_scheduler_core::Timing {
            idle: duration("idle_seconds", self.idle_seconds)?,
            disk_idle: duration("disk_idle_seconds", self.disk_idle_seconds)?,
            gc_idle: duration("gc_idle_seconds", self.gc_idle_seconds)?,
            max_batch_delay: duration("max_batch_delay_ms", self.max_batch_delay_ms / 1000.0)?,
        })
    }

    pub fn deadlines(&self) -> Result<Deadlines, String> {
        let deadline = |name: &str, seconds: f64| {
            nomad_config::seconds(&format!("tool_manager.{name}"), seconds)
        };
        Ok(Deadlines {
            prepare: deadline("prepare_timeout_seconds", self.prepare_timeout_seconds)?,
            maintain: deadline("maintain_timeout_seconds", self.maintain_timeout_seconds)?,
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ToolConfigError {
    #[error("{reason}")]
    Timeout { reason: String },
    #[error("tools[{index}]: `name` is empty")]
    EmptyName { index: usize },
    #[error("tools[{index}] ({name}): tool name appears twice")]
    Duplicate { index: usize, name: String },
    #[error("tools[{index}] ({name}): unknown kind {kind:?}; kinds: {}", nomad_proto::kinds::names().join(", "))]
    UnknownKind {
        index: usize,
        name: String,
        kind: String,
    },
    #[error("tools[{index}] ({name}): `source` is empty")]
    EmptySource { index: usize, name: String },
    #[error(
        "tools[{index}] ({name}): `{field}` applies to continuous kinds (generate), not {kind}"
    )]
    NotContinuous {
        index: usize,
        name: String,
        field: &'static str,
        kind: String,
    },
    #[error("tools[{index}] ({name}): `max_running` must be at least 1")]
    ZeroRunning { index: usize, name: String },
    #[error("tools[{index}] ({name}): `max_batch_bytes` must be at least 1")]
    ZeroBytes { index: usize, name: String },
    #[error("tools[{index}] ({name}): `batch_size` must be at least 1")]
    ZeroBatch { index: usize, name: String },
}

/// Checks every tool and fills per-tool defaults from the manager settings.
pub fn validate(
    mut tools: Vec<ToolConfig>,
    manager: &ToolManagerConfig,
) -> Result<Vec<ToolConfig>, ToolConfigError> {
    let mut seen = HashSet::new();
    for (index, tool) in tools.iter_mut().enumerate() {
        let name = tool.name.clone();
        if name.trim().is_empty() {
            return Err(ToolConfigError::EmptyName { index });
        }
        if !seen.insert(name.clone()) {
            return Err(ToolConfigError::Duplicate { index, name });
        }
        let Some(kind) = nomad_proto::kinds::kind(&tool.kind) else {
            return Err(ToolConfigError::UnknownKind {
                index,
                name,
                kind: tool.kind.clone(),
            });
        };
        tool.continuous = kind.continuous;
        if !kind.continuous {
            let field = match (tool.max_running, tool.kv_budget_bytes, tool.dense_prefill) {
                (Some(_), _, _) => Some("max_running"),
                (None, b, _) if b > 0 => Some("kv_budget_bytes"),
                (None, _, true) => Some("dense_prefill"),
                _ => None,
            };
            if let Some(field) = field {
                return Err(ToolConfigError::NotContinuous {
                    index,
                    name,
                    field,
                    kind: tool.kind.clone(),
                });
            }
        }
        match tool.max_running {
            Some(0) => return Err(ToolConfigError::ZeroRunning { index, name }),
            None if kind.continuous => tool.max_running = Some(DEFAULT_MAX_RUNNING),
            _ => {}
        }
        if tool.source.trim().is_empty() {
            return Err(ToolConfigError::EmptySource { index, name });
        }
        if tool.batch_size == 0 {
            return Err(ToolConfigError::ZeroBatch { index, name });
        }
        if tool.max_devices == 0 {
            tool.max_devices = manager.max_devices_per_tool.max(1);
        }
        tool.execute_timeout = match tool.execute_timeout_seconds {
            Some(seconds) => {
                nomad_config::seconds(&format!("tools[{index}].execute_timeout_seconds"), seconds)
            }
            None => nomad_config::seconds(
                "tool_manager.execute_timeout_seconds",
                manager.execute_timeout_seconds,
            ),
        }
        .map_err(|reason| ToolConfigError::Timeout { reason })?;
        tool.oom_regrow_after = manager.oom_regrow_after.max(1);
        if tool.max_batch_bytes == 0 {
            return Err(ToolConfigError::ZeroBytes { index, name });
        }
        if tool.max_pending == 0 {
            tool.max_pending = manager.max_pending_per_tool.max(1);
        }
    }
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, kind: &str) -> ToolConfig {
        ToolConfig {
            name: name.into(),
            kind: kind.into(),
            source: "/m".into(),
            description: String::new(),
            batch_size: 4,
            max_devices: 0,
            max_pending: 0,
            execute_timeout_seconds: None,
            max_batch_bytes: default_max_batch_bytes(),
            max_batch_tokens: 0,
            max_running: None,
            kv_budget_bytes: 0,
            dense_prefill: false,
            execute_timeout: std::time::Duration::ZERO,
            continuous: false,
            oom_regrow_after: 0,
        }
    }

    #[test]
    fn defaults_come_from_the_manager_and_bad_tools_are_named() {
        let manager = ToolManagerConfig::default();
        let ok = validate(vec![tool("a", "mlp")], &manager).unwrap();
        assert_eq!((ok[0].max_devices, ok[0].max_pending), (1, 1024));
        let err = validate(vec![tool("a", "mlp"), tool("a", "embed")], &manager).unwrap_err();
        assert_eq!(err.to_string(), "tools[1] (a): tool name appears twice");
        let err = validate(vec![tool("b", "vision")], &manager).unwrap_err();
        assert!(err.to_string().contains("unknown kind \"vision\""));
        let mut zero = tool("c", "mlp");
        zero.batch_size = 0;
        assert!(
            validate(vec![zero], &manager)
                .unwrap_err()
                .to_string()
                .contains("batch_size")
        );
    }

    #[test]
    fn generation_is_continuous_with_a_running_bound_and_other_kinds_refuse_one() {
        let manager = ToolManagerConfig::default();
        let ok = validate(vec![tool("g", "generate")], &manager).unwrap();
        assert!(ok[0].continuous);
        assert_eq!(ok[0].max_running, Some(DEFAULT_MAX_RUNNING));
        let mut embed = tool("e", "embed");
        embed.max_running = Some(4);
        assert_eq!(
            validate(vec![embed], &manager).unwrap_err().to_string(),
            "tools[0] (e): `max_running` applies to continuous kinds (generate), not embed"
        );
        let mut mlp = tool("m", "mlp");
        mlp.kv_budget_bytes = 1 << 20;
        assert!(
            validate(vec![mlp], &manager)
                .unwrap_err()
                .to_string()
                .contains("`kv_budget_bytes` applies to continuous kinds")
        );
        let mut dense = tool("e", "embed");
        dense.dense_prefill = true;
        assert!(
            validate(vec![dense], &manager)
                .unwrap_err()
                .to_string()
                .contains("`dense_prefill` applies to continuous kinds")
        );
        let mut zero = tool("g", "generate");
        zero.max_running = Some(0);
        assert!(
            validate(vec![zero], &manager)
                .unwrap_err()
                .to_string()
                .contains("`max_running` must be at least 1")
        );
    }

    #[test]
    fn tools_parse_from_yaml_with_defaults() {
        let file = nomad_config::ConfigFile::from_yaml_str(
            "tools:\n  - name: mlp\n    kind: mlp\n    source: /models/mlp\n",
        );
        let tools: Vec<ToolConfig> = file.section("tools").unwrap();
        assert_eq!(tools[0].batch_size, 8);
        let bad = nomad_config::ConfigFile::from_yaml_str(
            "tools:\n  - name: mlp\n    kind: mlp\n    source: /m\n    batch: 3\n",
        );
        let err = bad
            .section::<Vec<ToolConfig>>("tools")
            .unwrap_err()
            .to_string();
        assert!(err.contains("batch"), "{err}");
    }
}
