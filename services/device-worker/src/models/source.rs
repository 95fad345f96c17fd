//! Where a model's files come from: a local path (or `file:`), a git repository at a ref and
//! subdirectory (`git+file://`, `git+https://`; cloned once into the cache), or a model in the
//! local Hugging Face cache (`hf://org/name`; never downloaded). Anything else is refused by name.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long cloning one repository may take.
const CLONE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SourceError {
    #[error("model source {0}: not found ({hint})", hint = missing_hint(.0))]
    NotFound(String),
    #[error(
        "model source {spec:?}: unsupported scheme `{scheme}`; use a local path, file:, \
         git+file://, git+https:// (with @ref and #subdir) or hf://org/name"
    )]
    Scheme { spec: String, scheme: String },
    #[error("model source {spec:?}: {reason}")]
    Invalid { spec: String, reason: String },
    #[error("model source {spec:?}: cloning failed: {reason}")]
    Clone { spec: String, reason: String },
    #[error(
        "model source {spec:?}: {repo} at revision {revision} is not in the local Hugging Face \
         cache (looked in {looked}); Nomad does not download: fetch it on this host first (e.g. \
         `hf download {repo} --revision {revision}`) or set HF_HUB_CACHE"
    )]
    NotCached {
        spec: String,
        repo: String,
        revision: String,
        looked: String,
    },
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

/// A parsed model source.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Local(PathBuf),
    Git {
        /// What `git clone` takes (the URL without `git+`, `@ref` and `#subdir`).
        url: String,
        reference: Option<String>,
        subdir: Option<String>,
    },
    HuggingFace {
        repo: String,
        revision: Option<String>,
        subdir: Option<String>,
    },
}

/// Splits `#subdir` off, refusing one that climbs out of the repository.
fn split_subdir<'a>(text: &'a str, source: &str) -> Result<(&'a str, Option<String>), SourceError> {
    match text.split_once('#') {
        None => Ok((text, None)),
        Some((rest, sub)) => {
            let sub = sub.strip_prefix("subdirectory=").unwrap_or(sub);
            let sub = sub.trim_matches('/');
            if sub.is_empty() {
                return Ok((rest, None));
            }
            if Path::new(sub)
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(SourceError::Invalid {
                    spec: source.to_owned(),
                    reason: format!("subdirectory {sub:?} must stay inside the repository"),
                });
            }
            Ok((rest, Some(sub.to_owned())))
        }
    }
}

impl Source {
    pub fn parse(text: &str) -> Result<Self, SourceError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(SourceError::Invalid {
                spec: String::new(),
                reason: "empty".into(),
            });
        }
        if let Some(path) = text.strip_prefix("file://") {
            return Ok(Source::Local(PathBuf::from(path)));
        }
        if let Some(path) = text.strip_prefix("file:") {
            return Ok(Source::Local(PathBuf::from(path)));
        }
        if let Some(rest) = text.strip_prefix("hf://") {
            let (rest, subdir) = split_subdir(rest, text)?;
            let (repo, revision) = match rest.split_once('@') {
                Some((repo, rev)) => (repo, Some(rev.to_owned())),
                None => (rest, None),
            };
            let repo = repo.trim_matches('/');
            let parts: Vec<&str> = repo.split('/').collect();
            if parts.len() != 2 || parts.iter().any(|p| p.is_empty() || *p == "..") {
                return Err(SourceError::Invalid {
                    spec: text.to_owned(),
                    reason:
                        "hf:// takes org/name (e.g. hf://sentence-transformers/all-MiniLM-L6-v2)"
                            .into(),
                });
            }
            return Ok(Source::HuggingFace {
                repo: repo.to_owned(),
                revision,
                subdir,
            });
        }
        if let Some(rest) = text.strip_prefix("git+") {
            let (rest, subdir) = split_subdir(rest, text)?;
            let Some((scheme, after)) = rest.split_once("://") else {
                return Err(SourceError::Invalid {
                    spec: text.to_owned(),
                    reason: "git+ takes a URL (git+file:///path or git+https://host/repo)".into(),
                });
            };
            if !matches!(scheme, "file" | "https" | "http" | "ssh") {
                return Err(SourceError::Scheme {
                    spec: text.to_owned(),
                    scheme: format!("git+{scheme}"),
                });
            }
            // `@ref` follows the path; an `@` before the path's first `/` is a user name.
            let path_start = if scheme == "file" {
                0
            } else {
                after.find('/').unwrap_or(after.len())
            };
            let (url_rest, reference) = match after[path_start..].rfind('@') {
                Some(at) => (
                    &after[..path_start + at],
                    Some(after[path_start + at + 1..].to_owned()),
                ),
                None => (after, None),
            };
            if url_rest.trim_matches('/').is_empty() {
                return Err(SourceError::Invalid {
                    spec: text.to_owned(),
                    reason: "the git URL has no repository path".into(),
                });
            }
            return Ok(Source::Git {
                url: format!("{scheme}://{url_rest}"),
                reference: reference.filter(|r| !r.is_empty()),
                subdir,
            });
        }
        if let Some((scheme, _)) = text.split_once("://") {
            return Err(SourceError::Scheme {
                spec: text.to_owned(),
                scheme: scheme.to_owned(),
            });
        }
        Ok(Source::Local(PathBuf::from(text)))
    }
}

