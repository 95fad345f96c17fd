//! The sandbox's isolation: one sequence, each step a small function in a fixed order, shared
//! by every way a run starts. A spawned run's init (`nomad-gateway sandbox-init`) goes through
//! all of it; the fork server's init goes through the view and then starts the interpreter,
//! which loads this crate as a shared library and has each child it forks go through the run's
//! steps. A step added here reaches both, and both report the same [`Report`].
//!
//! In order:
//! 1. **descriptors** — the bridge at 3, the run's output at 1 and 2, `/dev/null` at 0, nothing
//!    else; a new session;
//! 2. **the view** ([`Jail::enter_view`]): the run's cgroup where there is one; `nobody` for a
//!    gateway running as root; new user (root inside, the sandbox user outside), mount, network,
//!    PID, IPC, UTS and cgroup namespaces, whose first process builds a private root of
//!    read-only binds (interpreter, system libraries, the runner), four device nodes, its own
//!    `/proc`, pivots into it and makes that root read-only;
//! 3. **the run** ([`Jail::enter_run`]): a user namespace of its own (the sandbox user's id, no
//!    capability outside it), new mount, PID, network, IPC and UTS namespaces; a fresh tmpfs of
//!    the run's size for `/workspace`, `/tmp` and `/dev/shm`; the fork that makes the run's
//!    first process PID 1 of its namespace (with its own `/proc`) and leaves a waiter outside;
//! 4. resource limits and niceness, Landlock, every capability dropped, `no_new_privs`, the
//!    seccomp filter;
//! 5. the report of what holds, with a pidfd of the run's first process, as the bridge's first
//!    frame: the gateway ends a run by killing that process, and the kernel then ends
//!    everything in its namespace.

mod capabilities;
mod descriptors;
mod error;
mod ffi;
pub mod frame;
mod fs_rules;
mod limits;
mod namespaces;
pub mod pidfd;
pub mod seccomp;
pub mod spec;
mod view;
mod waiter;

