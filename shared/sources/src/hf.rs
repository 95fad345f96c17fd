//! Hugging Face sources: downloaded from the Hub (or `HF_ENDPOINT`) with Hugging Face's own
//! client into the standard cache layout, so Nomad and the Python libraries share the files;
//! read from that cache alone when offline (`HF_HUB_OFFLINE`, or the Hub unreachable).

use std::path::{Path, PathBuf};

use hf_hub::api::tokio::{ApiBuilder, ApiError};
use hf_hub::{Repo, RepoType};

use crate::SourceError;

/// How long the Hub may take to say what a revision holds.
const HUB_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `org/name` when `text` has that shape (a bare repository id of the hub).
pub(crate) fn repository_id(text: &str) -> Option<&str> {
    let parts: Vec<&str> = text.split('/').collect();
    let word = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (parts.len() == 2 && parts.iter().all(|p| word(p))).then_some(text)
}

/// The Hugging Face hub cache: `HF_HUB_CACHE`, `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub(crate) fn hf_cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return dir.into();
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
    PathBuf::from(home).join(".cache/huggingface/hub")
}

/// The snapshot of `repo` at `revision` in the cache (a branch or tag the cache has a ref for,
/// or a commit), and its commit.
pub(crate) fn cached(
    source: &str,
    repo: &str,
    revision: Option<&str>,
    cache: &Path,
) -> Result<(PathBuf, String), SourceError> {
    let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let revision = revision.unwrap_or("main");
    let commit = std::fs::read_to_string(dir.join("refs").join(revision))
        .map(|c| c.trim().to_owned())
        .unwrap_or_else(|_| revision.to_owned());
    let snapshot = dir.join("snapshots").join(&commit);
    if commit.contains('/') || !snapshot.is_dir() {
        return Err(SourceError::NotCached {
            spec: source.to_owned(),
            repo: repo.to_owned(),
            revision: revision.to_owned(),
            looked: dir.display().to_string(),
            hub: None,
        });
    }
    Ok((snapshot, commit))
}

/// Whether the Hub must not be asked (`HF_HUB_OFFLINE` set true, as the Python libraries read it).
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// A full commit id: the cache's snapshot for it never changes, so no Hub is asked.
fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// The snapshot of `repo` at `revision` (default `main`) and its commit: from the cache when
/// the revision is a commit it holds or the Hub may not be asked, else every file of the
/// revision downloaded (each file once: what the cache holds is kept). An unreachable Hub falls
/// back to the cache.
pub(crate) async fn snapshot(
    source: &str,
    repo: &str,
    revision: Option<&str>,
    cache: &Path,
) -> Result<(PathBuf, String), SourceError> {
    if offline() {
        return cached(source, repo, revision, cache);
    }
    if revision.is_some_and(is_commit)
        && let Ok(found) = cached(source, repo, revision, cache)
    {
        return Ok(found);
    }
    match download(repo, revision.unwrap_or("main"), cache).await {
        Ok(commit) => Ok((snapshot_dir(cache, repo, &commit), commit)),
        Err(e) => {
            let status = match &e {
                ApiError::RequestError(r) => r.status(),
                _ => None,
            };
            let endpoint = endpoint();
            match status.map(|s| s.as_u16()) {
                Some(401 | 403) => Err(SourceError::Invalid {
                    spec: source.to_owned(),
                    reason: format!(
                        "{endpoint} refused access to {repo} ({e}): set HF_TOKEN to a token that \
                         may read it"
                    ),
                }),
                Some(404) => Err(SourceError::NotFound(format!(
                    "{source}: {endpoint} has no repository {repo} at revision {}",
                    revision.unwrap_or("main")
                ))),
                _ => {
                    cached(source, repo, revision, cache).map_err(|cache_error| match cache_error {
                        SourceError::NotCached {
                            spec,
                            repo,
                            revision,
                            looked,
                            ..
                        } => SourceError::NotCached {
                            spec,
                            repo,
                            revision,
                            looked,
                            hub: Some(format!("{endpoint}: {e}")),
                        },
                        other => other,
                    })
                }
            }
        }
    }
}

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_owned())
}

fn snapshot_dir(cache: &Path, repo: &str, commit: &str) -> PathBuf {
    cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(commit)
}

/// Downloads every file of `repo` at `revision` into `cache` and returns the commit; notes the
/// revision's commit under refs/, as the Python libraries do.
async fn download(repo: &str, revision: &str, cache: &Path) -> Result<String, ApiError> {
    let mut builder = ApiBuilder::from_env()
        .with_cache_dir(cache.to_owned())
        .with_progress(false);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build()?;
    // A Hub that never answers (a node whose packets to it are dropped) is an unreachable one.
    let info = tokio::time::timeout(
        HUB_ANSWER_TIMEOUT,
        api.repo(Repo::with_revision(
            repo.to_owned(),
            RepoType::Model,
            revision.to_owned(),
        ))
        .info(),
    )
    .await
    .map_err(|_| {
        ApiError::IoError(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer in {} s", HUB_ANSWER_TIMEOUT.as_secs()),
        ))
    })??;
    // By commit, so a branch that moved is fetched anew, not read from the old commit's files.
    let at_commit = api.repo(Repo::with_revision(
        repo.to_owned(),
        RepoType::Model,
        info.sha.clone(),
    ));
    tracing::info!(%repo, %revision, commit = %info.sha, files = info.siblings.len(), "fetching the model from the Hugging Face Hub (files the cache holds are kept)");
    for (done, sibling) in info.siblings.iter().enumerate() {
        let path = at_commit.get(&sibling.rfilename).await?;
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        tracing::info!(%repo, file = %sibling.rfilename, bytes, done = done + 1, of = info.siblings.len(), "model file in the Hugging Face cache");
    }
    let refs = cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("refs");
    if revision != info.sha {
        std::fs::create_dir_all(&refs)?;
        std::fs::write(refs.join(revision), &info.sha)?;
    }
    // The client notes a ref named by the commit itself; the Python libraries keep none.
    let _ = std::fs::remove_file(refs.join(&info.sha));
    Ok(info.sha)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hugging_face_model_is_read_from_the_cache_or_refused_naming_where_it_looked() {
        let cache = std::env::temp_dir().join(format!("nomad-hf-{}", std::process::id()));
        let repo = cache.join("models--org--tiny");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        assert_eq!(
            cached("hf://org/tiny", "org/tiny", None, &cache).unwrap(),
            (repo.join("snapshots/abc123"), "abc123".to_owned())
        );
        assert_eq!(
            cached("hf://org/tiny@abc123", "org/tiny", Some("abc123"), &cache).unwrap(),
            (repo.join("snapshots/abc123"), "abc123".to_owned())
        );
        let missing = cached("hf://org/other", "org/other", None, &cache)
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("not in the local Hugging Face cache")
                && missing.contains("models--org--other")
                && missing.contains("`hf download org/other --revision main`"),
            "{missing}"
        );
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
