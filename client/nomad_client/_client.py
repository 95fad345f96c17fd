"""The fleet client: two MCP sessions to the gateway (its direct tools and its code mode), opened
on first use and kept, with the fleet's bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
from mcp.shared.exceptions import MCPError

# The `_meta` key of a failed call's result that holds its code.
ERROR_CODE_META = "nomad/error_code"

# JSON-RPC errors (a request the server refused outright: an unknown tool, arguments that are not
# an object; a missing or wrong token, no room for a session) as tool error codes.
_JSONRPC_CODES = {
    -32602: "INVALID_ARGUMENT",
    -32601: "NOT_FOUND",
    -32603: "INTERNAL",
    -32001: "UNAUTHENTICATED",
    -32002: "UNAVAILABLE",
}


def _innermost(error: BaseException) -> BaseException:
    """The first leaf of an exception group (the transport's task groups wrap what failed; on
    Python 3.10 the group is anyio's backport, which has the same `exceptions`)."""
    while isinstance(getattr(error, "exceptions", None), tuple) and error.exceptions:
        error = error.exceptions[0]
    return error


class ToolError(Exception):
    """A tool call failed. `.code` says what kind of failure (what to do next: fix the arguments,
    retry later, give up), `.message` what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _refused(error: MCPError) -> ToolError:
    """A JSON-RPC error as a `ToolError`: the gateway's code when its `data` carries one (an
    unknown tool is NOT_FOUND), else the code the JSON-RPC error's number stands for."""
    data = error.data if isinstance(error.data, dict) else {}
    code = data.get(ERROR_CODE_META) or _JSONRPC_CODES.get(error.code, "INTERNAL")
    return ToolError(code, error.message)


def _opening_error(url: str, error: BaseException) -> ToolError:
    """Why a session could not be opened, as a `ToolError`: the server's refusal (a missing or
    wrong token, no room) with its code and words, or the gateway not reached."""
    cause = _innermost(error)
    if isinstance(cause, MCPError):
        return _refused(cause)
    if isinstance(cause, (OSError, httpx2.TransportError)):
        return ToolError("UNAVAILABLE", f"no gateway answers at {url} ({cause!r}): is the fleet running?")
    return ToolError("INTERNAL", f"opening an MCP session to {url}: {cause!r}")


@dataclass
class RunResult:
    """What a run of code in the fleet's sandbox gave back."""

    result: Any
    stdout: str
    stderr: str
    returncode: int | None
    status: str  # ok, error or timeout
    error: str | None
    duration_seconds: float
    tool_calls: list | None = field(default=None)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _head_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return ") Z " not in stat


def find_fleet(runs_dir: str | os.PathLike = "runs") -> Path:
    """The `fleet.json` of the newest fleet still running under `runs_dir` (as `nomad ps` lists)."""
    runs = Path(runs_dir)
    found = []
    for path in runs.glob("*/fleet.json"):
        try:
            fleet = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _head_alive(fleet.get("head_pid")):
            found.append((path.stat().st_mtime, path))
    if not found:
        raise FileNotFoundError(
            f"no running fleet under {runs.resolve()} (start one with `nomad up`, or give "
            "Fleet.from_file the path of its fleet.json)"
        )
    return max(found)[1]


def _described(path: str | os.PathLike) -> tuple[str, str, str | None]:
    """The code-mode and tools MCP addresses and the token a `fleet.json` holds."""
    fleet = json.loads(Path(path).read_text())
    missing = [k for k in ("gateway_mcp", "tools_mcp") if not fleet.get(k)]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: is it a fleet.json of `nomad up`?")
    return fleet["gateway_mcp"], fleet["tools_mcp"], fleet.get("token")


