"""The sandbox's fork server: one interpreter, already isolated and with the runtime imported,
that forks a child per run instead of starting a Python per run.

    python -I -B /nomad/runner.py --zygote MODULE,...

The gateway's `sandbox-init` starts it behind the filesystem view (its own user, mount, network,
PID, IPC and UTS namespaces, a read-only root), as root of its own user namespace (so it may make
namespaces for its children) with no other privilege. It imports the runtime, loads the
isolation library (`libnomad_jail.so`, the Rust code `sandbox-init` itself runs), then serves
requests on its control socket (descriptor 3): the first frame is the run's spec; each later one
is `fork`, with the run's bridge, stdout and stderr as SCM_RIGHTS, or `kill`. It answers `exited`
for each child.

Each child hands its descriptors to the library, which takes the run's isolation steps (its own
user namespace and namespaces, its own tmpfs, PID 1 of its own PID namespace, limits, Landlock,
capabilities, seccomp) and reports them on the bridge, as a spawned run's init does; `serve`
then returns in the child, after letting go of everything the zygote knew (other runs' ids and
pids, its sockets), and the runner runs.

Memory: a child is a copy-on-write copy of the zygote, which holds only the runtime (no run ever
ran in it). All children share the zygote's string-hash secret (PYTHONHASHSEED), which an
interpreter cannot change once started: a run could learn it and craft colliding keys, which
only slows dictionaries of its own.
"""

import ctypes
import json
import os
import signal
import socket

SETUP_FAILED = 125
LIBRARY = "libnomad_jail.so"


def serve(preload, frame, read_exact, write_frame):
    """The zygote's loop; returns only in a forked child, isolated and ready to run.

    `frame` is the `nomad_frame` module; `read_exact(n, fd)` and `write_frame(body, fd)` are the
    runner's reader and frame writer."""
    limit = frame.limit("control")
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    control = socket.socket(fileno=3)
    spec, _ = _receive(control, frame, limit, read_exact)
    if spec is None:
        os._exit(0)
    jail_lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), LIBRARY))
    jail_lib.nomad_jail_prepare.restype = ctypes.c_void_p
    jail_lib.nomad_jail_prepare.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    jail_lib.nomad_jail_enter_run.restype = ctypes.c_int
    jail_lib.nomad_jail_enter_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    jail = jail_lib.nomad_jail_prepare(spec, len(spec))
    if not jail:
        os._exit(SETUP_FAILED)  # the library said why on stderr
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
                _reap(children, write_frame)
                continue
            body, fds = _receive(control, frame, limit, read_exact)
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
                # Nothing of the zygote's goes with the run: not its children's ids and pids, not
                # its sockets (let go of, not closed by a finalizer later, when their numbers may
                # be the run's), not its signal handling.
                children.clear()
                selector.close()
                for sock in (control, *reaped):
                    sock.detach()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                bridge, out, err = fds
                jail_lib.nomad_jail_enter_run(jail, bridge, out, err)
                return
            children[pid] = request["id"]
            for fd in fds:
                os.close(fd)


def _reap(children, write_frame):
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
            message = {"method": "exited", "id": run, "code": code if code >= 0 else 128 - code}
            write_frame(json.dumps(message, separators=(",", ":")).encode(), 3)


def _receive(control, frame, limit, read_exact):
    """One frame and the descriptors that came with its first bytes; (None, []) at end of stream."""
    head, fds, _, _ = socket.recv_fds(control, frame.HEADER, 3)
    if not head:
        return None, []
    try:
        head += read_exact(frame.HEADER - len(head), 3)
        return read_exact(frame.length(head, limit), 3), fds
    except EOFError:
        return None, []
    except frame.FrameTooLarge:
        os._exit(SETUP_FAILED)
