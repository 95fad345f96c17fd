"""Runs model-written Python for the Nomad gateway, inside its sandbox.

    python -I runner.py code|script PATH

The code calls upstream tools with `from mcp_tools.<server> import <tool>`; each tool is a
function (keyword or positional arguments, in the order of its schema) and has an `_async`
twin. Calls go to the gateway over the bridge, a socketpair inherited as file descriptor
NOMAD_BRIDGE_FD: 4-byte big-endian length, then a JSON message. The code's `RESULT` variable is
sent back as JSON when it finishes. Top-level `await` works.
"""

import ast
import asyncio
import importlib.abc
import importlib.machinery
import inspect
import json
import keyword
import os
import re
import socket
import struct
import sys
import threading
import traceback

MAX_FRAME = 16 << 20


class ToolError(Exception):
    """An upstream tool call failed; the message says why."""


class Bridge:
    def __init__(self, fd):
        self._sock = socket.socket(fileno=fd)
        self._send_lock = threading.Lock()
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._next_id = 0
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def _send(self, message):
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ToolError(f"message of {len(body)} bytes exceeds the bridge's {MAX_FRAME}-byte limit")
        with self._send_lock:
            self._sock.sendall(struct.pack(">I", len(body)) + body)

    def _recv_exact(self, n):
        chunks = []
        while n:
            chunk = self._sock.recv(n)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _read_loop(self):
        try:
            while True:
                (length,) = struct.unpack(">I", self._recv_exact(4))
                message = json.loads(self._recv_exact(length))
                with self._pending_lock:
                    slot = self._pending.get(message.get("id"))
                if slot is not None:
                    slot["reply"] = message
                    slot["event"].set()
        except (EOFError, OSError, ValueError):
            with self._pending_lock:
                for slot in self._pending.values():
                    slot["event"].set()

    def request(self, method, params):
        with self._pending_lock:
            self._next_id += 1
            request_id = self._next_id
            slot = {"event": threading.Event(), "reply": None}
            self._pending[request_id] = slot
        try:
            self._send({"id": request_id, "method": method, "params": params})
            slot["event"].wait()
        finally:
            with self._pending_lock:
                self._pending.pop(request_id, None)
        reply = slot["reply"]
        if reply is None:
            raise ToolError("the gateway closed the bridge")
        if reply.get("error"):
            raise ToolError(reply["error"].get("message", "tool call failed"))
        return reply.get("result")

    def done(self, result=None, error=None):
        self._send({"method": "done", "params": {"result": result, "error": error}})


def _identifier(name):
    ident = re.sub(r"\W", "_", name)
    if not ident or ident[0].isdigit() or keyword.iskeyword(ident):
        ident = "_" + ident
    return ident


_PY_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def _make_tool(bridge, server, tool):
    schema = tool.get("input_schema") or {}
    properties = schema.get("properties") or {}
    required = [p for p in schema.get("required") or [] if p in properties]
    order = required + [p for p in properties if p not in required]

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


class _ToolsImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`mcp_tools` is a package whose submodules are the gateway's upstream servers."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.servers = None

    def _server_names(self):
        if self.servers is None:
            self.servers = {_identifier(s): s for s in self.bridge.request("list_servers", {})}
        return self.servers

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mcp_tools":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname.startswith("mcp_tools.") and fullname.count(".") == 1:
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


def main():
    mode, path = sys.argv[1], sys.argv[2]
    bridge = Bridge(int(os.environ.get("NOMAD_BRIDGE_FD", "3")))
    sys.meta_path.insert(0, _ToolsImporter(bridge))
    namespace = {"__name__": "__main__", "__file__": path}
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        code = compile(source, "<code>" if mode == "code" else path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        outcome = eval(code, namespace)
        if inspect.iscoroutine(outcome):
            asyncio.run(outcome)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the caller
        tb = traceback.format_exc()
        bridge.done(error={"type": type(e).__name__, "message": str(e), "traceback": tb})
        sys.exit(1)
    result = namespace.get("RESULT")
    try:
        encoded = json.loads(json.dumps(result))
    except (TypeError, ValueError) as e:
        bridge.done(error={"type": "TypeError", "message": f"RESULT is not JSON-serializable: {e}", "traceback": ""})
        sys.exit(1)
    bridge.done(result=encoded)


if __name__ == "__main__":
    main()
