//! What a run can do to outlive or outgrow itself, tried as an attacker would (code sent through
//! `ExecuteCode`), as root and as an unprivileged gateway, on forked and on spawned runs: a run
//! ends as a whole whatever it did to its signals, session or death signal; nothing it changes
//! in the view outlives it; it holds no memory it is not counted for; a forked run sees nothing
//! of the fork server; a fork server that is gone is replaced.

use std::time::{Duration, Instant};

use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::sandbox_gateway::{
    Gateway, SYSCALL_HELPER, Start, processes_named, users_and_starts,
};
use nomad_integration_tests::users::{descendants, gateway_users, parent_of};
use nomad_proto::v1::ExecuteCodeRequest;

/// Python that makes this process and two generations of children escape every way a process
/// can (no death signal, a session of its own, SIGTERM/SIGHUP/SIGINT ignored, orphaned), each
/// named `name`, each then running `payload` and sleeping.
fn escaping(name: &str, payload: &str) -> String {
    format!(
        "\
import ctypes, os, signal, time
libc = ctypes.CDLL(None)
def escape():
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
    libc.prctl(15, b'{name}', 0, 0, 0)  # PR_SET_NAME
    try:
        os.setsid()
    except OSError:
        pass
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
escape()
for _ in range(3):
    if os.fork() == 0:
        escape()
        if os.fork() == 0:
            escape()
{payload}
            time.sleep(600)
        os._exit(0)
time.sleep(600)
"
    )
}

