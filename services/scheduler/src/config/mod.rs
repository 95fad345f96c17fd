//! The scheduler's config: the tools it serves (`tools:` and the original Nomad's
//! `fmod_models:`), read as raw entries and checked into [`ToolConfig`]s, and the
//! `tool_manager:` settings.
//!
//! - `builtin`: a `tools:` entry with a `kind` (a model Nomad runs on candle);
//! - `python`: `fmod_models:` entries and callable `tools:` entries (a model host runs them).

mod builtin;
mod python;

use std::collections::HashSet;
use std::time::Duration;

use nomad_config::ConfigFile;
use nomad_proto::v1::{ModelSpec, PythonModel};
use serde::Deserialize;

pub use self::python::ModelHostConfig;

/// A tool, checked: every default filled in from the manager's settings and the kinds table.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolConfig {
    pub name: String,
    pub kind: String,
    /// Where the weights are, as the workers read it (empty for a Python callable).
    pub source: String,
    /// Where a relative `source` is found from: the config file's directory.
    pub base_dir: String,
    pub description: String,
    pub batch_size: u32,
    /// The batch size comes from the model itself once it is described (a Python model whose
    /// entry gives none).
    pub batch_size_from_model: bool,
    pub max_devices: u32,
    pub max_pending: u32,
    /// How long one batch may run before its worker is treated as lost.
    pub execute_timeout: Duration,
    pub max_batch_bytes: u64,
    pub max_batch_tokens: u64,
    /// Generation: requests decoded together on one worker at most.
    pub max_running: Option<u32>,
    pub kv_budget_bytes: u64,
    pub dense_prefill: bool,
    /// The kind is served continuously (from the kinds table).
    pub continuous: bool,
    /// `tool_manager.oom_regrow_after`.
    pub oom_regrow_after: u32,
    /// A Python model: what the model host loads and in which environment.
    pub python: Option<PythonModel>,
    /// The config's `registries:` (variable names of each registry's login).
    pub registries: nomad_config::registries::Registries,
}

impl ToolConfig {
    /// What a worker needs to load (or describe) this tool.
    pub fn model_spec(&self) -> ModelSpec {
        ModelSpec {
            tool: self.name.clone(),
            kind: self.kind.clone(),
            source: self.source.clone(),
            max_running: self.max_running.unwrap_or(0),
            kv_budget_bytes: self.kv_budget_bytes,
            dense_prefill: self.dense_prefill,
            python: self.python.clone(),
            base_dir: self.base_dir.clone(),
            registries: self
                .registries
                .iter()
                .map(|(registry, login)| {
                    (
                        registry.clone(),
                        nomad_proto::v1::RegistryLogin {
                            username_env: login.username_env.clone(),
                            password_env: login.password_env.clone(),
                        },
                    )
                })
                .collect(),
        }
    }
}

/// Requests a generation tool decodes together on one worker unless configured.
pub const DEFAULT_MAX_RUNNING: u32 = 8;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ToolManagerConfig {
    /// The original Nomad's switch for its tool manager; Nomad always schedules through its
    /// own, so only `true` is accepted.
    pub enabled: bool,
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
    /// How long preparing a slot (offload, load from disk, place) may take; also how long
    /// describing a tool may (a Python model's environment is built then).
    pub prepare_timeout_seconds: f64,
    /// How long an eviction, unload or cache clear may take.
    pub maintain_timeout_seconds: f64,
    /// How many tools one CPU worker serves at once, each in a lane of its own sharing the
    /// worker's cores and its one copy of each model (0: every configured tool). With 1, a tool
    /// waits while another holds the worker (as on a GPU, whose memory holds one at a time).
    pub cpu_tools_at_once: u32,
}

/// Deadlines of the driver's calls to workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadlines {
    pub prepare: Duration,
    pub maintain: Duration,
}

impl Default for ToolManagerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
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
            cpu_tools_at_once: 1,
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

    /// Lanes of a CPU worker, for `tools` configured tools (at least one).
    pub fn cpu_lanes(&self, tools: usize) -> usize {
        match self.cpu_tools_at_once {
            0 => tools,
            n => n as usize,
        }
        .max(1)
    }

    /// The heartbeat interval workers are given (at least 50 ms).
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(u64::from(self.heartbeat_interval_ms.max(50)))
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ToolConfigError {
    #[error("{0}")]
    Timeout(String),
    #[error("{at}: {reason}")]
    Entry { at: String, reason: String },
    /// An entry that does not read as its type (the message names the key path).
    #[error("{0}")]
    Read(String),
    #[error(
        "{at}: tool name `{name}` is taken by {first} too; give one of them another name \
         (`name` in tools, `tool_name` in fmod_models)"
    )]
    Duplicate {
        at: String,
        name: String,
        first: String,
    },
    #[error(
        "tool_manager.enabled: false is not supported: Nomad always schedules through its tool \
         manager (remove the key or set it to true)"
    )]
    ManagerDisabled,
    #[error("config section `{section}`: {reason}")]
    Section { section: String, reason: String },
}

