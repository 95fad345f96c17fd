//! The filesystem view, as the gateway computes it for the init: what is bound read-only (or
//! linked) into every run's private root.

use std::path::{Path, PathBuf};

use super::init::Entry;

/// What the view holds: the system directories (as binds, or as the symlinks a merged-/usr
/// system has), the dynamic linker's cache and time zone, and every directory the interpreter
/// reads from. Never the gateway's own directory.
pub async fn view_for(python: &Path, base: &Path) -> anyhow::Result<Vec<Entry>> {
    let probe = tokio::process::Command::new(python)
        .args([
            "-I",
            "-c",
            "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix] + sys.path))",
        ])
        .env_clear()
        .output()
        .await?;
    anyhow::ensure!(
        probe.status.success(),
        "{} does not run: {}",
        python.display(),
        String::from_utf8_lossy(&probe.stderr)
    );
    let mut view = Vec::new();
    let mut bound: Vec<PathBuf> = Vec::new();
    let mut add = |path: &Path, view: &mut Vec<Entry>| {
        if bound.iter().any(|b| path.starts_with(b)) {
            return;
        }
        bound.push(path.to_owned());
        view.push(Entry::ReadOnly {
            path: path.to_owned(),
        });
    };
    for system in [
        "/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
    ] {
        let path = Path::new(system);
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => view.push(Entry::Symlink {
                path: path.to_owned(),
                target: std::fs::read_link(path)?,
            }),
            Ok(m) if m.is_dir() => add(path, &mut view),
            _ => {}
        }
    }
    for file in ["/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"] {
        let path = Path::new(file);
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => view.push(Entry::Symlink {
                path: path.to_owned(),
                target: std::fs::read_link(path)?,
            }),
            Ok(_) => add(path, &mut view),
            Err(_) => {}
        }
    }
    let dirs: Vec<String> = serde_json::from_slice(&probe.stdout)?;
    let interpreter_dirs = dirs
        .iter()
        .map(PathBuf::from)
        .chain(python.parent().map(Path::to_owned));
    for dir in interpreter_dirs {
        let Ok(dir) = dir.canonicalize() else {
            continue;
        };
        if !dir.is_dir() || dir == Path::new("/") || base.starts_with(&dir) {
            continue;
        }
        add(&dir, &mut view);
    }
    Ok(view)
}
