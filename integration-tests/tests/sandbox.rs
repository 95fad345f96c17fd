//! The sandbox as an attacker meets it: every containment asserts its specific denial, the
//! gateway keeps serving after each, and each test runs the gateway as root and as an
//! unprivileged user with a supplementary group (see `users`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_integration_tests::Fleet;
use nomad_integration_tests::process::binary;
use nomad_integration_tests::sandbox_gateway::{
    Case, Gateway, SYSCALL_HELPER, run_code, users_and_starts,
};
use nomad_integration_tests::users::{
    RUNNER, RunAs, TEST_GROUP, descendants_running, gateway_users, group_id, sandbox_runs,
};
use nomad_proto::v1::ExecuteCodeRequest;
use serde::Deserialize as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_code_meets_the_specific_denial_and_the_gateway_keeps_serving() {
    for case in users_and_starts() {
        hostile_code(&case).await;
    }
}

async fn hostile_code(case: &Case) {
    let (run_as, who) = (&case.run_as, case);
    let gateway = case.gateway("  warm: 0\n").await;
    let dir = gateway.dir.clone();

    // A named Unix socket the gateway's own user listens on, outside the sandbox.
    let socket_path = dir.join("outside.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket_path).unwrap();
    listener.set_nonblocking(true).unwrap();
    run_as.own(&socket_path);
    let code = format!(
        "import socket\nout = {{}}\nfor path in [{path:?}, '/proc/self/root' + {path:?}, \
         '/proc/{pid}/root' + {path:?}]:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n        \
         s.connect(path)\n        out[path] = 'connected'\n    except OSError as e:\n        \
         out[path] = type(e).__name__\nRESULT = out",
        path = socket_path.display().to_string(),
        pid = gateway.pid,
    );
    let seen = gateway.result(who, &code).await;
    for (path, outcome) in seen.as_object().unwrap() {
        assert_eq!(outcome, "FileNotFoundError", "{who}: connect {path}");
    }
    assert!(
        listener.accept().is_err(),
        "{who}: the sandbox reached the socket"
    );
    gateway.still_serving("the Unix socket").await;

    // Every socket family but AF_UNIX is refused by the filter (EPERM).
    let seen = gateway
        .result(
            who,
            "import socket\nout = {}\nfor name, family, kind in [('AF_INET', socket.AF_INET, \
             socket.SOCK_STREAM), ('AF_INET6', socket.AF_INET6, socket.SOCK_STREAM), \
             ('AF_NETLINK', socket.AF_NETLINK, socket.SOCK_RAW), ('AF_PACKET', \
             socket.AF_PACKET, socket.SOCK_RAW)]:\n    try:\n        socket.socket(family, \
             kind)\n        out[name] = 'created'\n    except OSError as e:\n        out[name] = \
             type(e).__name__ + ' ' + str(e.errno)\nRESULT = out",
        )
        .await;
    for family in ["AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"] {
        assert_eq!(
            seen[family],
            format!("PermissionError {}", libc::EPERM),
            "{who}: {family}"
        );
    }
    gateway.still_serving("sockets").await;

    // Namespaces, mounts, bpf, io_uring and the rest: EPERM from the filter; clone3 ENOSYS.
    let calls: Vec<(&str, i64, Vec<i64>)> = vec![
        (
            "unshare",
            libc::SYS_unshare,
            vec![libc::CLONE_NEWUSER as i64],
        ),
        (
            "clone",
            libc::SYS_clone,
            vec![(libc::CLONE_NEWUSER | libc::SIGCHLD) as i64, 0, 0, 0, 0],
        ),
        ("clone3", libc::SYS_clone3, vec![0, 0]),
        ("setns", libc::SYS_setns, vec![0, 0]),
        ("mount", libc::SYS_mount, vec![0, 0, 0, 0, 0]),
        ("bpf", libc::SYS_bpf, vec![0, 0, 0]),
        ("io_uring_setup", libc::SYS_io_uring_setup, vec![1, 0]),
        ("userfaultfd", libc::SYS_userfaultfd, vec![1]),
        (
            "perf_event_open",
            libc::SYS_perf_event_open,
            vec![0, 0, -1, -1, 0],
        ),
        ("keyctl", libc::SYS_keyctl, vec![0, -3, 0]),
        ("ptrace", libc::SYS_ptrace, vec![0, 0, 0, 0]),
    ];
    let mut code = SYSCALL_HELPER.to_owned();
    code.push_str("RESULT = {}\n");
    for (name, nr, args) in &calls {
        let args: Vec<String> = args.iter().map(i64::to_string).collect();
        code.push_str(&format!(
            "RESULT[{name:?}] = call({nr}, {})\n",
            args.join(", ")
        ));
    }
    code.push_str(
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n\
         RESULT['status'] = {k: status[k].strip() for k in ['Seccomp', 'NoNewPrivs', 'CapEff', 'CapBnd', 'Uid']}\n",
    );
    let seen = gateway.result(who, &code).await;
    for (name, _, _) in &calls {
        let expected = if *name == "clone3" { "ENOSYS" } else { "EPERM" };
        assert_eq!(seen[name], expected, "{who}: {name}");
    }
    let status = &seen["status"];
    assert_eq!(status["Seccomp"], "2", "{who}: {status}");
    assert_eq!(status["NoNewPrivs"], "1", "{who}");
    assert_eq!(status["CapEff"], "0000000000000000", "{who}");
    assert_eq!(status["CapBnd"], "0000000000000000", "{who}");
    let uid = status["Uid"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    assert_ne!(uid, "0", "{who}: the code runs as root");
    gateway.still_serving("system calls").await;

    // Nothing of the host's but the interpreter and libraries is in view.
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let secret_of_group = dir.join("group-secret.txt");
    std::fs::write(&secret_of_group, "group-secret-content").unwrap();
    if let Some(gid) = group_id(TEST_GROUP) {
        std::os::unix::fs::chown(&secret_of_group, Some(0), Some(gid)).unwrap();
        std::fs::set_permissions(
            &secret_of_group,
            std::os::unix::fs::PermissionsExt::from_mode(0o640),
        )
        .unwrap();
    }
    let paths = [
        "/run".to_owned(),
        "/home".to_owned(),
        "/var".to_owned(),
        "/root".to_owned(),
        "/sys".to_owned(),
        models.display().to_string(),
        gateway.config.display().to_string(),
        secret_of_group.display().to_string(),
        format!("/proc/{}/environ", gateway.pid),
    ];
    let code = format!(
        "import os\nout = {{}}\nfor path in {paths:?}:\n    if not os.path.lexists(path):\n        \
         out[path] = 'absent'\n        continue\n    try:\n        if os.path.isdir(path):\n            \
         os.listdir(path)\n            out[path] = 'listed'\n        else:\n            \
         out[path] = 'read: ' + open(path).read()[:40]\n    except OSError as e:\n        \
         out[path] = type(e).__name__\n\
         out['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n\
         out['environ'] = 'hunter2' in str(os.environ)\nRESULT = out"
    );
    let seen = gateway.result(who, &code).await;
    for path in &paths {
        assert_eq!(seen[path.as_str()], "absent", "{who}: {path} is in view");
    }
    let pids = seen["pids"].as_array().unwrap();
    assert_eq!(pids[0], 1, "{who}: the runner is PID 1 of its namespace");
    assert!(pids.len() <= 3, "{who}: other processes in view: {pids:?}");
    assert_eq!(
        seen["environ"], false,
        "{who}: the gateway's environment leaked"
    );
    gateway.still_serving("reading the host").await;

    // Signals cannot reach the gateway: its pid is not even in the namespace.
    let reply = gateway
        .run(format!(
            "import os, signal\ntry:\n    os.kill({}, signal.SIGKILL)\n    RESULT = 'signalled'\n\
             except OSError as e:\n    RESULT = type(e).__name__",
            gateway.pid
        ))
        .await;
    assert_eq!(
        reply.result_json, "\"ProcessLookupError\"",
        "{who}: {}",
        reply.error
    );
    gateway.still_serving("the signal").await;

    // The usual bombs end at their limits.
    let bombs = [
        ("infinite loop", "while True:\n    pass\n", "timeout"),
        (
            "memory bomb",
            "blob = bytearray(8 * 1024**3)\n",
            "MemoryError",
        ),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            "timeout",
        ),
    ];
    for (name, code, expected) in bombs {
        let reply = gateway.run(code).await;
        assert!(
            reply.error.contains(expected),
            "{who}: {name}: expected {expected:?}, got {}",
            reply.error
        );
        gateway.still_serving(name).await;
    }
    // What holds is reported: every layer but the per-run cgroup (none is delegated on a CI
    // host), and the groups the kernel keeps for an unprivileged user's namespace.
    let status = gateway.status().await;
    for layer in &status.sandbox_layers {
        if layer.name != "cgroup" {
            assert!(
                layer.in_force,
                "{who}: {} not in force: {status:?}",
                layer.name
            );
        }
    }
    let groups = if run_as.ids.is_some() { 2 } else { 0 };
    if run_as.ids.is_some() || run_as.label == "root" {
        assert_eq!(status.supplementary_groups, groups, "{who}: {status:?}");
    }
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_files_and_cleanup_are_bounded() {
    let sandbox = "  warm: 0\n  disk_bytes: 16777216\n  max_files: 4096\n";
    for case in users_and_starts() {
        let gateway = case.gateway(sandbox).await;
        // Past disk_bytes, /tmp (a private tmpfs, which also holds the workspace) is full.
        let seen = gateway
            .result(
                &case,
                "import errno\nwritten = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        \
                 for _ in range(64):\n            f.write(b'x' * (1 << 20))\n            \
                 f.flush()\n            written += 1\n    RESULT = ['wrote', written]\n\
                 except OSError as e:\n    RESULT = [errno.errorcode[e.errno], written]",
            )
            .await;
        assert_eq!(seen[0], "ENOSPC", "{case}: {seen}");
        assert!(seen[1].as_u64().unwrap() <= 16, "{case}: {seen}");
        // 100,000 files stop at max_files.
        let seen = gateway
            .result(
                &case,
                "import errno, os\nmade = 0\ntry:\n    for i in range(100000):\n        \
                 open(f'f{i}', 'w').close()\n        made += 1\n    RESULT = ['made', made]\n\
                 except OSError as e:\n    RESULT = [errno.errorcode[e.errno], made]",
            )
            .await;
        assert_eq!(seen[0], "ENOSPC", "{case}: {seen}");
        assert!(seen[1].as_u64().unwrap() < 4096, "{case}: {seen}");
        // A workspace made unreadable is gone all the same: nothing of a run is on the host.
        let private: Vec<PathBuf> = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("nomad-gateway-"))
                    && std::fs::metadata(p)
                        .is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == case.run_as.uid())
            })
            .collect();
        let before: Vec<Vec<PathBuf>> = private.iter().map(|p| tree(p)).collect();
        let reply = gateway
            .run(
                "import os\nos.makedirs('deep/er')\nopen('deep/er/f', 'w').write('x')\n\
                 os.chmod('deep/er', 0)\nos.chmod('deep', 0)\nos.chmod('.', 0)\nRESULT = 'locked'",
            )
            .await;
        assert_eq!(reply.result_json, "\"locked\"", "{case}: {}", reply.error);
        let after: Vec<Vec<PathBuf>> = private.iter().map(|p| tree(p)).collect();
        assert_eq!(
            before, after,
            "{case}: a run left files in the gateway's directory"
        );
        assert!(
            after
                .iter()
                .flatten()
                .all(|p| !p.to_string_lossy().contains("deep")),
            "{case}"
        );
        gateway.finish("the locked workspace").await;
    }
}

