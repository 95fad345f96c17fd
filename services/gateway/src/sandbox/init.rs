//! `nomad-gateway sandbox-init`: the first process of every sandboxed run. The gateway starts
//! its own binary in this mode (a fresh single-threaded process, so it may allocate and report
//! errors freely), with the bridge socket as standard input; the bridge's first frame is a
//! [`Spec`] as JSON (never on the command line, which `ps` shows to every user).
//!
//! In order:
//! 1. the spec is read; the bridge moves to descriptor 3, standard input becomes `/dev/null`, a
//!    new session;
//! 2. the run's cgroup, when the gateway has a delegated one;
//! 3. a gateway running as root becomes `nobody` (supplementary groups cleared);
//! 4. new user, mount, network, PID, IPC, UTS and cgroup namespaces; this process stays outside
//!    the PID namespace as a waiter, and its child becomes the namespace's PID 1 (when PID 1 exits
//!    the kernel kills everything left inside);
//! 5. the filesystem view: a private tmpfs root of `disk_bytes` holding `/workspace` and `/tmp`,
//!    read-only binds of the interpreter and system libraries, four device nodes, its own `/proc`;
//!    then `pivot_root` into it and the host's tree detached;
//! 6. resource limits, Landlock, every capability dropped, `no_new_privs`, the seccomp filter;
//! 7. a report of what holds, written as the first bridge frame, then `exec` of Python.
//!
//! A failure prints `nomad sandbox-init: <step>: <error>` on stderr and exits with 125.

use std::ffi::CString;
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, LandlockStatus, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Uid, fork};
use serde::{Deserialize, Serialize};

use super::bridge;

/// The first argument that selects this mode.
pub const ARG: &str = "sandbox-init";
/// Exit status of a failed set-up.
pub const SETUP_FAILED: i32 = 125;
/// Where the runner's directory is mounted inside the view.
pub const RUNTIME_DIR: &str = "/nomad";
/// The run's working directory inside the view.
pub const WORKSPACE: &str = "/workspace";

/// Resource limits of one run (per process; a cgroup, where there is one, bounds the whole run).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Limits {
    pub address_space_bytes: u64,
    pub cpu_seconds: u64,
    pub processes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
}

/// One thing the view holds besides the root tmpfs's own directories.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    /// A read-only bind of the host's `path` at the same path.
    ReadOnly { path: PathBuf },
    /// A symbolic link at `path` pointing to `target` (as on the host: `/bin -> usr/bin`).
    Symlink { path: PathBuf, target: PathBuf },
}

/// Everything the init needs, decided by the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spec {
    pub python: PathBuf,
    /// Arguments after the interpreter.
    pub args: Vec<String>,
    /// The host directory the gateway keeps the runner in (bound at [`RUNTIME_DIR`]).
    pub runtime: PathBuf,
    /// An empty host directory the private root is mounted on (inside the new mount namespace
    /// only; the host never sees the mount).
    pub mount_point: PathBuf,
    pub view: Vec<Entry>,
    /// Size of the private tmpfs holding `/workspace` and `/tmp`.
    pub disk_bytes: u64,
    /// Inodes of that tmpfs (files and directories).
    pub max_files: u64,
    pub limits: Limits,
    /// Become this (uid, gid) first: the gateway runs as root.
    pub drop_to: Option<(u32, u32)>,
    /// Namespaces and the filesystem view. Off only with `allow_unisolated`, where the kernel
    /// refuses them; then `host_workspace` is the working directory.
    pub namespaces: bool,
    /// Mount the PID namespace's own `/proc` (off where the kernel refuses it, as in a container
    /// that masks parts of its `/proc`).
    pub proc: bool,
    pub host_workspace: Option<PathBuf>,
    /// A cgroup v2 directory made for this run.
    pub cgroup: Option<PathBuf>,
    pub seccomp: bool,
    pub landlock: bool,
    /// Start the fork server (see `fork_server`): root of its own user namespace, behind the
    /// view, with none of a run's other restrictions (each child puts them in force itself).
    #[serde(default)]
    pub zygote: bool,
}

/// Where a fork server's child mounts its tmpfs before binding its parts into place.
pub const SCRATCH: &str = "/nomad-run";