/// The local directory or file `text` names, cloning a git source into `cache` first. A
/// relative path is found from `base_dir` (the config file's directory), else as given; one
/// shaped `org/name` that is neither is looked up in the Hugging Face cache, as the original
/// Nomad reads a bare repository id.
pub async fn resolve(text: &str, base_dir: &str, cache: &Path) -> Result<PathBuf, SourceError> {
    let path = match Source::parse(text)? {
        Source::Local(path) if path.is_relative() => {
            let from_base = Path::new(base_dir).join(&path);
            if !base_dir.is_empty() && from_base.exists() {
                from_base
            } else if path.exists() {
                path
            } else if let Some(repo) = repository_id(text) {
                hugging_face(text, repo, None, &hf_cache()).map_err(|_| {
                    SourceError::NotFound(format!(
                        "{} (nor the Hugging Face repository {repo} in the local cache, {})",
                        from_base.display(),
                        hf_cache().display()
                    ))
                })?
            } else {
                from_base
            }
        }
        Source::Local(path) => path,
        Source::Git {
            url,
            reference,
            subdir,
        } => {
            let checkout = clone(text, &url, reference.as_deref(), cache).await?;
            match subdir {
                Some(sub) => checkout.join(sub),
                None => checkout,
            }
        }
        Source::HuggingFace {
            repo,
            revision,
            subdir,
        } => {
            let snapshot = hugging_face(text, &repo, revision.as_deref(), &hf_cache())?;
            match subdir {
                Some(sub) => snapshot.join(sub),
                None => snapshot,
            }
        }
    };
    if !path.exists() {
        return Err(SourceError::NotFound(path.display().to_string()));
    }
    Ok(path)
}

