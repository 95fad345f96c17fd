//! The `sandbox:` config section.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Python interpreter (a path or a name on PATH).
    pub python: String,
    /// A run's wall time: its tool calls' time waiting in their tools' queues counts too (a run
    /// that calls a busy tool needs room for the queue as well as the model).
    pub timeout_seconds: f64,
    /// Bytes of stdout / stderr kept; the rest is read and dropped.
    pub stdout_limit: usize,
    pub stderr_limit: usize,
    /// Largest RESULT, in bytes of JSON.
    pub result_limit: usize,
    /// Address space of each process; with a cgroup, also the memory of the whole run.
    pub memory_bytes: u64,
    /// Processes (and threads) of one run.
    pub max_processes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
    /// Size of the run's private tmpfs, which holds its workspace and `/tmp`.
    pub disk_bytes: u64,
    /// Files and directories that tmpfs holds.
    pub max_files: u64,
    /// CPU of the whole run, in cores, where a cgroup applies.
    pub cpu_cores: f64,
    /// What all runs may hold in memory together (the PSS of their processes, sampled); a run
    /// is admitted while there is room for one more. Default: half of the machine's memory.
    pub memory_budget_bytes: Option<u64>,
    /// Runs executing at once (every Python the gateway starts, warm ones included, counts).
    /// Default: as many as the memory budget has room for at a run's usual size (32 MiB), from
    /// 4 to 1024.
    pub max_concurrent: Option<usize>,
    /// Runs waiting for one of those; beyond that a call is refused at once.
    pub max_queued: usize,
    /// Runners kept started ahead, isolated and with the interpreter up.
    pub warm: usize,
    /// Start runs by forking them from one isolated interpreter that has the runtime imported
    /// (each child in namespaces of its own), instead of a new interpreter per run. Used where
    /// runs have no cgroup of their own and the fork server passes the start-up self-test.
    pub fork_server: bool,
    /// Modules a warm runner imports while it waits (a cold run imports them on first use).
    pub preload: Vec<String>,
    /// Tool calls one run may have in flight; more wait.
    pub max_calls_in_flight: usize,
    /// Tool calls one run may make in all.
    pub max_tool_calls: u64,
    /// Largest tool call a run may send over the bridge, in bytes of JSON (its arguments).
    pub max_call_bytes: usize,
    /// What all runs' bridges may hold in the gateway at once: bytes read from runs, and each
    /// call's arguments, parsed, until it ends (counted at 32 times their JSON, what parsed
    /// JSON may cost). A run that finds no room waits.
    pub bridge_memory_bytes: u64,
    /// Where the gateway makes its private directory (default: the system temp dir).
    pub workspace_dir: Option<PathBuf>,
    /// Environment passed to the code; nothing else of the gateway's environment is.
    pub env: BTreeMap<String, String>,
    /// Run even where the kernel cannot isolate (no namespaces, no seccomp). Off by default:
    /// start-up then fails, saying which layer is missing.
    pub allow_unisolated: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            // A system interpreter: the unprivileged sandbox user must be able to reach it
            // (one under a home directory, like pyenv's, usually is not).
            python: if Path::new("/usr/bin/python3").is_file() {
                "/usr/bin/python3"
            } else {
                "python3"
            }
            .into(),
            timeout_seconds: 30.0,
            stdout_limit: 64 << 10,
            stderr_limit: 64 << 10,
            result_limit: 65536,
            memory_bytes: 1 << 30,
            max_processes: 64,
            file_size_bytes: 64 << 20,
            open_files: 256,
            disk_bytes: 256 << 20,
            max_files: 16384,
            cpu_cores: 1.0,
            memory_budget_bytes: None,
            max_concurrent: None,
            max_queued: 256,
            warm: 2,
            fork_server: true,
            preload: ["json", "_thread", "inspect", "asyncio"]
                .map(String::from)
                .into(),
            max_calls_in_flight: 16,
            max_tool_calls: 10_000,
            // As much as one gRPC message to the scheduler carries.
            max_call_bytes: 4 << 20,
            bridge_memory_bytes: 1 << 30,
            workspace_dir: None,
            env: BTreeMap::new(),
            allow_unisolated: false,
        }
    }
}