/// What the init put in force, sent as the bridge's first frame.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Report {
    pub namespaces: bool,
    pub proc: bool,
    /// The Landlock ABI enforced (0: none).
    pub landlock_abi: u32,
    pub landlock_fully_enforced: bool,
    pub seccomp: bool,
    pub no_new_privs: bool,
    pub capabilities_dropped: bool,
    pub cgroup: bool,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups still held (the kernel keeps them in an unprivileged user
    /// namespace; nothing they own is in the view).
    pub supplementary_groups: usize,
}

impl Report {
    /// Whether every protection of `other` holds here too.
    pub fn as_strong_as(&self, other: &Report) -> bool {
        let implies = |here: bool, there: bool| here || !there;
        implies(self.namespaces, other.namespaces)
            && implies(self.proc, other.proc)
            && self.landlock_abi >= other.landlock_abi
            && implies(self.landlock_fully_enforced, other.landlock_fully_enforced)
            && implies(self.seccomp, other.seccomp)
            && implies(self.no_new_privs, other.no_new_privs)
            && implies(self.capabilities_dropped, other.capabilities_dropped)
            && implies(self.cgroup, other.cgroup)
            && self.uid == other.uid
            && self.supplementary_groups <= other.supplementary_groups
    }
}

struct Failed(String);

trait Step<T> {
    fn step(self, what: &str) -> Result<T, Failed>;
}

impl<T, E: std::fmt::Display> Step<T> for Result<T, E> {
    fn step(self, what: &str) -> Result<T, Failed> {
        self.map_err(|e| Failed(format!("{what}: {e}")))
    }
}

/// The command that starts the init for `spec` (the gateway's own binary in this mode, with no
/// environment), and the gateway's end of the bridge, whose other end is the command's standard
/// input and already holds the spec (a few KiB into an empty socket buffer: the write completes
/// before the init reads). Standard output and error are the caller's to set.
pub fn command(
    spec: &Spec,
) -> std::io::Result<(std::os::unix::net::UnixStream, tokio::process::Command)> {
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    let frame = bridge::encode(spec).map_err(std::io::Error::other)?;
    ours.write_all(&frame)?;
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg(ARG)
        .env_clear()
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            theirs,
        )))
        .kill_on_drop(true);
    Ok((ours, command))
}

/// Runs the init; never returns.
pub fn main() -> ! {
    let Err(Failed(message)) = run();
    let _ = writeln!(std::io::stderr(), "nomad sandbox-init: {message}");
    std::process::exit(SETUP_FAILED);
}

/// The largest spec the init reads (a spec is a few KiB: paths and limits).
const MAX_SPEC: usize = 1 << 20;

/// Reads the spec frame from standard input (the bridge), exactly: what follows is the runner's.
fn read_spec() -> Result<Spec, Failed> {
    use std::io::Read as _;
    // Unbuffered (std's stdin reads ahead) and never closed: the bridge moves to descriptor 3
    // next, and what follows the spec is the runner's.
    // SAFETY: descriptor 0 is open (the bridge) and is not closed through this handle.
    let mut stdin = std::mem::ManuallyDrop::new(unsafe {
        <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(0)
    });
    let mut length = [0u8; 4];
    stdin.read_exact(&mut length).step("reading the spec")?;
    let length = u32::from_be_bytes(length) as usize;
    if length > MAX_SPEC {
        return Err(Failed(format!(
            "reading the spec: {length} bytes, more than {MAX_SPEC}"
        )));
    }
    let mut body = vec![0u8; length];
    stdin.read_exact(&mut body).step("reading the spec")?;
    serde_json::from_slice(&body).step("reading the spec")
}