/// `org/name` when `text` has that shape (a bare repository id of the hub).
fn repository_id(text: &str) -> Option<&str> {
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
fn hf_cache() -> PathBuf {
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
fn hugging_face(
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

/// A checkout of `url` at `reference` in the cache, cloned there once (under a lock, so workers
/// sharing the cache clone it once).
async fn clone(
    source: &str,
    url: &str,
    reference: Option<&str>,
    cache: &Path,
) -> Result<PathBuf, SourceError> {
    use sha2::{Digest as _, Sha256};
    let fail = |reason: String| SourceError::Clone {
        spec: source.to_owned(),
        reason,
    };
    let digest = Sha256::digest(format!("{url}@{}", reference.unwrap_or("")).as_bytes());
    let name: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let root = cache.join("sources");
    std::fs::create_dir_all(&root).map_err(|e| fail(format!("{}: {e}", root.display())))?;
    let checkout = root.join(&name);
    if checkout.join(".nomad-source-ready").is_file() {
        return Ok(checkout);
    }
    let lock_path = root.join(format!("{name}.lock"));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| fail(format!("{}: {e}", lock_path.display())))?;
    let deadline = std::time::Instant::now() + CLONE_TIMEOUT;
    while let Err(e) = lock.try_lock() {
        if let std::fs::TryLockError::Error(e) = e {
            return Err(fail(format!("{}: {e}", lock_path.display())));
        }
        if std::time::Instant::now() >= deadline {
            return Err(fail(
                "another process held the clone's lock too long".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if checkout.join(".nomad-source-ready").is_file() {
        return Ok(checkout);
    }
    if checkout.exists() {
        std::fs::remove_dir_all(&checkout).map_err(|e| fail(e.to_string()))?;
    }
    tracing::info!(%source, into = %checkout.display(), "cloning the model source");
    git(
        &["clone", "--quiet", "--no-checkout", url],
        Some(&checkout),
        None,
    )
    .await
    .map_err(fail)?;
    let reference = reference.unwrap_or("HEAD");
    git(&["checkout", "--quiet", reference], None, Some(&checkout))
        .await
        .map_err(|e| fail(format!("checking out {reference:?}: {e}")))?;
    std::fs::write(checkout.join(".nomad-source-ready"), reference)
        .map_err(|e| fail(e.to_string()))?;
    drop(lock);
    Ok(checkout)
}

/// Runs git with `args` (and `target` as its last argument), in `dir` when given.
async fn git(args: &[&str], target: Option<&Path>, dir: Option<&Path>) -> Result<(), String> {
    let mut command = tokio::process::Command::new("git");
    command.args(args);
    if let Some(target) = target {
        command.arg(target);
    }
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    // Never ask for credentials on a terminal nobody watches.
    command
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(CLONE_TIMEOUT, command.output())
        .await
        .map_err(|_| format!("git took over {} s", CLONE_TIMEOUT.as_secs()))?
        .map_err(|e| format!("cannot run git: {e} (is git installed?)"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "git {} exited with {}: {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_into_their_parts() {
        assert_eq!(
            Source::parse("/models/a").unwrap(),
            Source::Local("/models/a".into())
        );
        assert_eq!(
            Source::parse("file:///models/a").unwrap(),
            Source::Local("/models/a".into())
        );
        assert_eq!(
            Source::parse("git+file:///srv/repo.git@v1.2#models/tiny").unwrap(),
            Source::Git {
                url: "file:///srv/repo.git".into(),
                reference: Some("v1.2".into()),
                subdir: Some("models/tiny".into()),
            }
        );
        assert_eq!(
            Source::parse("git+https://git@example.org/org/repo.git").unwrap(),
            Source::Git {
                url: "https://git@example.org/org/repo.git".into(),
                reference: None,
                subdir: None,
            }
        );
        assert_eq!(
            Source::parse("hf://org/name@v2#onnx").unwrap(),
            Source::HuggingFace {
                repo: "org/name".into(),
                revision: Some("v2".into()),
                subdir: Some("onnx".into()),
            }
        );
    }

    #[test]
    fn bad_sources_are_refused_by_name() {
        let cases = [
            ("s3://bucket/model", "unsupported scheme `s3`"),
            ("git+ftp://host/repo", "unsupported scheme `git+ftp`"),
            ("hf://just-a-name", "hf:// takes org/name"),
            (
                "git+file:///repo#../../etc",
                "must stay inside the repository",
            ),
            ("git+https://", "no repository path"),
        ];
        for (text, expected) in cases {
            let message = Source::parse(text).unwrap_err().to_string();
            assert!(message.contains(expected), "{text}: {message}");
        }
    }

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

    #[test]
    fn a_missing_path_is_told_apart_from_a_missing_default_model() {
        let own = SourceError::NotFound("/data/my-model".into()).to_string();
        assert!(own.contains("check the path"), "{own}");
        assert!(!own.contains("fetch-models"), "{own}");
        let default = SourceError::NotFound("models/smollm2-135m-instruct/".into()).to_string();
        assert!(default.contains("scripts/fetch-models"), "{default}");
    }
}
