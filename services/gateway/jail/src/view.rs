//! The filesystem view: a private root that holds only the interpreter and system libraries
//! (read-only binds), a few device nodes and the runner, made read-only as a whole once built,
//! and each run's own tmpfs for `/workspace`, `/tmp` and `/dev/shm`.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::error::{Failed, Step as _};
use crate::spec::{Entry, RUNTIME_DIR, SCRATCH, Spec, WORKSPACE};

/// The directories a run gets for itself, each a part of its own tmpfs, with their modes.
const RUN_DIRS: [(&str, &str, u32); 3] = [
    ("w", WORKSPACE, 0o700),
    ("t", "/tmp", 0o1777),
    ("s", "/dev/shm", 0o1777),
];

/// Builds the view under `spec.mount_point`, makes it the root and makes that root read-only.
/// `/etc/passwd` names `run_ids`, the ids every run has.
pub fn build(spec: &Spec, run_ids: (u32, u32)) -> Result<(), Failed> {
    let root = spec.mount_point.as_path();
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(mount_err("making private", Path::new("/")))?;
    // Small: it holds directories, links and two short files; runs write nothing here.
    mount(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("size=1m,nr_inodes=4096,mode=0755"),
    )
    .map_err(mount_err("mounting the root tmpfs on", root))?;
    let inside = |path: &Path| root.join(path.strip_prefix("/").unwrap_or(path));
    for entry in &spec.view {
        match entry {
            Entry::ReadOnly { path } => bind(path, &inside(path), true)?,
            Entry::Symlink { path, target } => {
                let link = inside(path);
                if let Some(parent) = link.parent() {
                    std::fs::create_dir_all(parent).step("view directories")?;
                }
                std::os::unix::fs::symlink(target, &link)
                    .step(&format!("symlink {}", path.display()))?;
            }
        }
    }
    bind(&spec.runtime, &inside(Path::new(RUNTIME_DIR)), true)?;
    let dev = inside(Path::new("/dev"));
    for node in ["null", "zero", "full", "random", "urandom"] {
        bind(&Path::new("/dev").join(node), &dev.join(node), false)?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(name)).step("/dev links")?;
    }
    // Mount points only: each run mounts its own parts here.
    for dir in RUN_DIRS.iter().map(|(_, dir, _)| *dir).chain([SCRATCH]) {
        std::fs::create_dir_all(inside(Path::new(dir))).step(dir)?;
    }
    let (uid, gid) = run_ids;
    let etc = inside(Path::new("/etc"));
    std::fs::create_dir_all(&etc).step("/etc")?;
    std::fs::write(
        etc.join("passwd"),
        format!("sandbox:x:{uid}:{gid}:sandbox:{WORKSPACE}:/usr/sbin/nologin\n"),
    )
    .step("/etc/passwd")?;
    std::fs::write(etc.join("group"), format!("sandbox:x:{gid}:\n")).step("/etc/group")?;
    if spec.proc {
        mount_proc(&inside(Path::new("/proc")))?;
    }
    nix::unistd::chdir(root).step("entering the view")?;
    nix::unistd::pivot_root(".", ".").map_err(mount_err("pivot_root to", root))?;
    // The host's tree is now stacked under the view's root: detach it.
    umount2(".", MntFlags::MNT_DETACH).map_err(mount_err("detaching the host's", root))?;
    nix::unistd::chdir("/").step("entering the view")?;
    // The root alone (its binds are read-only already, /proc stays as it is): no run can
    // change a mode, a time or an attribute of what every run shares.
    set_mount_attributes(Path::new("/"), MOUNT_ATTR_RDONLY, false)
        .step("making the view's root read-only")?;
    nix::unistd::sethostname("sandbox").step("hostname")
}

/// Mounts a fresh tmpfs of the run's size and binds its parts at `/workspace`, `/tmp` and
/// `/dev/shm` (one filesystem, so its size bounds all three together), then hides it.
pub fn mount_run_dirs(spec: &Spec) -> Result<(), Failed> {
    mount(
        Some("tmpfs"),
        SCRATCH,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(
            format!(
                "size={},nr_inodes={},mode=0755",
                spec.disk_bytes, spec.max_files
            )
            .as_str(),
        ),
    )
    .map_err(mount_err("mounting the run's tmpfs on", Path::new(SCRATCH)))?;
    for (part, target, mode) in RUN_DIRS {
        let source = Path::new(SCRATCH).join(part);
        std::fs::create_dir(&source).step(target)?;
        std::fs::set_permissions(&source, std::fs::Permissions::from_mode(mode)).step(target)?;
        let none: Option<&str> = None;
        mount(Some(&source), target, none, MsFlags::MS_BIND, none)
            .map_err(mount_err("binding the run's", Path::new(target)))?;
    }
    umount2(SCRATCH, MntFlags::MNT_DETACH)
        .map_err(mount_err("hiding the run's tmpfs at", Path::new(SCRATCH)))
}

/// Mounts the current PID namespace's own `/proc` at `target`.
pub fn mount_proc(target: &Path) -> Result<(), Failed> {
    std::fs::create_dir_all(target).step("/proc")?;
    let none: Option<&str> = None;
    mount(
        Some("proc"),
        target,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        none,
    )
    .map_err(mount_err("mounting", Path::new("/proc")))
}

fn mount_err(what: &str, path: &Path) -> impl FnOnce(nix::errno::Errno) -> Failed {
    let message = format!("{what} {}", path.display());
    move |e| Failed(format!("{message}: {e}"))
}

/// Binds `source` at `target` (made empty first), recursively, then makes the whole bind
/// read-only and device-free (when asked), or non-executable (device nodes); always nosuid.
fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), Failed> {
    let is_dir = std::fs::metadata(source)
        .step(&format!("bind source {}", source.display()))?
        .is_dir();
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).step("view directories")?;
    }
    if is_dir {
        std::fs::create_dir_all(target).step("view directories")?;
    } else {
        std::fs::File::create(target).step("view files")?;
    }
    let none: Option<&str> = None;
    mount(
        Some(source),
        target,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(mount_err("binding", source))?;
    let mut flags = MOUNT_ATTR_NOSUID;
    if read_only {
        flags |= MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV;
    } else {
        flags |= MOUNT_ATTR_NOEXEC;
    }
    set_mount_attributes(target, flags, true)
        .map_err(|e| Failed(format!("making {} read-only: {e}", source.display())))
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const AT_RECURSIVE: libc::c_uint = 0x8000;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `mount_setattr(2)` on the mount at `path`, and with `recursive` on every mount below it (a
/// remount would change only the top mount and must repeat the flags the kernel has locked).
fn set_mount_attributes(path: &Path, set: u64, recursive: bool) -> std::io::Result<()> {
    let path = CString::new(path.as_os_str().as_bytes())?;
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: a valid path and attribute structure of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            if recursive { AT_RECURSIVE } else { 0 },
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