/// Every path under `dir`.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            out.push(entry.path());
            out.extend(tree(&entry.path()));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_private_directory_cannot_be_planted() {
    for run_as in gateway_users() {
        let who = run_as.label;
        let base = Fleet::new_dir();
        run_as.own(&base);
        // Planted where a predictable name would have been, and a directory others can write.
        let target = Fleet::new_dir();
        std::os::unix::fs::symlink(&target, base.join("nomad-gateway-planted")).unwrap();
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for (dir, expected) in [
            (&open, "writable by other users and not sticky"),
            (&link, "is not a directory (a symlink is refused too)"),
        ] {
            let failed =
                start_failure(&run_as, &format!("  workspace_dir: {}\n", dir.display())).await;
            assert!(failed.contains(expected), "{who}: {failed}");
        }
        let gateway =
            Gateway::start(&run_as, &format!("  workspace_dir: {}\n", base.display())).await;
        let made: Vec<PathBuf> = std::fs::read_dir(&base)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| !p.is_symlink() && p.is_dir() && *p != open)
            .collect();
        assert_eq!(made.len(), 1, "{who}: {made:?}");
        let meta = std::fs::symlink_metadata(&made[0]).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(&meta),
            run_as.uid(),
            "{who}"
        );
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0o755
        );
        assert!(
            std::fs::read_dir(&target).unwrap().next().is_none(),
            "{who}: wrote through the symlink"
        );
        assert_eq!(gateway.run("RESULT = 1").await.result_json, "1");
        gateway.stop().await;
        assert!(
            !made[0].exists(),
            "{who}: the private directory outlived the gateway"
        );
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&target);
    }
}

