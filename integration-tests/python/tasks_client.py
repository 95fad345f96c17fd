"""Drives MCP tasks with fastmcp-tasks (a third-party client of the io.modelcontextprotocol/tasks
extension, on fastmcp), one command at a time, for the gateway's task tests.

    tasks_client.py URL TOKEN
    tasks_client.py stdio COMMAND [ARGS...]    (spawns a stdio server)

Reads one JSON command per line on stdin and answers each with one JSON line on stdout:

    {"op": "start", "tool", "arguments", "meta"?}  -> {"task_id", "status", "handle", "seconds"}
    {"op": "status", "task_id"}                     -> {"status", "status_message", "error"}
    {"op": "result", "task_id", "timeout"?}         -> {"is_error", "structured", "text"}
    {"op": "cancel", "task_id"}                     -> {"acknowledged": true}
    {"op": "adopt", "handle"}                       -> {"task_id"}: a task another client started
    {"op": "links", "task_id"}                      -> {"links": [{"uri", "mime_type", "size"}]}:
                                                       the resource links of a task's result
    {"op": "read", "uri"}                           -> {"mime_type", "text"} (resources/read)

Any failure answers {"exception": "..."} and the next command is read.
"""

import asyncio
import json
import sys
import time

import fastmcp_tasks  # noqa: F401 - declares the tasks extension on every fastmcp Client
from fastmcp import Client
from fastmcp.client.transports import StdioTransport, StreamableHttpTransport
from fastmcp_tasks import ToolTask, call_tool_task
from fastmcp_tasks.client_models import ClientCreateTaskResult


def text_of(result):
    return "".join(getattr(c, "text", "") for c in result.content)


async def main():
    tasks = {}
    if sys.argv[1] == "stdio":
        transport = StdioTransport(command=sys.argv[2], args=sys.argv[3:])
    else:
        transport = StreamableHttpTransport(sys.argv[1], auth=sys.argv[2])
    async with Client(transport, mode="auto") as client:

        async def run(command):
            op = command["op"]
            if op == "start":
                began = time.monotonic()
                task = await call_tool_task(
                    client, command["tool"], command.get("arguments") or {}, meta=command.get("meta")
                )
                seconds = time.monotonic() - began
                tasks[task.task_id] = task
                handle = task.create_result.model_dump(by_alias=True, mode="json", exclude_none=True)
                return {"task_id": task.task_id, "status": str(handle.get("status")),
                        "handle": handle, "seconds": seconds}
            if op == "adopt":
                created = ClientCreateTaskResult.model_validate(command["handle"])
                task = ToolTask(client, command.get("tool", ""), created, raise_on_error=False)
                tasks[task.task_id] = task
                return {"task_id": task.task_id}
            if op == "read":
                contents = await client.read_resource(command["uri"])
                return {"mime_type": contents[0].mime_type, "text": contents[0].text}
            task = tasks[command["task_id"]]
            if op == "links":
                result = await task.result()
                return {"links": [{"uri": str(c.uri), "mime_type": c.mime_type, "size": c.size}
                                  for c in result.content if c.type == "resource_link"]}
            if op == "status":
                got = await task.status()
                dumped = got.model_dump(by_alias=True, mode="json", exclude_none=True)
                return {"status": dumped.get("status"), "status_message": dumped.get("statusMessage"),
                        "error": dumped.get("error")}
            if op == "result":
                result = await task.wait(timeout=command.get("timeout", 120))
                if str(result.status) != "completed":
                    return {"status": str(result.status), "error": getattr(result, "error", None)}
                result = await task.result()
                return {"is_error": bool(result.is_error), "structured": result.structured_content,
                        "text": text_of(result)}
            if op == "cancel":
                await task.cancel()
                return {"acknowledged": True}
            raise ValueError(f"unknown op {op!r}")

        while True:
            # Read off the event loop, so the client's own work goes on while the test thinks.
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            if not line.strip():
                continue
            try:
                reply = await run(json.loads(line))
            except Exception as e:  # noqa: BLE001 - the test judges every failure
                reply = {"exception": repr(e)}
            print(json.dumps(reply, default=str), flush=True)


asyncio.run(main())
