"""The sandbox's fork server: one interpreter, already isolated and with the runtime imported,
that forks a child per run instead of starting a Python per run.

    python -I -B /nomad/runner.py --zygote MODULE,...

The gateway's `sandbox-init` starts it in new user, mount, network, PID, IPC and UTS namespaces
behind the filesystem view, as root of its own user namespace (so it may make namespaces for its
children) with no other privilege. It imports the runtime, then serves requests on its control
socket (descriptor 3): the first frame is its settings (JSON); each later one is `fork`, with the
run's bridge, stdout and stderr as SCM_RIGHTS, or `kill`. It answers `exited` for each child.

Each child, before any of the run's code:
1. takes its descriptors and a new session;
2. enters a new user namespace of its own (the sandbox user's id, no capability outside it) and
   new mount, PID, network, IPC and UTS namespaces;
3. mounts a fresh tmpfs of the run's size for `/workspace`, `/tmp` and `/dev/shm`, so nothing
   another run wrote is there, and forks into its PID namespace (its own `/proc`, in which no
   other run's process exists);
4. sets the run's resource limits and niceness, `no_new_privs`, Landlock (reads of the view,
   writes to its own directories, no TCP, signals and abstract sockets scoped to itself), drops
   every capability and installs the gateway's seccomp filter;
5. reports what holds on the bridge, as `sandbox-init` does for a run it starts itself, and runs.

Memory: a child is a copy-on-write copy of the zygote, which holds only the runtime (no run ever
ran in it), so nothing of one run is in the next.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_READ, PR_CAPBSET_DROP = 1, 22, 23, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}[os.uname().machine]
SETUP_FAILED = 125
# Where a child mounts its tmpfs before binding its parts into place (made by sandbox-init).
SCRATCH = "/nomad-run"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    pass


def _check(result, what):
    if result < 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")
    return result


def _mount(source, target, fstype, flags, data=None):
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mounting {target}",
    )


def _prctl(option, arg2=0, arg3=0, what="prctl"):
    return _check(
        _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)),
        what,
    )


def _landlock(settings):
    """Landlock as `sandbox-init` sets it; returns (ABI in force, fully enforced)."""
    abi = _libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi <= 0:
        return 0, False
    wanted = 6
    used = min(abi, wanted)
    fs_all = (1 << 13) - 1
    if used >= 2:
        fs_all |= 1 << 13  # REFER
    if used >= 3:
        fs_all |= 1 << 14  # TRUNCATE
    if used >= 5:
        fs_all |= 1 << 15  # IOCTL_DEV
    fs_read = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
    file_only = 1 | 2 | 4 | (1 << 14) | (1 << 15)
    net = 3 if used >= 4 else 0
    scoped = 3 if used >= 6 else 0
    size = 24 if used >= 6 else 16 if used >= 4 else 8
    attr = struct.pack("<QQQ", fs_all, net, scoped)[:size]
    ruleset = _check(
        _libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.c_char_p(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "Landlock: creating the ruleset",
    )
    for paths, access in ((settings["read"], fs_read), (settings["write"], fs_all)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not in this view
            allowed = access if os.path.isdir(path) else access & file_only
            rule = struct.pack("<Qi", allowed, fd)
            _check(
                _libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.c_char_p(rule), ctypes.c_uint32(0)),
                f"Landlock: a rule for {path}",
            )
            os.close(fd)
    _check(
        _libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
        "Landlock: restricting",
    )
    os.close(ruleset)
    return used, abi >= wanted


def _drop_capabilities():
    cap = 0
    while _libc.prctl(ctypes.c_int(PR_CAPBSET_READ), ctypes.c_ulong(cap), 0, 0, 0) >= 0:
        _prctl(PR_CAPBSET_DROP, cap, what=f"dropping capability {cap}")
        cap += 1
    _libc.prctl(ctypes.c_int(PR_CAP_AMBIENT), ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
    header = struct.pack("<Ii", 0x20080522, 0)
    data = bytes(24)
    _check(_libc.syscall(ctypes.c_long(SYS_CAPSET), ctypes.c_char_p(header), ctypes.c_char_p(data)), "clearing capabilities")


def _seccomp(programs):
    for program in programs:
        raw = bytes.fromhex(program)
        # Both buffers stay referenced until the call returns.
        filters = ctypes.create_string_buffer(raw, len(raw))
        fprog = struct.pack("<HxxxxxxQ", len(raw) // 8, ctypes.addressof(filters))
        header = ctypes.create_string_buffer(fprog, len(fprog))
        _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(header), what="installing the seccomp filter")


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _enter(settings, uid, gid):
    """Steps 2-4 above; returns in the run's PID 1 with its report."""
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWUSER)), "a user namespace")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} 0 1")
    _write("/proc/self/gid_map", f"{gid} 0 1")
    _check(
        _libc.unshare(ctypes.c_int(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)),
        "namespaces",
    )
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(
        "tmpfs",
        SCRATCH,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={settings['disk_bytes']},nr_inodes={settings['max_files']},mode=0755",
    )
    for part, target, mode in (("w", "/workspace", 0o700), ("t", "/tmp", 0o1777), ("s", "/dev/shm", 0o1777)):
        os.mkdir(f"{SCRATCH}/{part}")
        os.chmod(f"{SCRATCH}/{part}", mode)
        _mount(f"{SCRATCH}/{part}", target, None, MS_BIND)
    _check(_libc.umount2(SCRATCH.encode(), ctypes.c_int(MNT_DETACH)), "hiding the scratch mount")
    pid = os.fork()
    if pid:
        # The waiter: holds nothing of the run, and ends with its status.
        os.closerange(0, 1 << 16)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except ChildProcessError:
                os._exit(SETUP_FAILED)
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, what="pdeathsig")
    if settings["proc"]:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _check(_libc.sethostname(b"sandbox", ctypes.c_size_t(7)), "hostname")
    os.chdir("/workspace")
    import resource

    limits = settings["limits"]
    for name, value in (
        ("RLIMIT_AS", limits["address_space_bytes"]),
        ("RLIMIT_CPU", limits["cpu_seconds"]),
        ("RLIMIT_FSIZE", limits["file_size_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_NPROC", limits["processes"]),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.getpriority(os.PRIO_PROCESS, 0) < settings["niceness"]:
        os.setpriority(os.PRIO_PROCESS, 0, settings["niceness"])
    report = {"namespaces": True, "proc": settings["proc"], "cgroup": False}
    _prctl(PR_SET_NO_NEW_PRIVS, 1, what="no_new_privs")
    report["landlock_abi"], report["landlock_fully_enforced"] = _landlock(settings) if settings["landlock"] else (0, False)
    _drop_capabilities()
    report["capabilities_dropped"] = True
    report["no_new_privs"] = True
    report["seccomp"] = bool(settings["seccomp"])
    if settings["seccomp"]:
        _seccomp(settings["seccomp"])
    report.update(uid=os.geteuid(), gid=os.getegid(), supplementary_groups=len(os.getgroups()))
    return report


def _child(settings, fds, uid, gid, frame, held):
    """A run's first process: steps 1-5; returns in the run's PID 1, ready to run."""
    try:
        # The zygote's own sockets are let go of, not closed by a finalizer later (their
        # numbers may by then be the run's).
        for sock in held:
            sock.detach()
        bridge, out, err = fds
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(bridge, 3)
        os.closerange(4, 1 << 16)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        report = _enter(settings, uid, gid)
        os.environ.clear()
        os.environ.update(
            PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8", HOME="/workspace", TMPDIR="/tmp", NOMAD_BRIDGE_FD="3"
        )
        frame(json.dumps(report, separators=(",", ":")).encode())
    except BaseException as e:  # noqa: BLE001 - the gateway reads this on stderr
        try:
            os.write(2, f"nomad sandbox zygote: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)


def serve(preload, frame, run):
    """The zygote's loop. `frame` writes a frame on descriptor 3, `run` is the runner's main."""
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    control = socket.socket(fileno=3)
    settings = json.loads(_receive(control)[0])
    # Outside the child user namespaces: root here is the sandbox user outside.
    uid, gid = _outer_id("/proc/self/uid_map"), _outer_id("/proc/self/gid_map")
    children = {}
    reaped = socket.socketpair()
    reaped[1].setblocking(False)
    signal.set_wakeup_fd(reaped[1].fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(reaped[0], selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is reaped[0]:
                reaped[0].recv(4096)
                _reap(children, control)
                continue
            body, fds = _receive(control)
            if body is None:
                os._exit(0)  # the gateway is gone
            request = json.loads(body)
            if request["method"] == "kill":
                pid = next((p for p, i in children.items() if i == request["id"]), None)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                _child(settings, fds, uid, gid, frame, (control, *reaped))
                run()
                os._exit(0)
            children[pid] = request["id"]
            for fd in fds:
                os.close(fd)


def _reap(children, control):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        run = children.pop(pid, None)
        if run is not None:
            code = os.waitstatus_to_exitcode(status)
            _send(control, {"method": "exited", "id": run, "code": code if code >= 0 else 128 - code})


def _outer_id(path):
    with open(path) as f:
        return int(f.read().split()[1])


def _send(control, message):
    body = json.dumps(message, separators=(",", ":")).encode()
    control.sendall(len(body).to_bytes(4, "big") + body)


def _receive(control):
    """One frame and the descriptors that came with it; (None, []) at end of stream."""
    head, fds, _, _ = socket.recv_fds(control, 4, 3)
    if not head:
        return None, []
    while len(head) < 4:
        more = control.recv(4 - len(head))
        if not more:
            return None, []
        head += more
    length = int.from_bytes(head, "big")
    body = b""
    while len(body) < length:
        chunk = control.recv(length - len(body))
        if not chunk:
            return None, []
        body += chunk
    return body, fds
