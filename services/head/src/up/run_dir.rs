//! A run's directory: made private before anything is written to it, with the config the run
//! ran on (the user's, kept and later pinned, or the default one `nomad up` writes).

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::models;

/// Makes `runs_dir/run_id`, private to this user (its logs hold what callers sent). A run id
/// used before is refused: its directory is never reused.
pub(super) fn create(runs_dir: &Path, run_id: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let run_dir = runs_dir.join(run_id);
    if run_dir.exists() {
        anyhow::bail!(
            "run directory {} already exists: run id {run_id} was used before \
             (set another NOMAD_OTEL_RUN_ID, or remove the directory)",
            run_dir.display()
        );
    }
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run directory {}", run_dir.display()))?;
    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", run_dir.display()))?;
    Ok(run_dir)
}

/// A copy of the user's config kept with the run, so the run is found again with what it ran
/// on; the fleet reads the original, whose relative paths are relative to where it is.
pub(super) fn keep_config(run_dir: &Path, config: &Path) -> anyhow::Result<PathBuf> {
    let ext = config
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("yaml");
    let copy = run_dir.join(format!("config.{ext}"));
    std::fs::copy(config, &copy)
        .with_context(|| format!("copying {} to {}", config.display(), copy.display()))?;
    Ok(copy)
}

/// The default fleet's config over the models in `models`, written into the run.
pub(super) fn default_config(run_dir: &Path, models: &Path) -> anyhow::Result<PathBuf> {
    let path = run_dir.join("nomad.yaml");
    std::fs::write(&path, models::default_config(models))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The run's copy of a YAML config, each source a tag, branch or Hub revision named rewritten to
/// the digest or commit it served (best effort: the run goes on if it cannot be written).
pub(super) fn pin_kept_config(kept: Option<&Path>, config: &Path, pins: Vec<(String, String)>) {
    let Some(kept) = kept else { return };
    let yaml = matches!(
        kept.extension().and_then(|e| e.to_str()),
        Some("yml" | "yaml")
    );
    if pins.is_empty() || !yaml {
        return;
    }
    let pins = pins.into_iter().collect();
    if let Err(e) = crate::config_sources::pin_file(kept, config, &pins) {
        eprintln!("nomad: cannot pin the sources in {}: {e:#}", kept.display());
    }
}

/// Writes `bytes` to a new file only its owner may read (mode 0600). The file must not exist
/// yet, and a symbolic link in its place is refused, so a token is never written through a link
/// another user planted or into a file someone else already opened.
/// Where server `name` of the run in `run_dir` writes the address it listens on.
pub(crate) fn addr_file(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join(format!("{name}.addr"))
}

pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_file_is_never_written_through_a_link_or_over_another_file() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("nomad-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        write_private(&token, b"secret").unwrap();
        assert_eq!(
            std::fs::metadata(&token).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Someone else's file already there, or a link planted to one: refused, untouched.
        assert!(write_private(&token, b"again").is_err());
        assert_eq!(std::fs::read(&token).unwrap(), b"secret");
        let target = dir.join("target");
        std::fs::write(&target, "theirs").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(write_private(&link, b"secret").is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "theirs");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_directory_is_private_and_never_reused() {
        use std::os::unix::fs::PermissionsExt as _;
        let runs = std::env::temp_dir().join(format!("nomad-runs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&runs);
        let dir = create(&runs, "r1").unwrap();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let again = create(&runs, "r1").unwrap_err().to_string();
        assert!(again.contains("run id r1 was used before"), "{again}");
        std::fs::remove_dir_all(&runs).unwrap();
    }
}
