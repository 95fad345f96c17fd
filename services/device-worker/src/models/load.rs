//! A spec made into a model: the backend that runs its kind, chosen by one exhaustive match over
//! `Kind`, so a kind added to the kinds table does not compile until it has its loader and its
//! start-up check here.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use nomad_proto::kinds::Kind;

use crate::models::backends::sim;
use crate::models::kinds::{cross, embed, generate, mlp};
use crate::models::model::{LoadError, Model, Spec};

/// What runs the models: the worker's own passes and candle, or the simulator.
#[derive(Debug, Clone)]
pub enum Backend {
    Candle,
    Sim(Arc<sim::SimDevice>),
}

/// Reads a built-in kind's model from `spec.source` into host memory (a Python model is opened
/// by its host: `open`).
pub fn load(spec: &Spec, backend: &Backend) -> Result<Arc<dyn Model>, LoadError> {
    if let Backend::Sim(device) = backend {
        return Ok(Arc::new(sim::SimModel::load(&spec.tool, device)));
    }
    let path = Path::new(&spec.source);
    if !path.exists() {
        return Err(LoadError::NotFound {
            path: path.to_owned(),
        });
    }
    let cpu = &Device::Cpu;
    Ok(match spec.kind {
        Kind::Mlp => Arc::new(mlp::Mlp::load(path)?),
        Kind::Embed => Arc::new(embed::Embedder::load(path, cpu)?),
        Kind::Rerank => Arc::new(cross::Scorer::load(path, cpu, cross::Task::Rerank)?),
        Kind::Classify => Arc::new(cross::Scorer::load(path, cpu, cross::Task::Classify)?),
        Kind::Generate => {
            let config = generate::DecodeConfig {
                max_running: spec.max_running.unwrap_or(generate::DEFAULT_MAX_RUNNING),
                kv_budget_bytes: spec.kv_budget_bytes,
                dense_prefill: spec.dense_prefill,
            };
            Arc::new(generate::Generator::load_configured(
                path,
                cpu,
                generate::requantize_q4_1(),
                config,
            )?)
        }
        Kind::Python => {
            return Err(LoadError::Invalid {
                path: path.to_owned(),
                reason: "a python model runs in its model host, not the worker's own passes".into(),
            });
        }
    })
}

/// What loading the model of `kind` at `path` would refuse, found from its config files alone
/// (checked when the tool is described, so `nomad up` says it at start-up). A Python model is
/// described by its host instead.
pub fn check(kind: Kind, path: &Path) -> Result<(), LoadError> {
    let refused = |reason: String| LoadError::Invalid {
        path: path.to_owned(),
        reason,
    };
    match kind {
        Kind::Embed => embed::Embedder::check(path).map_err(refused),
        Kind::Rerank => cross::Scorer::check(path, cross::Task::Rerank).map_err(refused),
        Kind::Classify => cross::Scorer::check(path, cross::Task::Classify).map_err(refused),
        Kind::Generate => generate::Generator::check(path),
        // An MLP is its weights file alone: reading it is loading it.
        Kind::Mlp => Ok(()),
        Kind::Python => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_kind_is_refused_naming_the_kinds_served() {
        let message = LoadError::UnknownKind("nope".into()).to_string();
        for kind in Kind::ALL {
            assert!(message.contains(kind.name()), "{message}");
        }
    }

    /// The start-up check reads the model's files: a missing directory is refused for every
    /// kind that has files to read.
    #[test]
    fn the_start_up_check_reads_each_built_in_kinds_files() {
        let missing = Path::new("/nonexistent/model");
        for kind in [Kind::Embed, Kind::Rerank, Kind::Classify, Kind::Generate] {
            assert!(
                check(kind, missing).is_err(),
                "{kind} accepted a missing model"
            );
        }
    }
}