fn run() -> Result<std::convert::Infallible, Failed> {
    let spec = read_spec()?;
    // SAFETY: plain descriptor calls on this process's own descriptors.
    unsafe {
        if libc::dup2(0, 3) < 0 {
            return Err(Failed(format!(
                "bridge: {}",
                std::io::Error::last_os_error()
            )));
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        if null < 0 || libc::dup2(null, 0) < 0 {
            return Err(Failed(format!(
                "/dev/null: {}",
                std::io::Error::last_os_error()
            )));
        }
        // Nothing of the gateway's but stdio and the bridge goes further.
        libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
    }
    nix::unistd::setsid().step("setsid")?;
    let mut report = Report::default();
    if let Some(cgroup) = &spec.cgroup {
        std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
            .step("joining the run's cgroup")?;
        report.cgroup = true;
    }
    if let Some((uid, gid)) = spec.drop_to {
        nix::unistd::setgroups(&[]).step("clearing supplementary groups")?;
        let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
        nix::unistd::setresgid(gid, gid, gid).step("setgid")?;
        nix::unistd::setresuid(uid, uid, uid).step("setuid")?;
        // A change of user makes the process undumpable, which leaves its /proc/self files
        // (uid_map and the rest) to root; like any process of that user, it may own them.
        nix::sys::prctl::set_dumpable(true).step("dumpable")?;
    }
    if spec.namespaces {
        enter_namespaces(spec.zygote)?;
        report.namespaces = true;
        report.proc = spec.proc;
        build_view(&spec)?;
    } else if let Some(dir) = &spec.host_workspace {
        nix::unistd::chdir(dir).step("entering the workspace")?;
    }
    if spec.zygote {
        send_report(&report)?;
        return exec_python(&spec);
    }
    limit(&spec.limits)?;
    if spec.landlock {
        let (abi, full) = restrict_filesystem(&spec)?;
        report.landlock_abi = abi;
        report.landlock_fully_enforced = full;
    }
    drop_capabilities()?;
    report.capabilities_dropped = true;
    nix::sys::prctl::set_no_new_privs().step("no_new_privs")?;
    report.no_new_privs = true;
    if spec.seccomp {
        let programs = super::seccomp::programs().step("building the seccomp filter")?;
        super::seccomp::install(&programs).step("installing the seccomp filter")?;
        report.seccomp = true;
    }
    report.uid = nix::unistd::geteuid().as_raw();
    report.gid = nix::unistd::getegid().as_raw();
    report.supplementary_groups = nix::unistd::getgroups()
        .map(|g| g.len())
        .unwrap_or_default();
    send_report(&report)?;
    exec_python(&spec)
}

/// New namespaces; returns in the child that is PID 1 of the new PID namespace. As `root` (the
/// fork server) its user is root inside, so it keeps its capabilities there across `exec`.
fn enter_namespaces(root: bool) -> Result<(), Failed> {
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
    unshare(
        CloneFlags::CLONE_NEWUSER
            | CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWCGROUP,
    )
    .step("creating namespaces")?;
    // The same ids inside as outside: not root in there, so `exec` leaves no capability.
    let (inside_uid, inside_gid) = if root {
        (0, 0)
    } else {
        (uid.as_raw(), gid.as_raw())
    };
    std::fs::write("/proc/self/setgroups", "deny").step("setgroups")?;
    std::fs::write("/proc/self/uid_map", format!("{inside_uid} {uid} 1")).step("uid_map")?;
    std::fs::write("/proc/self/gid_map", format!("{inside_gid} {gid} 1")).step("gid_map")?;
    // SAFETY: this process has a single thread.
    match unsafe { fork() }.step("fork")? {
        ForkResult::Child => {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).step("pdeathsig")?;
            Ok(())
        }
        ForkResult::Parent { child } => {
            // The waiter holds nothing: the gateway sees end-of-file on the pipes and the bridge
            // when the namespace is gone.
            // SAFETY: closing this process's own descriptors.
            unsafe { libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) };
            let code = loop {
                match waitpid(child, None) {
                    Ok(WaitStatus::Exited(_, code)) => break code,
                    Ok(WaitStatus::Signaled(_, signal, _)) => break 128 + signal as i32,
                    Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => break SETUP_FAILED,
                }
            };
            std::process::exit(code);
        }
    }
}

fn mount_err(what: &str, path: &Path) -> impl FnOnce(nix::errno::Errno) -> Failed {
    let message = format!("{what} {}", path.display());
    move |e| Failed(format!("{message}: {e}"))
}

