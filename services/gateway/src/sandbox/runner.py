"""Runs model-written Python for the Nomad gateway, inside its sandbox.

    python -I -B runner.py [--preload MODULE,...]

The runner starts ahead of its run (the gateway keeps a few waiting), reads one run from the
bridge, executes it and exits; it never serves a second run. The bridge is a socket pair
inherited as descriptor NOMAD_BRIDGE_FD: Nomad's frames (`nomad_frame.py`, beside this file;
their limit, NOMAD_BRIDGE_MAX_FRAME, is set by the gateway). The first frame the runner reads
is the run (fields, each a 4-byte length and UTF-8 text: mode, file name, source, the limits
`call,result,text` in bytes, then environment names and values);
every later frame either way is JSON. The runner keeps to the limits itself: a call over them
fails here with a message, RESULT over them is sent as its size alone, and an exception's text
is cut (the gateway ends a run whose frame is larger, unread).

The code calls upstream tools with `from mcp_tools.<server> import <tool>`; each tool is a
function (keyword or positional arguments, in the order of its schema) and has an `_async`
twin. The code's `RESULT` variable is sent back as JSON when it finishes. Top-level `await`
works.

At start the runner imports only modules built into the interpreter, so a run started on
demand pays for nothing it does not use; `--preload` imports the rest while the runner waits.
"""

import os
import sys


def _sibling(name):
    """The module `name` beside this file, compiled and run here: -I leaves this folder off
    sys.path, and importing importlib.util would cost a run started on demand milliseconds."""
    path = os.path.join(os.path.dirname(__file__), name + ".py")
    module = type(sys)(name)
    module.__file__ = path
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


_frame = _sibling("nomad_frame")
MAX_FRAME = _frame.limit("bridge")
# ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, without importing ast.
_ALLOW_TOP_LEVEL_AWAIT = 0x2000
_FD = int(os.environ.get("NOMAD_BRIDGE_FD", "3"))
# Bytes of a tool call, of RESULT and of an exception's message or traceback, as the run says.
_LIMITS = {"call": MAX_FRAME, "result": MAX_FRAME, "text": MAX_FRAME}


class ToolError(Exception):
    """A tool call failed: `.code` says what kind of failure (what to do next), the message
    what was wrong.

    Codes: INVALID_ARGUMENT (fix the arguments), NOT_FOUND (no such server or tool),
    PERMISSION_DENIED (not in the gateway's allowlist), RESOURCE_EXHAUSTED (a queue or this run's
    budget is full), UNAVAILABLE (no worker or server now), FAILED_PRECONDITION (the tool cannot
    serve), DEADLINE_EXCEEDED, CANCELLED, UNKNOWN (the tool itself failed), INTERNAL.
    """

    def __init__(self, message, code="INTERNAL"):
        super().__init__(message)
        self.code = code


def _read_exact(n, fd=_FD):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame():
    return _frame.read(_read_exact, MAX_FRAME)


def _write_frame(body, fd=_FD):
    try:
        data = memoryview(_frame.pack(body, MAX_FRAME))
    except _frame.FrameTooLarge as e:
        raise ToolError(f"a bridge message: {e}", "INVALID_ARGUMENT") from None
    while data:
        data = data[os.write(fd, data):]