use std::convert::Infallible;
use std::ffi::CString;
use std::io::Write as _;
use std::os::fd::{AsFd as _, BorrowedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::PathBuf;

use nix::unistd::{Gid, Uid};

pub use error::Failed;
use error::Step as _;
pub use spec::{Entry, LIBRARY, Limits, RUN_NICENESS, RUNTIME_DIR, Report, SETUP_FAILED, Spec};

/// The first argument that selects the init mode of the gateway's binary.
pub const INIT_ARG: &str = "sandbox-init";

/// The largest spec the init reads (a spec is a few KiB: paths and limits).
const MAX_SPEC: usize = 1 << 20;

/// A spec made ready to apply: parsed once, its seccomp filter built once (the fork server
/// prepares one for all its children).
pub struct Jail {
    spec: Spec,
    seccomp: Vec<seccompiler::BpfProgram>,
    landlock: (Vec<PathBuf>, Vec<PathBuf>),
}

impl Jail {
    pub fn new(spec: Spec) -> Result<Self, Failed> {
        let seccomp = if spec.seccomp {
            seccomp::programs().step("building the seccomp filter")?
        } else {
            Vec::new()
        };
        let landlock = fs_rules::paths(&spec);
        Ok(Self {
            spec,
            seccomp,
            landlock,
        })
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Step 2: returns in the first process of the view's namespaces (or, without namespaces,
    /// in this process, in the run's host workspace).
    pub fn enter_view(&self) -> Result<(), Failed> {
        let spec = &self.spec;
        if let Some(cgroup) = &spec.cgroup {
            std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
                .step("joining the run's cgroup")?;
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
        if !spec.namespaces {
            if let Some(dir) = &spec.host_workspace {
                nix::unistd::chdir(dir).step("entering the workspace")?;
            }
            return Ok(());
        }
        let outer = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        namespaces::enter(namespaces::VIEW)?;
        // Root inside, so each run can have a user namespace of its own below (whose maps are
        // written through the view's /proc); without a /proc, the sandbox user as itself.
        let inside = if spec.proc { (0, 0) } else { outer };
        namespaces::map_ids(inside, outer)?;
        namespaces::fork_first_process()?;
        view::build(spec, outer)
    }

    /// Steps 3 to 5: returns in the run's first process, isolated, its report sent. Called
    /// after [`Jail::enter_view`] (a spawned run), or in a child of the fork server.
    pub fn enter_run(&self) -> Result<Report, Failed> {
        let spec = &self.spec;
        let mut report = Report {
            cgroup: spec.cgroup.is_some(),
            ..Report::default()
        };
        if spec.namespaces {
            let mut flags = namespaces::RUN;
            let own_user = spec.proc;
            if own_user {
                flags |= nix::sched::CloneFlags::CLONE_NEWUSER;
            }
            let run_ids = if own_user {
                namespaces::outer_ids()?
            } else {
                (
                    nix::unistd::geteuid().as_raw(),
                    nix::unistd::getegid().as_raw(),
                )
            };
            namespaces::enter(flags)?;
            if own_user {
                namespaces::map_ids(run_ids, (0, 0))?;
            }
            view::mount_run_dirs(spec)?;
            namespaces::fork_first_process()?;
            if spec.proc {
                view::mount_proc(std::path::Path::new("/proc"))?;
            }
            nix::unistd::chdir(spec::WORKSPACE).step("entering the workspace")?;
            report.namespaces = true;
            report.proc = spec.proc;
            report.read_only_root = true;
        }
        limits::apply(&spec.limits)?;
        if spec.landlock {
            let (read, write) = &self.landlock;
            (report.landlock_abi, report.landlock_fully_enforced) =
                fs_rules::restrict(read, write)?;
        }
        capabilities::drop_all()?;
        report.capabilities_dropped = true;
        nix::sys::prctl::set_no_new_privs().step("no_new_privs")?;
        report.no_new_privs = true;
        if spec.seccomp {
            seccomp::install(&self.seccomp).step("installing the seccomp filter")?;
            report.seccomp = true;
        }
        report.uid = nix::unistd::geteuid().as_raw();
        report.gid = nix::unistd::getegid().as_raw();
        report.supplementary_groups = nix::unistd::getgroups()
            .map(|g| g.len())
            .unwrap_or_default();
        let first_process = pidfd::own().step("a pidfd of the run's first process")?;
        send_report(&report, Some(first_process.as_fd()))?;
        Ok(report)
    }
}

/// Runs the init (`nomad-gateway sandbox-init`, its spec the first frame on standard input);
/// never returns. A failure prints `nomad sandbox-init: <step>: <error>` and exits with
/// [`SETUP_FAILED`].
pub fn init_main() -> ! {
    let Err(Failed(message)) = init();
    let _ = writeln!(std::io::stderr(), "nomad sandbox-init: {message}");
    std::process::exit(SETUP_FAILED);
}

fn init() -> Result<Infallible, Failed> {
    // SAFETY: descriptor 0 is the bridge, open for the life of this process.
    let stdin = unsafe { BorrowedFd::borrow_raw(0) };
    let spec = frame::read_blocking(stdin, MAX_SPEC)
        .step("reading the spec")?
        .ok_or_else(|| Failed("reading the spec: the bridge closed".into()))?;
    let spec: Spec = serde_json::from_slice(&spec).step("reading the spec")?;
    descriptors::arrange(0, 1, 2)?;
    nix::unistd::setsid().step("setsid")?;
    let jail = Jail::new(spec)?;
    jail.enter_view()?;
    if jail.spec.zygote {
        let report = Report {
            namespaces: jail.spec.namespaces,
            proc: jail.spec.proc,
            read_only_root: jail.spec.namespaces,
            ..Report::default()
        };
        send_report(&report, None)?;
    } else {
        jail.enter_run()?;
    }
    exec_python(&jail.spec)
}

fn send_report(report: &Report, pidfd: Option<BorrowedFd<'_>>) -> Result<(), Failed> {
    let frame = frame::encode(report).step("encoding the report")?;
    // SAFETY: descriptor 3 is the bridge, placed by `descriptors::arrange`.
    let bridge = unsafe { BorrowedFd::borrow_raw(descriptors::BRIDGE) };
    frame::send(bridge, &frame, pidfd).step("sending the report")
}

fn exec_python(spec: &Spec) -> Result<Infallible, Failed> {
    let home = if spec.namespaces {
        PathBuf::from(spec::WORKSPACE)
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
    // The fork server's children inherit this environment as it is.
    let env = [
        "PATH=/usr/local/bin:/usr/bin:/bin".to_owned(),
        "LANG=C.UTF-8".to_owned(),
        format!("HOME={}", home.display()),
        format!("TMPDIR={}", tmp.display()),
        format!("NOMAD_BRIDGE_FD={}", descriptors::BRIDGE),
    ]
    .into_iter()
    .chain(frame::environment())
    .map(|v| CString::new(v).expect("no NUL in fixed strings"))
    .collect::<Vec<_>>();
    let Err(e) = nix::unistd::execve(&program, &argv, &env);
    Err(Failed(format!("exec {}: {e}", spec.python.display())))
}