/// Builds the view under `spec.mount_point` and makes it the root.
fn build_view(spec: &Spec) -> Result<(), Failed> {
    let root = spec.mount_point.as_path();
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(mount_err("making private", Path::new("/")))?;
    mount(
        Some("tmpfs"),
        root,
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
    use std::os::unix::fs::PermissionsExt as _;
    let scratch = spec.zygote.then_some((SCRATCH, 0o755));
    for (dir, mode) in [("/dev/shm", 0o1777), ("/tmp", 0o1777), (WORKSPACE, 0o700)]
        .into_iter()
        .chain(scratch)
    {
        let path = inside(Path::new(dir));
        std::fs::create_dir_all(&path).step(dir)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).step(dir)?;
    }
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
    let etc = inside(Path::new("/etc"));
    std::fs::create_dir_all(&etc).step("/etc")?;
    std::fs::write(
        etc.join("passwd"),
        format!("sandbox:x:{uid}:{gid}:sandbox:{WORKSPACE}:/usr/sbin/nologin\n"),
    )
    .step("/etc/passwd")?;
    std::fs::write(etc.join("group"), format!("sandbox:x:{gid}:\n")).step("/etc/group")?;
    if spec.proc {
        let proc = inside(Path::new("/proc"));
        std::fs::create_dir_all(&proc).step("/proc")?;
        mount(
            Some("proc"),
            &proc,
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            none,
        )
        .map_err(mount_err("mounting", Path::new("/proc")))?;
    }
    nix::unistd::chdir(root).step("entering the view")?;
    nix::unistd::pivot_root(".", ".").map_err(mount_err("pivot_root to", root))?;
    // The host's tree is now stacked under the view's root: detach it.
    umount2(".", MntFlags::MNT_DETACH).map_err(mount_err("detaching the host's", root))?;
    nix::unistd::chdir(WORKSPACE).step("entering the workspace")?;
    nix::unistd::sethostname("sandbox").step("hostname")?;
    Ok(())
}

/// Binds `source` at `target` (made empty first), recursively, then makes the whole bind
/// read-only (when asked), nosuid and nodev-free only for device nodes.
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
    set_mount_attributes(target, flags)
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

/// `mount_setattr(2)` over the whole mount tree at `path` (a remount would change only the top
/// mount and must repeat the flags the kernel has locked).
fn set_mount_attributes(path: &Path, set: u64) -> std::io::Result<()> {
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
            AT_RECURSIVE,
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

fn limit(limits: &Limits) -> Result<(), Failed> {
    for (resource, value, name) in [
        (Resource::RLIMIT_AS, limits.address_space_bytes, "RLIMIT_AS"),
        (Resource::RLIMIT_CPU, limits.cpu_seconds, "RLIMIT_CPU"),
        (
            Resource::RLIMIT_FSIZE,
            limits.file_size_bytes,
            "RLIMIT_FSIZE",
        ),
        (Resource::RLIMIT_NOFILE, limits.open_files, "RLIMIT_NOFILE"),
        (Resource::RLIMIT_CORE, 0, "RLIMIT_CORE"),
        // After the user namespace exists: its count is this run's alone.
        (Resource::RLIMIT_NPROC, limits.processes, "RLIMIT_NPROC"),
    ] {
        setrlimit(resource, value, value).step(name)?;
    }
    // Runs yield the CPU to the fleet's own services (the gateway, the scheduler, the model
    // workers): hundreds of runs at once must not starve what serves them. Lowering one's own
    // priority needs no privilege, and a run cannot raise it back (that needs CAP_SYS_NICE).
    // A gateway already nicer than that (started under `nice -n 19`) keeps its niceness: going
    // back up to 10 would need the privilege the sandbox has dropped.
    // SAFETY: getpriority and setpriority have no memory preconditions. (A failed getpriority
    // reads as -1, and the niceness is then set as usual.)
    let current = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if current < RUN_NICENESS
        && unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, RUN_NICENESS) } != 0
    {
        return Err(std::io::Error::last_os_error()).step("setpriority");
    }
    Ok(())
}

/// The least niceness every run has (0 is the default, 19 the lowest priority).
pub const RUN_NICENESS: i32 = 10;