def _clip(text, limit):
    """`text` in at most `limit` bytes of UTF-8, saying how much there was."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    note = f"\u2026 ({len(data)} bytes in all, cut at {limit})"
    keep = max(0, limit - len(note.encode()))
    return data[:keep].decode("utf-8", "ignore") + note


def _to_json(value):
    """JSON text of `value`; the common types without importing json (a cold run pays ~5 ms for
    that import), anything else through it."""
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is float and value - value == 0:  # finite: repr is valid JSON
        return repr(value)
    if kind is str and value.isprintable() and '"' not in value and "\\" not in value:
        return '"' + value + '"'
    if kind in (list, tuple):
        return "[" + ",".join(_to_json(v) for v in value) + "]"
    if kind is dict and all(type(k) is str for k in value):
        return "{" + ",".join(_to_json(k) + ":" + _to_json(v) for k, v in value.items()) + "}"
    import json

    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Bridge:
    """Tool calls from any thread or coroutine; one reader thread matches replies to calls."""

    def __init__(self):
        import _thread

        self._send_lock = _thread.allocate_lock()
        self._pending = {}
        self._pending_lock = _thread.allocate_lock()
        self._next_id = 0
        self._reader = None
        self._thread = _thread

    def _read_loop(self):
        import json

        try:
            while True:
                message = json.loads(_read_frame())
                with self._pending_lock:
                    slot = self._pending.get(message.get("id"))
                if slot is not None:
                    slot["reply"] = message
                    slot["done"].release()
        except (EOFError, OSError, ValueError):
            with self._pending_lock:
                for slot in self._pending.values():
                    if slot["done"].locked():
                        slot["done"].release()

    def request(self, method, params):
        import json

        with self._pending_lock:
            if self._reader is None:
                self._reader = self._thread.start_new_thread(self._read_loop, ())
            self._next_id += 1
            request_id = self._next_id
            done = self._thread.allocate_lock()
            done.acquire()
            slot = {"done": done, "reply": None}
            self._pending[request_id] = slot
        try:
            body = json.dumps({"id": request_id, "method": method, "params": params}, separators=(",", ":")).encode()
            if len(body) > _LIMITS["call"]:
                raise ToolError(
                    f"this call is {len(body)} bytes of JSON; a call may send at most "
                    f"{_LIMITS['call']} (sandbox.max_call_bytes)",
                    "INVALID_ARGUMENT",
                )
            with self._send_lock:
                _write_frame(body)
            done.acquire()
        finally:
            with self._pending_lock:
                self._pending.pop(request_id, None)
        reply = slot["reply"]
        if reply is None:
            raise ToolError("the gateway closed the bridge", "UNAVAILABLE")
        error = reply.get("error")
        if error:
            raise ToolError(error.get("message", "tool call failed"), error.get("code", "INTERNAL"))
        return reply.get("result")

    def done(self, result="null", error=None):
        if error is not None:
            error = {k: _clip(v, _LIMITS["text"]) if isinstance(v, str) else v for k, v in error.items()}
        size = len(result.encode())
        if size > _LIMITS["result"]:
            result = 'null,"result_bytes":' + str(size)
        body = '{"method":"done","params":{"result":' + result + ',"error":' + _to_json(error) + "}}"
        with self._send_lock:
            _write_frame(body.encode())


def _identifier(name):
    import keyword
    import re

    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
        ident = "_" + ident
    return ident


_PY_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def _make_tool(bridge, server, tool):
    import inspect
    import keyword

    schema = tool.get("input_schema") or {}
    properties = schema.get("properties") or {}
    required = [p for p in schema.get("required") or [] if p in properties]
    # A main input offered as alternatives (generate's `text` or `messages`) comes first among the
    # optional ones, so `generate("2+2=")` binds the prompt; the gateway's signature says the same.
    alternatives = []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            if not isinstance(branch, dict):
                continue
            for p in branch.get("required") or []:
                if p in properties and p not in required and p not in alternatives:
                    alternatives.append(p)
    order = required + alternatives + [p for p in properties if p not in required and p not in alternatives]

    def call(*args, **kwargs):
        if len(args) > len(order):
            raise TypeError(f"{tool['name']}() takes {len(order)} arguments, got {len(args)}")
        arguments = dict(zip(order, args))
        for key, value in kwargs.items():
            if key in arguments:
                raise TypeError(f"{tool['name']}() got multiple values for {key!r}")
            arguments[key] = value
        return bridge.request("call_tool", {"server": server, "tool": tool["name"], "arguments": arguments})

    async def call_async(*args, **kwargs):
        import asyncio

        return await asyncio.to_thread(call, *args, **kwargs)

    parameters = []
    for name in order:
        annotation = _PY_TYPES.get((properties[name] or {}).get("type"), inspect.Parameter.empty)
        default = inspect.Parameter.empty if name in required else properties[name].get("default")
        if name.isidentifier() and not keyword.iskeyword(name):
            parameters.append(
                inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
            )
    for fn, suffix in ((call, ""), (call_async, "_async")):
        fn.__name__ = _identifier(tool["name"]) + suffix
        fn.__doc__ = tool.get("description") or None
        try:
            fn.__signature__ = inspect.Signature(parameters)
        except ValueError:
            pass
    return call, call_async


class _ToolsImporter:
    """`mcp_tools` is a package whose submodules are the gateway's upstream servers."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.servers = None

    def _server_names(self):
        if self.servers is None:
            self.servers = {_identifier(s): s for s in self.bridge.request("list_servers", {})}
        return self.servers

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mcp_tools" and not (fullname.startswith("mcp_tools.") and fullname.count(".") == 1):
            return None
        import importlib.machinery

        if fullname == "mcp_tools":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname.split(".", 1)[1] in self._server_names():
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "mcp_tools":
            module.__path__ = []
            module.servers = sorted(self._server_names().values())
            module.ToolError = ToolError
            return
        server = self._server_names()[module.__name__.split(".", 1)[1]]
        for tool in self.bridge.request("list_tools", {"server": server}):
            sync, asynchronous = _make_tool(self.bridge, server, tool)
            setattr(module, sync.__name__, sync)
            setattr(module, asynchronous.__name__, asynchronous)
        module.ToolError = ToolError
        bridge = self.bridge

        def __getattr__(name):
            # A name the server does not list: the gateway says why (a model that failed to
            # load, not allowed, no such tool) as the ToolError a call would raise.
            if name.startswith("__"):
                raise AttributeError(name)
            tool = name[: -len("_async")] if name.endswith("_async") else name
            bridge.request("why_missing", {"server": server, "tool": tool})
            raise AttributeError(name)

        module.__getattr__ = __getattr__