impl SandboxConfig {
    /// Refuses values that cannot work, naming the field.
    pub fn check(&self) -> Result<(), String> {
        nomad_config::seconds("sandbox.timeout_seconds", self.timeout_seconds).and_then(|d| {
            (d.as_secs_f64() <= 86_400.0)
                .then_some(())
                .ok_or_else(|| "sandbox.timeout_seconds must be at most a day (86400)".into())
        })?;
        let at_least = |name: &str, value: u64, min: u64| {
            if value < min {
                Err(format!(
                    "sandbox.{name} must be at least {min}; got {value}"
                ))
            } else {
                Ok(())
            }
        };
        at_least("memory_bytes", self.memory_bytes, 64 << 20)?;
        if let Some(budget) = self.memory_budget_bytes
            && budget < self.memory_bytes
        {
            return Err(format!(
                "sandbox.memory_budget_bytes ({budget}) is less than one run may hold \
                 (sandbox.memory_bytes, {}): raise the budget or lower memory_bytes",
                self.memory_bytes
            ));
        }
        at_least("max_processes", self.max_processes, 4)?;
        at_least("open_files", self.open_files, 16)?;
        at_least("disk_bytes", self.disk_bytes, 1 << 20)?;
        at_least("max_files", self.max_files, 64)?;
        at_least("max_calls_in_flight", self.max_calls_in_flight as u64, 1)?;
        at_least("max_tool_calls", self.max_tool_calls, 1)?;
        at_least("max_call_bytes", self.max_call_bytes as u64, 1024)?;
        if self.max_call_bytes > super::bridge::MAX_FRAME {
            return Err(format!(
                "sandbox.max_call_bytes is {}; the bridge carries at most {} bytes a frame",
                self.max_call_bytes,
                super::bridge::MAX_FRAME
            ));
        }
        if let Some(n) = self.max_concurrent {
            at_least("max_concurrent", n as u64, 1)?;
        }
        if !(self.cpu_cores > 0.0 && self.cpu_cores <= 4096.0) {
            return Err(format!(
                "sandbox.cpu_cores must be greater than 0 and at most 4096; got {}",
                self.cpu_cores
            ));
        }
        for name in &self.preload {
            let ok = !name.is_empty()
                && name.split('.').all(|part| {
                    !part.is_empty() && part.chars().all(|c| c == '_' || c.is_ascii_alphanumeric())
                });
            if !ok {
                return Err(format!("sandbox.preload: {name:?} is not a module name"));
            }
        }
        Ok(())
    }

    /// `max_concurrent`, or twice the cores.
    /// What all runs may hold together: the configured budget, else half of the memory this
    /// gateway may use: the machine's, or its container's limit when lower (4 GiB where
    /// neither can be read).
    pub fn memory_budget(&self) -> u64 {
        self.memory_budget_bytes.unwrap_or_else(|| {
            let machine = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
                let kib = m.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
                Some(kib.split_whitespace().next()?.parse::<u64>().ok()? * 1024)
            });
            let container = super::cgroup::own_memory_max();
            match (machine, container) {
                (Some(m), Some(c)) => m.min(c) / 2,
                (Some(m), None) => m / 2,
                (None, Some(c)) => c / 2,
                (None, None) => 4 << 30,
            }
        })
    }

    /// Runs at once: the configured cap, else what the memory budget holds of runs at their
    /// usual size. Runs that wait on tools hold memory, not CPU, so the core count is no guide.
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent.unwrap_or_else(|| {
            let fits = self.memory_budget() / super::memory::RUN_RESERVE;
            usize::try_from(fits).unwrap_or(usize::MAX).clamp(4, 1024)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_bad_values_name_their_field() {
        assert_eq!(SandboxConfig::default().check(), Ok(()));
        for (config, field) in [
            (
                SandboxConfig {
                    timeout_seconds: 0.0,
                    ..Default::default()
                },
                "timeout_seconds",
            ),
            (
                SandboxConfig {
                    disk_bytes: 10,
                    ..Default::default()
                },
                "disk_bytes",
            ),
            (
                SandboxConfig {
                    max_concurrent: Some(0),
                    ..Default::default()
                },
                "max_concurrent",
            ),
            (
                SandboxConfig {
                    cpu_cores: f64::NAN,
                    ..Default::default()
                },
                "cpu_cores",
            ),
            (
                SandboxConfig {
                    preload: vec!["os; import x".into()],
                    ..Default::default()
                },
                "preload",
            ),
        ] {
            let error = config.check().unwrap_err();
            assert!(error.contains(field), "{field}: {error}");
        }
    }
}
