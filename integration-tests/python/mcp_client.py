"""Calls an MCP endpoint with the official Python SDK client, for the gateway's tests.

    mcp_client.py URL MODE [TOKEN] < calls.json
    mcp_client.py stdio MODE COMMAND [ARGS...] < calls.json    (spawns a stdio server)

MODE is `auto` (newest protocol, falling back to the initialize handshake) or `legacy`
(the initialize handshake). calls.json is a list of {"tool", "arguments", "meta"?,
"progress"?}, called one after another, or {"concurrent": true, "calls": [...]}, all started at
once on the one session. A call with "timeout" gives up after that many seconds (the client then
sends `notifications/cancelled`); {"list": true} lists the tools instead ({"tools": [{"name",
"description", "input_schema", "output_schema"}]}). Prints one JSON line per call, in the calls'
order: {"is_error", "structured", "text", "meta"} (and, for a call with "progress": true, "progress":
the [progress, message] pairs the server sent) or {"exception": "..."}.
"""

import asyncio
import json
import sys

from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client


async def main():
    url, mode = sys.argv[1], sys.argv[2]
    calls = json.load(sys.stdin)
    concurrent = isinstance(calls, dict) and calls.get("concurrent")
    if isinstance(calls, dict):
        calls = calls["calls"]
    if url == "stdio":
        transport = StdioServerParameters(command=sys.argv[3], args=sys.argv[4:])
    else:
        token = sys.argv[3] if len(sys.argv) > 3 else None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        transport = streamable_http_client(url, http_client=create_mcp_http_client(headers=headers))
    try:
        async with Client(transport, mode=mode) as client:

            async def one(call):
                if call.get("list"):
                    listed = await client.list_tools()
                    return {"tools": [{"name": t.name, "description": t.description,
                                       "input_schema": t.input_schema, "output_schema": t.output_schema,
                                       "annotations": t.annotations.model_dump(by_alias=True, exclude_none=True)
                                       if t.annotations else None}
                                      for t in listed.tools]}
                if call.get("delay"):
                    await asyncio.sleep(call["delay"])
                try:
                    notes = []

                    async def on_progress(progress, total, message):
                        notes.append([progress, message])

                    result = await client.call_tool(
                        call["tool"],
                        call.get("arguments") or {},
                        progress_callback=on_progress if call.get("progress") else None,
                        meta=call.get("meta"),
                        read_timeout_seconds=call.get("timeout"),
                    )
                    text = "".join(getattr(c, "text", "") for c in result.content)
                    reply = {
                        "is_error": bool(result.is_error),
                        "structured": result.structured_content,
                        "text": text,
                        "meta": result.meta,
                    }
                    if call.get("progress"):
                        reply["progress"] = notes
                    return reply
                except Exception as e:  # noqa: BLE001
                    return {"exception": repr(e)}

            if concurrent:
                for reply in await asyncio.gather(*(one(call) for call in calls)):
                    print(json.dumps(reply))
            else:
                for call in calls:
                    print(json.dumps(await one(call)))
                    sys.stdout.flush()
    except BaseException as e:  # noqa: BLE001 - connection failures are the test's to judge
        print(json.dumps({"exception": repr(e)}))


asyncio.run(main())