def _exit(code):
    # No interpreter teardown: the run is over, and the PID namespace ends with this process.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the exit
            pass
    os._exit(code)


def _zygote():
    """`--zygote MODULES`: serve as the sandbox's fork server (zygote.py beside this file);
    returns in each forked child, ready to run."""
    preload = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    _sibling("zygote").serve(preload, _frame, _read_exact, _write_frame)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--zygote":
        _zygote()
    elif len(sys.argv) > 2 and sys.argv[1] == "--preload":
        for name in sys.argv[2].split(","):
            try:
                __import__(name)
            except ImportError:
                pass
    _write_frame(b'{"method":"ready"}')
    try:
        fields = _frame.fields(_read_frame())
    except (EOFError, OSError, ValueError):
        _exit(2)
    mode, filename, source = fields[0], fields[1], fields[2]
    _LIMITS.update(zip(("call", "result", "text"), map(int, fields[3].split(","))))
    os.environ.update(zip(fields[4::2], fields[5::2]))
    bridge = Bridge()
    sys.meta_path.insert(0, _ToolsImporter(bridge))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    if mode == "script":
        namespace["__file__"] = filename
    try:
        code = compile(source, filename, "exec", flags=_ALLOW_TOP_LEVEL_AWAIT)
        outcome = eval(code, namespace)
        if type(outcome).__name__ == "coroutine":
            import asyncio

            asyncio.run(outcome)
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _exit(code)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the caller
        bridge.done(error={"type": type(e).__name__, "message": str(e), "traceback": _user_traceback(e, filename)})
        _exit(1)
    try:
        encoded = _to_json(namespace.get("RESULT"))
    except (TypeError, ValueError, RecursionError) as e:
        bridge.done(error={"type": "TypeError", "message": f"RESULT is not JSON-serializable: {e}", "traceback": ""})
        _exit(1)
    bridge.done(result=encoded)
    _exit(0)


def _user_traceback(error, filename):
    """The traceback as the run's own code sees it: from its first frame in `filename` on, and
    without the runner's frames (which ran the code or carried a tool call), in every chained
    exception too. Library frames the code called stay."""
    import traceback

    shown = traceback.TracebackException(type(error), error, error.__traceback__)
    todo, seen = [shown], set()
    while todo:
        part = todo.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        frames = list(part.stack)
        start = next((i for i, f in enumerate(frames) if f.filename == filename), 0)
        kept = [f for f in frames[start:] if f.filename not in (__file__, _frame.__file__)]
        part.stack = traceback.StackSummary.from_list(kept)
        todo += [part.__cause__, part.__context__]
    return "".join(shown.format())


if __name__ == "__main__":
    main()