/// Starts a gateway that must fail; returns what it said.
async fn start_failure(run_as: &RunAs, sandbox_yaml: &str) -> String {
    let dir = Fleet::new_dir();
    run_as.own(&dir);
    let config = dir.join("nomad.yaml");
    std::fs::write(&config, format!("sandbox:\n{sandbox_yaml}")).unwrap();
    let out = run_as
        .command(&binary("nomad-gateway"))
        .env_clear()
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0", "--mcp-listen", "127.0.0.1:0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_calls_are_answered_within_the_bounds() {
    for run_as in gateway_users() {
        let who = run_as.label;
        let gateway = Gateway::start(
            &run_as,
            "  warm: 2\n  max_concurrent: 4\n  max_queued: 40\n",
        )
        .await;
        let rss = |pid: u32| -> u64 {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap()
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
                .unwrap()
        };
        let rss_before = rss(gateway.pid);
        let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sampler = {
            let (most, pid) = (most.clone(), gateway.pid);
            tokio::spawn(async move {
                loop {
                    most.fetch_max(sandbox_runs(pid), std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let calls = (0..200).map(|i| {
            let mut client = gateway.client.clone();
            async move {
                client
                    .execute_code(ExecuteCodeRequest {
                        code: format!("import time\ntime.sleep(0.2)\nRESULT = {i}"),
                        env: Default::default(),
                    })
                    .await
            }
        });
        let replies = futures::future::join_all(calls).await;
        let (mut ok, mut refused) = (0, 0);
        for (i, reply) in replies.iter().enumerate() {
            match reply {
                Ok(r) => {
                    assert_eq!(
                        r.get_ref().result_json,
                        i.to_string(),
                        "{who}: {}",
                        r.get_ref().error
                    );
                    ok += 1;
                }
                Err(status) => {
                    assert_eq!(
                        status.code(),
                        tonic::Code::ResourceExhausted,
                        "{who}: {status}"
                    );
                    assert!(
                        status.message().contains("sandbox.max_queued")
                            || status.message().contains("sandbox.max_concurrent"),
                        "{who}: {}",
                        status.message()
                    );
                    refused += 1;
                }
            }
        }
        sampler.abort();
        let status = gateway.status().await;
        eprintln!("{who}: {ok} ran, {refused} refused; {status:?}");
        assert_eq!(ok + refused, 200);
        assert!(ok >= 40, "{who}: only {ok} ran");
        assert!(
            refused > 0,
            "{who}: 200 calls against 4 slots and 40 places should refuse some"
        );
        let most = most.load(std::sync::atomic::Ordering::Relaxed);
        assert!(most >= 1, "{who}: the sampler never saw a sandbox Python");
        assert!(
            most <= 4,
            "{who}: {most} sandbox Pythons at once (max_concurrent 4)"
        );
        let growth_mib = rss(gateway.pid).saturating_sub(rss_before) / 1024;
        assert!(
            growth_mib < 64,
            "{who}: the gateway's RSS grew {growth_mib} MiB"
        );
        let alive = gateway.run("RESULT = 40 + 2").await;
        assert_eq!(alive.result_json, "42", "{}", alive.error);
        gateway.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_has_a_budget_of_bridge_calls() {
    let run_as = &gateway_users()[0];
    let gateway = Gateway::start(run_as, "  warm: 0\n  max_tool_calls: 5\n").await;
    let seen = gateway
        .result(
            run_as.label,
            "import sys\nbridge = next(f for f in sys.meta_path if hasattr(f, 'bridge')).bridge\n\
             out = []\nfor _ in range(8):\n    try:\n        bridge.request('list_servers', {})\n        \
             out.append('ok')\n    except Exception as e:\n        out.append(str(e))\nRESULT = out",
        )
        .await;
    let seen = Vec::<&str>::deserialize(&seen).unwrap();
    assert_eq!(&seen[..5], ["ok"; 5]);
    for refused in &seen[5..] {
        assert!(
            refused.contains("used its 5 bridge calls (sandbox.max_tool_calls)"),
            "{refused}"
        );
    }
    gateway.finish("the call budget").await;
}

/// An exception's text is bounded as stderr is: a 6 MiB message comes back cut, naming its
/// size, and the gateway serves on (as root and as an unprivileged user).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_exception_message_is_cut_like_stderr() {
    for run_as in gateway_users() {
        let gateway = Gateway::start(&run_as, "  warm: 0\n").await;
        let reply = gateway.run("raise ValueError('E' * (6 << 20))").await;
        assert!(
            reply.error.len() < 200 << 10,
            "{}: the error is {} bytes",
            run_as.label,
            reply.error.len()
        );
        assert!(
            reply.error.contains("ValueError: EEEE")
                && reply.error.contains("6291456 bytes in all, cut at"),
            "{}: {}",
            run_as.label,
            &reply.error[reply.error.len().saturating_sub(300)..]
        );
        gateway.finish("a huge exception").await;
    }
}

/// What a run sends is bounded before the gateway holds or parses it (as root and as an
/// unprivileged user): a frame declaring more than the run's limit ends the run naming the
/// limit, unread; a call over `max_call_bytes` fails in the run with a message; a RESULT over
/// `result_limit` comes as its size alone. Three million numbers as RESULT (6 MiB of JSON, which
/// the gateway once parsed whole: by estimate about 100 MiB at 32 bytes a parsed number) leave
/// its peak memory within 48 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_run_sends_is_bounded_before_the_gateway_holds_it() {
    for run_as in gateway_users() {
        let gateway = Gateway::start(&run_as, "  warm: 0\n").await;
        gateway.still_serving("start-up").await;
        let before = nomad_integration_tests::users::peak_rss_kib(gateway.pid);
        let label = run_as.label;

        // A raw frame header declaring 8 MiB, written straight to the bridge.
        let raw = gateway
            .run(
                "import os, sys, time\nfd = sys.modules['__main__']._FD\n\
                 os.write(fd, (8 << 20).to_bytes(4, 'big'))\ntime.sleep(0.5)",
            )
            .await;
        assert!(
            raw.error
                .contains("bridge frame of 8388608 bytes exceeds the 4259840-byte limit"),
            "{label}: {}",
            raw.error
        );

        // A call over max_call_bytes never leaves the run.
        let call = gateway
            .result(
                label,
                "import sys\nbridge = next(f for f in sys.meta_path if hasattr(f, 'bridge')).bridge\n\
                 try:\n    bridge.request('call_tool', {'server': 'nomad', 'tool': 'embed', \
                 'arguments': {'text': 'x' * (5 << 20)}})\n    RESULT = 'sent'\n\
                 except Exception as e:\n    RESULT = str(e)",
            )
            .await;
        let call = call.as_str().unwrap();
        assert!(
            call.contains("a call may send at most 4194304 (sandbox.max_call_bytes)"),
            "{label}: {call}"
        );

        // A RESULT over the limit: its size, not its bytes.
        let big = gateway.run("RESULT = [0] * (3 << 20)").await;
        assert!(
            big.error
                .contains("result too large: RESULT is 6291457 bytes of JSON, the limit is 65536"),
            "{label}: {}",
            big.error
        );
        let grown_mib = (nomad_integration_tests::users::peak_rss_kib(gateway.pid)
            .saturating_sub(before))
            / 1024;
        assert!(
            grown_mib < 48,
            "{label}: the gateway's peak memory grew {grown_mib} MiB"
        );
        gateway.finish("oversized frames").await;
    }
}

/// Where no cgroup bounds a run (the gateway's log says which bound holds), its processes
/// together stay within `memory_bytes`: four processes of 300 MiB each, every one within its own
/// address-space limit of 512 MiB, end the run as over its memory, as root and as an
/// unprivileged user. With a cgroup, memory.max ends it instead (no RESULT either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_bounded_as_a_whole_not_per_process() {
    let code = "\
import os, time
for _ in range(4):
    if os.fork() == 0:
        block = b'x' * (300 << 20)
        time.sleep(30)
        os._exit(0)
time.sleep(30)
RESULT = 'survived'
";
    let sandbox = "  warm: 0\n  timeout_seconds: 20\n  memory_bytes: 536870912\n";
    for case in users_and_starts() {
        let gateway = case.gateway(sandbox).await;
        gateway.still_serving("start-up").await;
        let log = std::fs::read_to_string(gateway.dir.join("gateway.stderr")).unwrap();
        let watched = log.contains("each run's memory as a whole");
        let started = Instant::now();
        let reply = gateway.run(code).await;
        assert_eq!(
            reply.result_json, "null",
            "{case}: the run survived: {}",
            reply.error
        );
        if watched {
            assert!(
                reply.error.starts_with("memory: the run held")
                    && reply.error.contains("over sandbox.memory_bytes (512 MiB)"),
                "{case}: {}",
                reply.error
            );
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "{case}: stopped only after {:?}",
                started.elapsed()
            );
        } else {
            assert!(log.contains("a cgroup per run"), "{case}: {log}");
        }
        gateway.finish("a run over its memory").await;
    }
}

/// Runs are admitted by what they hold: with a 192 MiB budget for all runs, two runs holding
/// 80 MiB each leave no room for a third (each counts 32 MiB until sampled), so it waits until
/// one of them ends; with room in the budget it runs at once. As root and as an unprivileged
/// user (whose gateway must read its runs' memory from /proc).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_admitted_by_the_memory_they_hold() {
    let holder = "import time\nblock = b'x' * (80 << 20)\ntime.sleep(4)\nRESULT = 'held'";
    for run_as in gateway_users() {
        let label = run_as.label;
        for (budget_mib, waits) in [(192u64, true), (4096, false)] {
            let gateway = Gateway::start(
                &run_as,
                &format!(
                    "  warm: 0\n  timeout_seconds: 10\n  memory_bytes: 201326592\n  \
                     memory_budget_bytes: {}\n",
                    budget_mib << 20
                ),
            )
            .await;
            let started = Instant::now();
            let holders: Vec<_> = (0..2)
                .map(|_| {
                    let mut client = gateway.client.clone();
                    tokio::spawn(async move {
                        let reply = run_code(&mut client, holder).await;
                        (reply, started.elapsed())
                    })
                })
                .collect();
            // Long enough for the holders' memory to be sampled (every 200 ms).
            tokio::time::sleep(Duration::from_millis(1200)).await;
            let third = gateway.run("RESULT = 'third'").await;
            let third_done = started.elapsed();
            let mut first_done = Duration::MAX;
            for holder in holders {
                let (reply, done) = holder.await.unwrap();
                assert_eq!(reply.result_json, "\"held\"", "{label}: {}", reply.error);
                first_done = first_done.min(done);
            }
            assert_eq!(third.result_json, "\"third\"", "{label}: {}", third.error);
            if waits {
                assert!(
                    third_done >= first_done,
                    "{label}, {budget_mib} MiB: the third run did not wait for a holder to end \
                     ({third_done:?} < {first_done:?})"
                );
            } else {
                assert!(
                    third_done + Duration::from_millis(500) < first_done,
                    "{label}, {budget_mib} MiB: with room, the third run should not wait \
                     ({third_done:?}, first holder done {first_done:?})"
                );
            }
            gateway.stop().await;
        }
    }
}

/// Nothing of one run is in the next — not its files (in `/workspace`, `/tmp` or `/dev/shm`), not
/// its processes (a sleeper it left is gone, and a run sees only its own), not its memory (a
/// module it changed is as imported) — and two runs at once do not see each other's processes.
/// As root and as an unprivileged gateway, forked and spawned; the gateway says which, so one
/// path cannot pass for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_one_run_is_in_the_next() {
    let first = "\
import json, os, subprocess
for d in ('/workspace', '/tmp', '/dev/shm'):
    open(d + '/left-behind', 'w').write('secret')
json.LEFT_BEHIND = 'secret'
subprocess.Popen(['sleep', '30'], start_new_session=True)
RESULT = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
";
    let next = "\
import json, os
RESULT = {
    'files': [d for d in ('/workspace', '/tmp', '/dev/shm') if os.path.exists(d + '/left-behind')],
    'memory': hasattr(json, 'LEFT_BEHIND'),
    'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
    'cmdlines': [open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()],
}
";
    for case in users_and_starts() {
        let gateway = case.gateway("  warm: 0\n").await;
        let seen = gateway.result(&case, first).await;
        assert_eq!(seen[0], 1, "{case}: a run is PID 1 of its own: {seen}");
        let after = gateway.result(&case, next).await;
        assert_eq!(after["files"], serde_json::json!([]), "{case}: {after}");
        assert_eq!(after["memory"], false, "{case}: {after}");
        assert_eq!(after["pids"], serde_json::json!([1]), "{case}: {after}");
        assert!(
            !after["cmdlines"].to_string().contains("sleep"),
            "{case}: {after}"
        );
        // Two at once: one waits while the other looks.
        let waiting = gateway.run("import time\ntime.sleep(2)\nRESULT = 1");
        let looking = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            gateway.result(&case, next).await
        };
        let (waited, looked) = tokio::join!(waiting, looking);
        assert_eq!(waited.result_json, "1", "{case}: {}", waited.error);
        assert_eq!(looked["pids"], serde_json::json!([1]), "{case}: {looked}");
        gateway.finish("forked runs").await;
    }
}

/// A sandbox's spec (its paths, limits and user) travels on the bridge, not on a command line
/// that `ps` shows every user: a waiting warm runner's init reads `sandbox-init` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_spec_is_not_on_a_command_line() {
    for run_as in gateway_users() {
        let gateway = Gateway::start(&run_as, "  warm: 1\n").await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while descendants_running(gateway.pid, RUNNER) == 0 {
            assert!(
                Instant::now() < deadline,
                "{}: no warm runner within 20 s",
                run_as.label
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            descendants_running(gateway.pid, "sandbox-init") >= 1,
            "{}: the warm runner's init is not there to look at",
            run_as.label
        );
        for spec_field in ["mount_point", "disk_bytes", "drop_to"] {
            assert_eq!(
                descendants_running(gateway.pid, spec_field),
                0,
                "{}: `{spec_field}` is on a sandbox process's command line",
                run_as.label
            );
        }
        let reply = gateway.run("RESULT = 40 + 2").await;
        assert_eq!(reply.result_json, "42", "{}: {}", run_as.label, reply.error);
        gateway.stop().await;
    }
}

/// Runs yield the CPU to the fleet's services: every run starts at niceness 10 and cannot raise
/// its priority back (as root and as an unprivileged user). A gateway started nicer than that
/// (`nice -n 19`) still runs code, at its own niceness (the sandbox cannot go back up to 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_yields_the_cpu_and_cannot_take_it_back() {
    let code = "\
import errno, os
before = os.getpriority(os.PRIO_PROCESS, 0)
try:
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    raised = 'raised'
except PermissionError as e:
    raised = 'refused: ' + errno.errorcode[e.errno]
RESULT = [before, raised, os.getpriority(os.PRIO_PROCESS, 0)]
";
    // The run started at `nice`, was refused a higher priority, and kept `nice`.
    let at_nice = |seen: &serde_json::Value, nice: i64, who: &str| {
        assert_eq!(seen[0], nice, "{who}: {seen}");
        let refused = seen[1].as_str().unwrap_or_default();
        assert!(
            refused == "refused: EACCES" || refused == "refused: EPERM",
            "{who}: {seen}"
        );
        assert_eq!(seen[2], nice, "{who}: {seen}");
    };
    for case in users_and_starts() {
        let gateway = case.gateway("  warm: 0\n").await;
        at_nice(
            &gateway.result(case.run_as.label, code).await,
            10,
            &case.to_string(),
        );
        gateway.stop().await;

        let yaml = format!("{}  warm: 0\n", case.start.yaml());
        let niced = Gateway::start_niced(&case.run_as, &yaml, "127.0.0.1:9", 19).await;
        let seen = niced.result(case.run_as.label, code).await;
        at_nice(&seen, 19, &format!("{case} under nice 19"));
        niced.stop().await;
    }
}