/// A run's processes end with it: at its timeout, when the memory watch ends it, and when the
/// gateway itself is killed, whatever the run did to its death signal, session and signals; and
/// the gateway is left holding nothing of it (no descriptor, no process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_ends_as_a_whole_whatever_it_did_to_its_signals() {
    let sandbox = "  warm: 0\n  timeout_seconds: 3\n  memory_bytes: 268435456\n";
    for case in users_and_starts() {
        let gateway = case.gateway(sandbox).await;
        gateway.still_serving("start-up").await;
        let fds = gateway.open_fds();
        let cases = [
            ("nmd-timeout", "", "timeout"),
            (
                "nmd-memory",
                "            block = b'x' * (100 << 20)",
                "memory: the run held",
            ),
        ];
        for (name, payload, expected) in cases {
            let reply = gateway.run(escaping(name, payload)).await;
            assert!(
                reply.error.starts_with(expected),
                "{case}: {name}: expected {expected:?}, got {}",
                reply.error
            );
            // The answer comes once the run is gone: no grace period.
            assert_eq!(
                processes_named(name),
                Vec::<u32>::new(),
                "{case}: {name}: the run's processes outlived it"
            );
        }
        gateway.still_serving("runs that escaped").await;
        assert!(
            gateway.open_fds() <= fds + 1,
            "{case}: the gateway holds {} descriptors, {fds} before the runs",
            gateway.open_fds()
        );
        gateway.stop().await;

        // The gateway killed mid-run: the run goes with it.
        let gateway = case.gateway("  warm: 0\n  timeout_seconds: 60\n").await;
        let name = "nmd-orphan";
        let mut client = gateway.client.clone();
        let code = escaping(name, "");
        let running = tokio::spawn(async move {
            client
                .execute_code(ExecuteCodeRequest {
                    code,
                    env: Default::default(),
                })
                .await
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        while processes_named(name).len() < 7 {
            assert!(
                Instant::now() < deadline,
                "{case}: the run did not start its processes: {:?}",
                processes_named(name)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        gateway.kill().await;
        let _ = running.await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while !processes_named(name).is_empty() {
            assert!(
                Instant::now() < deadline,
                "{case}: the run outlived its gateway: {:?}",
                processes_named(name)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The view is read-only: a run's attempts to change what every run shares (the root's mode,
/// times and attributes, `/etc/passwd`) are refused with EROFS, and the next run finds the view
/// as it was (and, on the forked path, still starts forked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_run_changes_in_the_view_outlives_it() {
    let attack = "\
import errno, os
out = {}
def attempt(name, op):
    try:
        op()
        out[name] = 'changed'
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
attempt('setxattr /', lambda: os.setxattr('/', 'user.mark', b'1'))
attempt('chmod /etc/passwd', lambda: os.chmod('/etc/passwd', 0))
attempt('utime /', lambda: os.utime('/', (0, 0)))
attempt('chmod /', lambda: os.chmod('/', 0))
attempt('mkdir /planted', lambda: os.mkdir('/planted'))
RESULT = out
";
    let look = "\
import os
RESULT = {
    'root': oct(os.stat('/').st_mode & 0o7777),
    'passwd': open('/etc/passwd').read().startswith('sandbox:'),
    'xattrs': os.listxattr('/'),
    'planted': os.path.exists('/planted'),
    'forked': '--zygote' in open('/proc/self/cmdline').read(),
}
";
    for case in users_and_starts() {
        let gateway = case.gateway("  warm: 0\n").await;
        let seen = gateway.result(&case, attack).await;
        for attempt in [
            "setxattr /",
            "chmod /etc/passwd",
            "utime /",
            "chmod /",
            "mkdir /planted",
        ] {
            assert_eq!(seen[attempt], "EROFS", "{case}: {attempt}: {seen}");
        }
        let after = gateway.result(&case, look).await;
        assert_eq!(after["root"], "0o755", "{case}: {after}");
        assert_eq!(after["passwd"], true, "{case}: {after}");
        assert_eq!(after["xattrs"], serde_json::json!([]), "{case}: {after}");
        assert_eq!(after["planted"], false, "{case}: {after}");
        assert_eq!(
            after["forked"],
            case.start == Start::Forked,
            "{case}: {after}"
        );
        gateway.finish("the attempts on the view").await;
    }
}

/// A run cannot hold memory beyond its bound in a form no process is seen holding: memfds and
/// System V shared memory and message queues are refused (EPERM), and what it keeps in files on
/// its own tmpfs (`/dev/shm` here) counts with what its processes hold, so 360 MiB of files
/// under `memory_bytes` 256 MiB end the run, where 180 MiB do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_holds_no_memory_it_is_not_counted_for() {
    let mut refused = SYSCALL_HELPER.to_owned();
    refused.push_str(&format!(
        "RESULT = {{'memfd_create': call({}, 0, 0), 'memfd_secret': call({}, 0), \
         'shmget': call({}, 0, 1 << 20, 0o1600), 'msgget': call({}, 0, 0o1600)}}\n\
         try:\n    import os\n    os.memfd_create('x')\n    RESULT['os.memfd_create'] = 'created'\n\
         except OSError as e:\n    RESULT['os.memfd_create'] = errno.errorcode[e.errno]\n",
        libc::SYS_memfd_create,
        libc::SYS_memfd_secret,
        libc::SYS_shmget,
        libc::SYS_msgget,
    ));
    let files = |count: usize| {
        format!(
            "import time\nfor i in range({count}):\n    with open(f'/dev/shm/f{{i}}', 'wb') as f:\n        \
             f.write(b'x' * (60 << 20))\ntime.sleep(3)\nRESULT = 'kept'"
        )
    };
    for case in users_and_starts() {
        let gateway = case
            .gateway(
                "  warm: 0\n  timeout_seconds: 20\n  memory_bytes: 268435456\n  \
             disk_bytes: 1073741824\n",
            )
            .await;
        let seen = gateway.result(&case, &refused).await;
        for call in [
            "memfd_create",
            "memfd_secret",
            "shmget",
            "msgget",
            "os.memfd_create",
        ] {
            assert_eq!(seen[call], "EPERM", "{case}: {call}: {seen}");
        }
        let log = gateway.stderr();
        if log.contains("each run's memory as a whole") {
            let over = gateway.run(files(6)).await;
            assert!(
                over.error.starts_with("memory: the run held")
                    && over.error.contains("over sandbox.memory_bytes (256 MiB)"),
                "{case}: 360 MiB of files: {} (result {})",
                over.error,
                over.result_json
            );
            let under = gateway.run(files(3)).await;
            assert_eq!(
                under.result_json, "\"kept\"",
                "{case}: 180 MiB of files: {}",
                under.error
            );
        } else {
            assert!(log.contains("a cgroup per run"), "{case}: {log}");
        }
        gateway.finish("memory in files").await;
    }
}

/// A forked run starts with nothing of the fork server's: no frame of its loop on the stack and
/// none of its state (its children's ids and pids, its sockets) in any frame's locals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_sees_nothing_of_the_fork_server() {
    let look = "\
import sys
frames, names = [], set()
f = sys._getframe()
while f is not None:
    frames.append(f.f_code.co_name)
    names.update(f.f_locals)
    f = f.f_back
RESULT = {'frames': frames, 'state': sorted(names & {'children', 'selector', 'control', 'reaped', 'jail', 'request'})}
";
    for case in users_and_starts() {
        let gateway = case.gateway("  warm: 0\n").await;
        // A run before it, so the fork server has had a child to remember.
        gateway.still_serving("a first run").await;
        let seen = gateway.result(&case, look).await;
        assert!(
            !seen["frames"].to_string().contains("serve"),
            "{case}: {seen}"
        );
        assert_eq!(seen["state"], serde_json::json!([]), "{case}: {seen}");
        gateway.stop().await;
    }
}

/// A fork server that dies is replaced: runs go on meanwhile (each with an interpreter of its
/// own), and a new zygote forks them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_server_that_is_gone_is_replaced() {
    let forked = "RESULT = '--zygote' in open('/proc/self/cmdline').read()";
    for run_as in gateway_users() {
        let who = run_as.label;
        let gateway = Gateway::start_on(&run_as, Start::Forked, "  warm: 0\n").await;
        assert_eq!(gateway.result(who, forked).await, true, "{who}");
        let zygote = zygote_of(gateway.pid).expect("a fork server");
        send_signal(zygote, libc::SIGKILL);
        gateway.still_serving("the fork server's death").await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if gateway.result(who, forked).await == true {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{who}: no run was forked again within 20 s:\n{}",
                gateway.stderr()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_ne!(zygote_of(gateway.pid), Some(zygote), "{who}");
        assert!(
            gateway.stderr().contains("replaced by a new one"),
            "{who}: {}",
            gateway.stderr()
        );
        gateway.stop().await;
    }
}

/// The zygote of the gateway `pid`: the interpreter started with `--zygote` by a `sandbox-init`.
fn zygote_of(pid: u32) -> Option<u32> {
    let cmdline = |p: u32| {
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
            .into_owned()
    };
    descendants(pid).into_iter().find(|&p| {
        cmdline(p).contains("\0--zygote") && cmdline(parent_of(p)).contains("sandbox-init")
    })
}