class AsyncFleet:
    """A Nomad fleet, from asyncio. Use as `async with AsyncFleet.from_file(path) as fleet:`."""

    def __init__(self, mcp_url: str, tools_url: str, token: str | None = None, timeout: float = 300.0):
        self.mcp_url = mcp_url
        self.tools_url = tools_url
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._sessions: dict[str, Client] = {}
        # Each session is entered and left by a task of its own: the transport's cancel scopes
        # must be left by the task that entered them, whichever task calls.
        self._owners: list[asyncio.Task] = []
        self._closing: asyncio.Event | None = None
        self._opening = asyncio.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike, **options) -> "AsyncFleet":
        """The fleet a `fleet.json` of `nomad up` describes (its addresses and token)."""
        return cls(*_described(path), **options)

    @classmethod
    def latest(cls, runs_dir: str | os.PathLike = "runs", **options) -> "AsyncFleet":
        """The newest fleet still running under `runs_dir`."""
        return cls.from_file(find_fleet(runs_dir), **options)

    async def __aenter__(self) -> "AsyncFleet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closing is not None:
            self._closing.set()
        owners, self._owners = self._owners, []
        for owner in owners:
            with contextlib.suppress(Exception):
                await owner
        self._sessions.clear()
        self._closing = None

    async def _own(self, url: str, opened: asyncio.Future, closing: asyncio.Event) -> None:
        try:
            http = create_mcp_http_client(headers=self._headers)
            async with Client(streamable_http_client(url, http_client=http)) as client:
                opened.set_result(client)
                await closing.wait()
        except BaseException as e:
            if not opened.done():
                opened.set_exception(e)
            raise

    async def _session(self, url: str) -> Client:
        async with self._opening:
            if url not in self._sessions:
                if self._closing is None:
                    self._closing = asyncio.Event()
                opened = asyncio.get_running_loop().create_future()
                owner = asyncio.create_task(self._own(url, opened, self._closing))
                try:
                    self._sessions[url] = await opened
                except Exception as e:
                    with contextlib.suppress(BaseException):
                        await owner
                    raise _opening_error(url, e) from e
                self._owners.append(owner)
            return self._sessions[url]

    async def _call(self, url: str, tool: str, arguments: dict) -> Any:
        session = await self._session(url)
        try:
            return await session.call_tool(tool, arguments, read_timeout_seconds=self.timeout)
        except MCPError as e:
            raise _refused(e) from e

    async def tools(self) -> list[dict]:
        """The fleet's tools: name, description, input and output schema."""
        listed = await (await self._session(self.tools_url)).list_tools()
        return [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema,
             "output_schema": t.output_schema}
            for t in listed.tools
        ]

    async def call(self, tool: str, /, **arguments) -> Any:
        """Calls one of the fleet's tools; its structured answer, else its text. Raises
        `ToolError` with the gateway's code when the call fails."""
        result = await self._call(self.tools_url, tool, arguments)
        text = "".join(getattr(c, "text", "") for c in result.content)
        if result.is_error:
            code = (result.meta or {}).get(ERROR_CODE_META, "UNKNOWN")
            # The text reads "<what kind>: <message>"; the code says the kind.
            raise ToolError(code, text.split(": ", 1)[-1])
        structured = result.structured_content
        if structured is None:
            return text
        # A tool whose answer is not an object has it under "result".
        if set(structured) == {"result"}:
            return structured["result"]
        return structured

    async def run(self, code: str, env: dict[str, str] | None = None) -> RunResult:
        """Runs Python in the fleet's sandbox (`execute_mcp_code`): its RESULT, output and status.
        A run that fails comes back with `status` and `error`, not as an exception."""
        arguments: dict[str, Any] = {"code": code}
        if env:
            arguments["env"] = env
        result = await self._call(self.mcp_url, "execute_mcp_code", arguments)
        reply = result.structured_content
        if reply is None:
            text = "".join(getattr(c, "text", "") for c in result.content)
            raise ToolError("INTERNAL", f"execute_mcp_code answered without a result: {text}")
        return RunResult(
            result=reply.get("result"),
            stdout=reply.get("stdout", ""),
            stderr=reply.get("stderr", ""),
            returncode=reply.get("returncode"),
            status=reply.get("status", "error"),
            error=reply.get("error"),
            duration_seconds=reply.get("duration_seconds", 0.0),
            tool_calls=reply.get("tool_calls"),
        )

    async def search(self, query: str, limit: int | None = None, server: str | None = None,
                     detail: str = "brief") -> list[dict]:
        """The gateway's tool search: the tools that fit `query`, best first, with how to import
        each in sandboxed code."""
        arguments: dict[str, Any] = {"query": query, "detail_level": detail}
        if limit is not None:
            arguments["limit"] = limit
        if server:
            arguments["server_filter"] = server
        result = await self._call(self.mcp_url, "search_code_tools", arguments)
        reply = result.structured_content or {}
        if result.is_error:
            raise ToolError("INVALID_ARGUMENT", json.dumps(reply))
        return reply.get("tools", [])


class Fleet:
    """A Nomad fleet, from plain (synchronous) code: every method of `AsyncFleet`, run on an
    event loop of its own in a background thread, so sessions stay open between calls."""

    def __init__(self, mcp_url: str, tools_url: str, token: str | None = None, timeout: float = 300.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nomad-client", daemon=True)
        self._thread.start()
        self._fleet = self._wait(self._make(mcp_url, tools_url, token, timeout))

    @staticmethod
    async def _make(*args) -> AsyncFleet:
        # Made on the loop that will use it (its lock belongs there).
        return AsyncFleet(*args)

    @classmethod
    def from_file(cls, path: str | os.PathLike, timeout: float = 300.0) -> "Fleet":
        return cls(*_described(path), timeout=timeout)

    @classmethod
    def latest(cls, runs_dir: str | os.PathLike = "runs", timeout: float = 300.0) -> "Fleet":
        return cls.from_file(find_fleet(runs_dir), timeout)

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._wait(self._fleet.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def tools(self) -> list[dict]:
        return self._wait(self._fleet.tools())

    def call(self, tool: str, /, **arguments) -> Any:
        return self._wait(self._fleet.call(tool, **arguments))

    def run(self, code: str, env: dict[str, str] | None = None) -> RunResult:
        return self._wait(self._fleet.run(code, env))

    def search(self, query: str, limit: int | None = None, server: str | None = None,
               detail: str = "brief") -> list[dict]:
        return self._wait(self._fleet.search(query, limit, server, detail))
