//! Git sources: a repository cloned once into the cache, checked out at its ref.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::SourceError;

/// How long cloning one repository may take.
const CLONE_TIMEOUT: Duration = Duration::from_secs(600);

/// A checkout of `url` at `reference` in the cache, cloned there once (under a lock, so workers
/// sharing the cache clone it once), and the commit it is at.
pub(crate) async fn clone(
    source: &str,
    url: &str,
    reference: Option<&str>,
    cache: &Path,
) -> Result<(PathBuf, String), SourceError> {
    let checkout = checkout(source, url, reference, cache).await?;
    let commit = head_commit(&checkout)
        .await
        .map_err(|reason| SourceError::Clone {
            spec: source.to_owned(),
            reason,
        })?;
    Ok((checkout, commit))
}

/// The commit `checkout` is at.
async fn head_commit(checkout: &Path) -> Result<String, String> {
    let output = tokio::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(checkout)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("cannot run git: {e}"))?;
    let commit = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if output.status.success() && !commit.is_empty() {
        Ok(commit)
    } else {
        Err(format!(
            "git rev-parse HEAD in {}: {}",
            checkout.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

async fn checkout(
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
