//! Runs started over gRPC (`nomad serve`): their state and results, kept in memory. Finished
//! runs beyond a fixed number are forgotten oldest first, so memory stays bounded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use nomad_proto::v1::{Run, RunState};

use crate::rollouts::RolloutResult;

/// Finished runs kept for GetRun.
const KEEP_FINISHED: usize = 256;

struct Entry {
    total: u32,
    finished: bool,
    results: Vec<RolloutResult>,
}

#[derive(Default, Clone)]
pub struct RunRegistry {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, Entry>,
    finished_order: VecDeque<String>,
}

impl RunRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn start(&self, run_id: &str, total: usize) {
        self.lock().runs.insert(
            run_id.to_owned(),
            Entry {
                total: total as u32,
                finished: false,
                results: Vec::with_capacity(total),
            },
        );
    }

    pub fn record(&self, run_id: &str, result: &RolloutResult) {
        if let Some(entry) = self.lock().runs.get_mut(run_id) {
            entry.results.push(result.clone());
        }
    }

    pub fn finish(&self, run_id: &str) {
        let mut inner = self.lock();
        if let Some(entry) = inner.runs.get_mut(run_id) {
            entry.finished = true;
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
        let succeeded = entry.results.iter().filter(|r| r.status == "ok").count() as u32;
        Some(Run {
            run_id: run_id.to_owned(),
            state: if entry.finished {
                RunState::Finished
            } else {
                RunState::Running
            } as i32,
            total: entry.total,
            succeeded,
            failed: entry.results.len() as u32 - succeeded,
            results_json: entry
                .results
                .iter()
                .map(|r| serde_json::to_string(r).expect("results serialize"))
                .collect(),
        })
    }
}
