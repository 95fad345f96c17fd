//! The gateway's own directory (the runner script, and the empty mount point of each run's
//! private root) and, only for runs without namespaces, host workspaces. Made like `mkdtemp`:
//! a random name created exclusively, then checked to be a real directory owned by the gateway,
//! so nobody can plant one (or a symlink) ahead of it.

use std::io;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// A fresh directory `<parent>/<prefix><random>` with `mode`, owned by this process's user.
pub fn make_private_dir(parent: &Path, prefix: &str, mode: u32) -> io::Result<PathBuf> {
    check_parent(parent)?;
    let path = parent.join(format!("{prefix}{}", uuid::Uuid::new_v4().simple()));
    // `mkdir` fails if anything (a symlink included) is there already.
    std::fs::DirBuilder::new().mode(0o700).create(&path)?;
    let meta = std::fs::symlink_metadata(&path)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me {
        return Err(io::Error::other(format!(
            "{} is not a directory of this user's right after creating it",
            path.display()
        )));
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
    Ok(path)
}

/// A parent that others may write to must be sticky (like `/tmp`), or they could swap our
/// directory for theirs.
fn check_parent(parent: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(parent).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("sandbox.workspace_dir {}: {e}", parent.display()),
        )
    })?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!(
            "sandbox.workspace_dir {} is not a directory (a symlink is refused too)",
            parent.display()
        )));
    }
    let mode = meta.mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(io::Error::other(format!(
            "sandbox.workspace_dir {} is writable by other users and not sticky: use a \
             directory only this user can write, or one like /tmp",
            parent.display()
        )));
    }
    Ok(())
}

/// Removes `path` and everything under it, restoring permissions a run may have taken away
/// (`chmod 000`) and never following a symlink. Blocking: call it off the async runtime.
pub fn remove_tree(path: &Path) {
    fn open_up(path: &Path) {
        let Ok(meta) = std::fs::symlink_metadata(path) else {
            return;
        };
        if meta.is_dir() {
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700));
            if let Ok(entries) = std::fs::read_dir(path) {
                for entry in entries.flatten() {
                    open_up(&entry.path());
                }
            }
        }
    }
    open_up(path);
    if let Err(e) = std::fs::remove_dir_all(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!("removing sandbox workspace {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nomad-ws-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn private_dirs_are_fresh_and_refuse_unsafe_parents() {
        let dir = scratch();
        let a = make_private_dir(&dir, "x-", 0o755).unwrap();
        let b = make_private_dir(&dir, "x-", 0o755).unwrap();
        assert_ne!(a, b);
        assert_eq!(std::fs::metadata(&a).unwrap().mode() & 0o777, 0o755);
        // A symlink as the parent, and a parent others can write that is not sticky.
        let link = dir.join("link");
        std::os::unix::fs::symlink(&a, &link).unwrap();
        let e = make_private_dir(&link, "x-", 0o700)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a directory"), "{e}");
        let open = dir.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = make_private_dir(&open, "x-", 0o700)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not sticky"), "{e}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(make_private_dir(&open, "x-", 0o700).is_ok());
        remove_tree(&dir);
        assert!(!dir.exists());
    }

    #[test]
    fn removal_restores_permissions_and_does_not_follow_symlinks() {
        let dir = scratch();
        let outside = scratch();
        std::fs::write(outside.join("keep"), "x").unwrap();
        let ws = dir.join("ws");
        std::fs::create_dir_all(ws.join("a/b")).unwrap();
        std::fs::write(ws.join("a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("a/escape")).unwrap();
        std::fs::set_permissions(ws.join("a/b"), std::fs::Permissions::from_mode(0o000)).unwrap();
        std::fs::set_permissions(ws.join("a"), std::fs::Permissions::from_mode(0o000)).unwrap();
        remove_tree(&ws);
        assert!(!ws.exists());
        assert!(outside.join("keep").exists(), "followed the symlink");
        remove_tree(&dir);
        remove_tree(&outside);
    }
}