/// What runs send over their bridges is bounded for all runs together: two runs, each with eight
/// calls of 1.5 million numbers in flight (3 MB of JSON each, about 48-96 MiB once parsed)
/// against a scheduler that accepts and never answers, leave the gateway's peak memory within
/// its 256 MiB bridge budget, where holding them all would take over 750 MiB. As root and as an
/// unprivileged user; the gateway serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_all_runs_send_is_bounded_together() {
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    let code = "\
import sys, threading
bridge = next(f for f in sys.meta_path if hasattr(f, 'bridge')).bridge
def call():
    try:
        bridge.request('call_tool', {'server': 'nomad', 'tool': 'embed',
                                     'arguments': {'input': [0] * 1_500_000}})
    except Exception:
        pass
threads = [threading.Thread(target=call) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
RESULT = 'sent'
";
    for run_as in gateway_users() {
        let label = run_as.label;
        let gateway = Gateway::start_with_scheduler(
            &run_as,
            "  warm: 0\n  timeout_seconds: 8\n  bridge_memory_bytes: 268435456\n",
            &hole_addr,
        )
        .await;
        gateway.still_serving("start-up").await;
        let before = nomad_integration_tests::users::peak_rss_kib(gateway.pid);
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let mut client = gateway.client.clone();
                tokio::spawn(async move { run_code(&mut client, code).await })
            })
            .collect();
        for run in runs {
            run.await.unwrap();
        }
        let grown_mib = (nomad_integration_tests::users::peak_rss_kib(gateway.pid) - before) >> 10;
        assert!(
            grown_mib < 320,
            "{label}: the gateway's peak memory grew by {grown_mib} MiB"
        );
        gateway
            .still_serving("calls held by a silent scheduler")
            .await;
        gateway.stop().await;
    }
}
