//! Where a model's files come from: a local path (or `file:`), a git repository at a ref and
//! subdirectory (`git+file://`, `git+https://`, `git+ssh://`; cloned once into the cache), a model
//! in the local Hugging Face cache (`hf://org/name`), or an OCI artifact in a registry
//! (`oras://registry/repository:tag` or `@sha256:…`; pulled once into the cache). Anything else
//! is refused by name. The device worker resolves sources; `nomad export` reads and pushes them.

mod git;
mod hf;
pub mod oras;
mod parse;

use std::path::{Path, PathBuf};

use hf::{hf_cache, repository_id};
pub use oras::RegistryFailure;
pub use parse::{Artifact, Source, digest};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SourceError {
    #[error("model source {0}: not found ({hint})", hint = missing_hint(.0))]
    NotFound(String),
    #[error(
        "model source {spec:?}: unsupported scheme `{scheme}`; use a local path, file:, \
         git+file://, git+https://, git+ssh:// (with @ref and #subdir), hf://org/name or \
         oras://registry/repository:tag"
    )]
    Scheme { spec: String, scheme: String },
    #[error("model source {spec:?}: {reason}")]
    Invalid { spec: String, reason: String },
    #[error("model source {spec:?}: cloning failed: {reason}")]
    Clone { spec: String, reason: String },
    #[error(
        "model source {spec:?}: {repo} at revision {revision} is not in the local Hugging Face \
         cache (looked in {looked}){hub}: fetch it on a host that reaches the Hub (e.g. `hf \
         download {repo} --revision {revision}`, or start there once), or set HF_HUB_CACHE \
         (HF_ENDPOINT for a mirror)",
        hub = hub.as_ref().map(|h| format!(" and the Hub could not be asked ({h})")).unwrap_or_default()
    )]
    NotCached {
        spec: String,
        repo: String,
        revision: String,
        looked: String,
        /// Why the Hub was not asked (offline) or did not answer.
        hub: Option<String>,
    },
    #[error("model source {spec:?}: {detail} ({advice})", advice = failure.advice())]
    Registry {
        spec: String,
        failure: RegistryFailure,
        detail: String,
    },
    #[error("model cache {path}: {reason}")]
    Cache { path: String, reason: String },
}

/// The default cache: `$XDG_CACHE_HOME/nomad`, else `~/.cache/nomad`, else one in the temp dir.
pub fn default_cache_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return std::path::PathBuf::from(dir).join("nomad");
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => std::path::PathBuf::from(home).join(".cache/nomad"),
        None => std::env::temp_dir().join("nomad-cache"),
    }
}

/// What to do about a model path that does not exist: the default models are fetched by a
/// script; any other path is the user's to check.
pub fn missing_hint(path: &str) -> String {
    let name = Path::new(path.trim_end_matches('/'))
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    // The first words of a message that already names more than the path.
    let name = name.split(' ').next().unwrap_or_default();
    if nomad_config::DEFAULT_MODELS.contains(&name) {
        "it is a default model: scripts/fetch-models fetches the default models".to_owned()
    } else {
        "check the path: a relative one is read from the config file's directory, then from \
         the worker's working directory"
            .to_owned()
    }
}

/// A source found on this host: where its files are, and the source as it is pinned (a tag,
/// branch or Hub revision replaced by the digest or commit it named; a path as it was given).
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub path: PathBuf,
    pub pinned: String,
}

fn with_subdir(path: PathBuf, subdir: &Option<String>) -> PathBuf {
    match subdir {
        Some(sub) => path.join(sub),
        None => path,
    }
}

fn subdir_suffix(subdir: &Option<String>) -> String {
    subdir.as_ref().map(|s| format!("#{s}")).unwrap_or_default()
}

/// The local directory or file `text` names, cloning a git source, pulling an artifact or
/// downloading from the Hugging Face Hub into the caches first. A relative path is found from
/// `base_dir` (the config file's directory), else as given; one shaped `org/name` that is
/// neither is looked up in the Hugging Face cache, as the original Nomad reads a bare
/// repository id. `registries` names the variables holding a registry's login (the config's
/// `registries:`).
pub async fn resolve(
    text: &str,
    base_dir: &str,
    cache: &Path,
    registries: &nomad_config::registries::Registries,
) -> Result<Resolved, SourceError> {
    let (path, pinned) = match Source::parse(text)? {
        Source::Local(path) if path.is_relative() => {
            let from_base = Path::new(base_dir).join(&path);
            let path = if !base_dir.is_empty() && from_base.exists() {
                from_base
            } else if path.exists() {
                path
            } else if let Some(repo) = repository_id(text) {
                hf::cached(text, repo, None, &hf_cache())
                    .map(|(path, _)| path)
                    .map_err(|_| {
                        SourceError::NotFound(format!(
                            "{} (nor the Hugging Face repository {repo} in the local cache, {})",
                            from_base.display(),
                            hf_cache().display()
                        ))
                    })?
            } else {
                from_base
            };
            (path, text.to_owned())
        }
        Source::Local(path) => (path, text.to_owned()),
        Source::Git {
            url,
            reference,
            subdir,
        } => {
            let (checkout, commit) = git::clone(text, &url, reference.as_deref(), cache).await?;
            let pinned = format!("git+{url}@{commit}{}", subdir_suffix(&subdir));
            (with_subdir(checkout, &subdir), pinned)
        }
        Source::Oras { artifact, subdir } => {
            let (dir, digest) = oras::pull(text, &artifact, cache, registries).await?;
            let pinned = format!("{}{}", artifact.pinned(&digest), subdir_suffix(&subdir));
            (with_subdir(dir, &subdir), pinned)
        }
        Source::HuggingFace {
            repo,
            revision,
            subdir,
        } => {
            let (snapshot, commit) =
                hf::snapshot(text, &repo, revision.as_deref(), &hf_cache()).await?;
            let pinned = format!("hf://{repo}@{commit}{}", subdir_suffix(&subdir));
            (with_subdir(snapshot, &subdir), pinned)
        }
    };
    if !path.exists() {
        return Err(SourceError::NotFound(path.display().to_string()));
    }
    Ok(Resolved { path, pinned })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_path_is_told_apart_from_a_missing_default_model() {
        let own = SourceError::NotFound("/data/my-model".into()).to_string();
        assert!(own.contains("check the path"), "{own}");
        assert!(!own.contains("fetch-models"), "{own}");
        let default = SourceError::NotFound("models/smollm2-135m-instruct/".into()).to_string();
        assert!(default.contains("scripts/fetch-models"), "{default}");
    }
}
