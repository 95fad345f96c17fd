//! Runs started over gRPC (`nomad head`): their state, counts and latest results. Every result
//! also goes to `<runs dir>/<run id>/results.jsonl`; memory keeps only the last few per run,
//! at most `max_live_runs` runs go at once, and finished runs beyond a fixed number are
//! forgotten oldest first.

use std::collections::{HashMap, VecDeque};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nomad_proto::v1::{Run, RunState};
use serde::Deserialize;

use crate::rollouts::RolloutResult;

/// Finished runs kept for GetRun.
const KEEP_FINISHED: usize = 256;

/// The `head:` config section: bounds on what `StartRun` accepts and keeps.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_tasks_per_run: usize,
    pub max_concurrency: usize,
    pub max_live_runs: usize,
    /// Results of a run kept in memory for GetRun; all of them are on disk.
    pub results_in_memory: usize,
    /// Where each run's results file goes (`<runs_dir>/<run id>/results.jsonl`).
    pub runs_dir: PathBuf,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_tasks_per_run: 10_000,
            max_concurrency: 256,
            max_live_runs: 16,
            results_in_memory: 100,
            runs_dir: PathBuf::from("runs"),
        }
    }
}

/// Why a run was not started.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Refusal {
    #[error(
        "{given} tasks in one StartRun; the limit is {limit} (head.max_tasks_per_run): split the tasks over several runs"
    )]
    TooManyTasks { given: usize, limit: usize },
    #[error("concurrency {given} is over the limit of {limit} (head.max_concurrency)")]
    Concurrency { given: usize, limit: usize },
    #[error("{limit} runs are going already (head.max_live_runs); start this one when one ends")]
    TooManyRuns { limit: usize },
    #[error("creating the results file: {0}")]
    Disk(String),
}

struct Entry {
    total: u32,
    finished: bool,
    succeeded: u32,
    failed: u32,
    recent: VecDeque<String>,
    path: PathBuf,
    file: Option<std::fs::File>,
}

#[derive(Clone)]
pub struct RunRegistry {
    inner: Arc<Mutex<Inner>>,
    limits: Arc<Limits>,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, Entry>,
    finished_order: VecDeque<String>,
}

impl RunRegistry {
    pub fn new(limits: Limits) -> Self {
        Self {
            inner: Arc::default(),
            limits: Arc::new(limits),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks a run against the limits and registers it with its results file.
    pub fn start(&self, run_id: &str, total: usize, concurrency: usize) -> Result<(), Refusal> {
        let limits = &self.limits;
        if total > limits.max_tasks_per_run {
            return Err(Refusal::TooManyTasks {
                given: total,
                limit: limits.max_tasks_per_run,
            });
        }
        if concurrency > limits.max_concurrency {
            return Err(Refusal::Concurrency {
                given: concurrency,
                limit: limits.max_concurrency,
            });
        }
        let mut inner = self.lock();
        let live = inner.runs.values().filter(|e| !e.finished).count();
        if live >= limits.max_live_runs {
            return Err(Refusal::TooManyRuns {
                limit: limits.max_live_runs,
            });
        }
        let path = results_path(&limits.runs_dir, run_id);
        let file = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::File::create(&path))
            .map_err(|e| Refusal::Disk(format!("{}: {e}", path.display())))?;
        inner.runs.insert(
            run_id.to_owned(),
            Entry {
                total: total as u32,
                finished: false,
                succeeded: 0,
                failed: 0,
                recent: VecDeque::new(),
                path,
                file: Some(file),
            },
        );
        Ok(())
    }

    pub fn record(&self, run_id: &str, result: &RolloutResult) {
        let keep = self.limits.results_in_memory;
        let mut inner = self.lock();
        let Some(entry) = inner.runs.get_mut(run_id) else {
            return;
        };
        if result.status == "ok" {
            entry.succeeded += 1;
        } else {
            entry.failed += 1;
        }
        let line = serde_json::to_string(result).expect("results serialize");
        if let Some(file) = &mut entry.file
            && let Err(e) = writeln!(file, "{line}")
        {
            tracing::warn!(%run_id, "writing {}: {e}; later results are kept in memory only", entry.path.display());
            entry.file = None;
        }
        entry.recent.push_back(line);
        while entry.recent.len() > keep {
            entry.recent.pop_front();
        }
    }

    pub fn finish(&self, run_id: &str) {
        let mut inner = self.lock();
        if let Some(entry) = inner.runs.get_mut(run_id) {
            entry.finished = true;
            entry.file = None;
            inner.finished_order.push_back(run_id.to_owned());
        }
        while inner.finished_order.len() > KEEP_FINISHED {
            if let Some(old) = inner.finished_order.pop_front() {
                inner.runs.remove(&old);
            }
        }
    }

    pub fn get(&self, run_id: &str) -> Option<Run> {
        let inner = self.lock();
        let entry = inner.runs.get(run_id)?;
        Some(Run {
            run_id: run_id.to_owned(),
            state: if entry.finished {
                RunState::Finished
            } else {
                RunState::Running
            } as i32,
            total: entry.total,
            succeeded: entry.succeeded,
            failed: entry.failed,
            results_json: entry.recent.iter().cloned().collect(),
            results_path: entry.path.display().to_string(),
        })
    }
}

fn results_path(runs_dir: &Path, run_id: &str) -> PathBuf {
    runs_dir.join(run_id).join("results.jsonl")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(i: usize, ok: bool) -> RolloutResult {
        RolloutResult {
            task_id: format!("t{i}"),
            rollout_id: format!("r{i}"),
            run_id: "run".into(),
            trace_id: String::new(),
            status: if ok { "ok" } else { "error" }.into(),
            reward: None,
            passed: None,
            output: None,
            expected: None,
            error: None,
            tool_calls: None,
            durations: crate::rollouts::Durations {
                agent_seconds: 0.0,
                verify_seconds: 0.0,
                total_seconds: 0.0,
            },
        }
    }

    #[test]
    fn limits_refuse_naming_themselves_and_memory_keeps_the_last_results() {
        let dir = std::env::temp_dir().join(format!("nomad-runs-{}", uuid::Uuid::new_v4()));
        let registry = RunRegistry::new(Limits {
            max_tasks_per_run: 10,
            max_concurrency: 4,
            max_live_runs: 1,
            results_in_memory: 3,
            runs_dir: dir.clone(),
        });
        let e = registry.start("a", 11, 1).unwrap_err();
        assert!(e.to_string().contains("head.max_tasks_per_run"), "{e}");
        let e = registry.start("a", 5, 5).unwrap_err();
        assert!(e.to_string().contains("head.max_concurrency"), "{e}");
        registry.start("a", 10, 2).unwrap();
        let e = registry.start("b", 1, 1).unwrap_err();
        assert!(e.to_string().contains("head.max_live_runs"), "{e}");
        for i in 0..10 {
            registry.record("a", &result(i, i % 2 == 0));
        }
        let run = registry.get("a").unwrap();
        assert_eq!((run.succeeded, run.failed), (5, 5));
        assert_eq!(run.results_json.len(), 3, "only the last 3 in memory");
        assert!(run.results_json[2].contains("\"t9\""));
        registry.finish("a");
        let on_disk = std::fs::read_to_string(&run.results_path).unwrap();
        assert_eq!(on_disk.lines().count(), 10, "every result on disk");
        registry.start("b", 1, 1).unwrap();
        let _ = std::fs::remove_dir_all(dir);
    }
}
