//! Hugging Face sources read from the hub's local cache layout.

use std::path::{Path, PathBuf};

use crate::SourceError;

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

/// The snapshot of `repo` at `revision` (a branch or tag the cache has a ref for, or a commit).
pub(crate) fn hugging_face(
    source: &str,
    repo: &str,
    revision: Option<&str>,
    cache: &Path,
) -> Result<PathBuf, SourceError> {
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
        });
    }
    Ok(snapshot)
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
            hugging_face("hf://org/tiny", "org/tiny", None, &cache).unwrap(),
            repo.join("snapshots/abc123")
        );
        assert_eq!(
            hugging_face("hf://org/tiny@abc123", "org/tiny", Some("abc123"), &cache).unwrap(),
            repo.join("snapshots/abc123")
        );
        let missing = hugging_face("hf://org/other", "org/other", None, &cache)
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