impl ToolConfigError {
    fn entry(at: &str, reason: impl std::fmt::Display) -> Self {
        ToolConfigError::Entry {
            at: at.to_owned(),
            reason: reason.to_string(),
        }
    }
}

/// `nomad-scheduler --check`: loads the config's tools as serving would, says what is wrong
/// on stderr, and exits 0 when nothing is (2 otherwise).
pub fn check(path: Option<&std::path::Path>) -> std::process::ExitCode {
    let checked = ConfigFile::load(path)
        .map_err(anyhow::Error::from)
        .and_then(|file| {
            let manager: ToolManagerConfig = file.section("tool_manager")?;
            manager.deadlines().map_err(anyhow::Error::msg)?;
            load_tools(&file, &manager)?;
            Ok(())
        });
    match checked {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// Every tool of the config: the `tools:` entries in order (built-in kinds and Python callables),
/// then the `fmod_models:` entries; names unique across both.
pub fn load_tools(
    file: &ConfigFile,
    manager: &ToolManagerConfig,
) -> Result<Vec<ToolConfig>, ToolConfigError> {
    if !manager.enabled {
        return Err(ToolConfigError::ManagerDisabled);
    }
    let section = |name: &str, e: nomad_config::ConfigError| ToolConfigError::Section {
        section: name.to_owned(),
        reason: e.to_string(),
    };
    let host: ModelHostConfig = file
        .section("model_host")
        .map_err(|e| section("model_host", e))?;
    let base_dir = file
        .path()
        .and_then(|p| std::path::absolute(p).ok())
        .and_then(|p| p.parent().map(|d| d.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let context = python::Context {
        host: &host,
        base_dir: &base_dir,
        manager,
    };
    let mut tools = Vec::new();
    let entries: Vec<nomad_config::Value> =
        file.section("tools").map_err(|e| section("tools", e))?;
    for (index, entry) in entries.into_iter().enumerate() {
        let at = format!("tools[{index}]");
        let tool = match python::callable_entry(&entry) {
            Some(callable) => python::callable(callable, &at, &context)?,
            None => builtin::tool(&entry, &at, manager, &base_dir)?,
        };
        tools.push((at, tool));
    }
    let models: Vec<nomad_config::Value> = file
        .section("fmod_models")
        .map_err(|e| section("fmod_models", e))?;
    for (index, entry) in models.into_iter().enumerate() {
        let at = format!("fmod_models[{index}]");
        tools.push((at.clone(), python::fmod_model(&entry, &at, &context)?));
    }
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut names = HashSet::new();
    for (at, tool) in &tools {
        if !names.insert(tool.name.clone()) {
            let first = seen
                .iter()
                .find(|(_, n)| *n == tool.name)
                .map(|(a, _)| a.clone())
                .unwrap_or_default();
            return Err(ToolConfigError::Duplicate {
                at: at.clone(),
                name: tool.name.clone(),
                first,
            });
        }
        seen.push((at.clone(), tool.name.clone()));
    }
    if tools.is_empty() {
        tracing::warn!("no tools configured: every call will be rejected as unknown_tool");
    }
    let registries: nomad_config::registries::Registries = file
        .section("registries")
        .map_err(|e| section("registries", e))?;
    nomad_config::registries::check(&registries).map_err(|reason| ToolConfigError::Section {
        section: "registries".into(),
        reason,
    })?;
    Ok(tools
        .into_iter()
        .map(|(_, t)| ToolConfig {
            registries: registries.clone(),
            ..t
        })
        .collect())
}

/// The per-tool settings every kind shares, as an entry gives them (0 and none: the manager's
/// defaults).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Limits {
    pub max_devices: u32,
    pub max_pending: u32,
    pub execute_timeout_seconds: Option<f64>,
    pub max_batch_bytes: Option<u64>,
}

pub(crate) struct CheckedLimits {
    pub max_devices: u32,
    pub max_pending: u32,
    pub execute_timeout: Duration,
    pub max_batch_bytes: u64,
}

impl Limits {
    fn check(
        &self,
        at: &str,
        manager: &ToolManagerConfig,
    ) -> Result<CheckedLimits, ToolConfigError> {
        let execute_timeout = match self.execute_timeout_seconds {
            Some(seconds) => {
                nomad_config::seconds(&format!("{at}.execute_timeout_seconds"), seconds)
            }
            None => nomad_config::seconds(
                "tool_manager.execute_timeout_seconds",
                manager.execute_timeout_seconds,
            ),
        }
        .map_err(ToolConfigError::Timeout)?;
        let max_batch_bytes = self
            .max_batch_bytes
            .unwrap_or(nomad_scheduler_core::DEFAULT_MAX_BATCH_BYTES);
        if max_batch_bytes == 0 {
            return Err(ToolConfigError::entry(
                at,
                "`max_batch_bytes` must be at least 1",
            ));
        }
        Ok(CheckedLimits {
            max_devices: match self.max_devices {
                0 => manager.max_devices_per_tool.max(1),
                n => n,
            },
            max_pending: match self.max_pending {
                0 => manager.max_pending_per_tool.max(1),
                n => n,
            },
            execute_timeout,
            max_batch_bytes,
        })
    }
}

#[cfg(test)]
mod tests;