/// What Landlock lets a run read, and write: the view and the run's own directories.
pub fn landlock_paths(spec: &Spec) -> (Vec<PathBuf>, Vec<PathBuf>) {
    if spec.namespaces {
        let mut read: Vec<PathBuf> = spec
            .view
            .iter()
            .filter_map(|e| match e {
                Entry::ReadOnly { path } => Some(path.clone()),
                Entry::Symlink { .. } => None,
            })
            .collect();
        read.extend(["/etc", "/dev", RUNTIME_DIR].map(PathBuf::from));
        if spec.proc {
            read.push("/proc".into());
        }
        let write = [WORKSPACE, "/tmp", "/dev/shm", "/dev/null"].map(PathBuf::from);
        (read, write.into())
    } else {
        let mut read: Vec<PathBuf> = spec
            .view
            .iter()
            .filter_map(|e| match e {
                Entry::ReadOnly { path } => Some(path.clone()),
                Entry::Symlink { .. } => None,
            })
            .collect();
        read.push(spec.runtime.clone());
        read.extend(["/dev/urandom", "/dev/random", "/dev/zero"].map(PathBuf::from));
        let mut write: Vec<PathBuf> = spec.host_workspace.iter().cloned().collect();
        write.push("/dev/null".into());
        (read, write)
    }
}

/// Landlock as a second wall: reads only of what the view holds, writes only to the workspace,
/// `/tmp` and `/dev/shm`, no TCP, no abstract Unix sockets or signals beyond the sandbox.
/// Returns the ABI in force and whether everything asked for is enforced.
fn restrict_filesystem(spec: &Spec) -> Result<(u32, bool), Failed> {
    let abi = ABI::V6;
    let (read, write) = landlock_paths(spec);
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::AbstractUnixSocket | Scope::Signal))
        .and_then(|r| r.create())
        .and_then(|r| {
            r.add_rules(landlock::path_beneath_rules(
                &read,
                AccessFs::from_read(abi),
            ))
        })
        .and_then(|r| {
            r.add_rules(landlock::path_beneath_rules(
                &write,
                AccessFs::from_all(abi),
            ))
        })
        .and_then(|r| r.restrict_self())
        .step("Landlock")?;
    let enforced = match status.landlock {
        LandlockStatus::Available { effective_abi, .. }
            if status.ruleset != RulesetStatus::NotEnforced =>
        {
            (effective_abi as u32).min(abi as u32)
        }
        _ => 0,
    };
    Ok((enforced, status.ruleset == RulesetStatus::FullyEnforced))
}

/// Empties the bounding and ambient sets and the process's own sets.
fn drop_capabilities() -> Result<(), Failed> {
    // SAFETY: prctl and capset with valid arguments; errors are checked.
    unsafe {
        let mut cap = 0;
        // Until the kernel says there is no such capability.
        while libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) >= 0 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0
                && *libc::__errno_location() != libc::EPERM
            {
                return Err(Failed(format!(
                    "dropping capability {cap}: {}",
                    std::io::Error::last_os_error()
                )));
            }
            cap += 1;
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        let header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let data = [
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        if libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) < 0 {
            return Err(Failed(format!(
                "clearing capabilities: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

fn send_report(report: &Report) -> Result<(), Failed> {
    let frame = bridge::encode(report).step("encoding the report")?;
    // SAFETY: descriptor 3 is the bridge, set up above.
    let mut bridge = std::mem::ManuallyDrop::new(unsafe {
        <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(3)
    });
    bridge.write_all(&frame).step("sending the report")
}

fn exec_python(spec: &Spec) -> Result<std::convert::Infallible, Failed> {
    let home = if spec.namespaces {
        PathBuf::from(WORKSPACE)
    } else {
        spec.host_workspace.clone().unwrap_or_else(|| "/".into())
    };
    let tmp = if spec.namespaces {
        PathBuf::from("/tmp")
    } else {
        home.clone()
    };
    let cstring = |s: &[u8]| CString::new(s).step("an argument with a NUL byte");
    let program = cstring(spec.python.as_os_str().as_bytes())?;
    let mut argv = vec![program.clone()];
    for arg in &spec.args {
        argv.push(cstring(arg.as_bytes())?);
    }
    let env = [
        "PATH=/usr/local/bin:/usr/bin:/bin".to_owned(),
        "LANG=C.UTF-8".to_owned(),
        format!("HOME={}", home.display()),
        format!("TMPDIR={}", tmp.display()),
        "NOMAD_BRIDGE_FD=3".to_owned(),
    ]
    .map(|v| CString::new(v).expect("no NUL in fixed strings"));
    let Err(e) = nix::unistd::execve(&program, &argv, &env);
    Err(Failed(format!("exec {}: {e}", spec.python.display())))
}
