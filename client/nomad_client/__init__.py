"""A client for a Nomad fleet, async and sync.

    from nomad_client import Fleet

    with Fleet.latest() as fleet:                  # the newest running fleet under ./runs
        fleet.call("embed", text="hello")          # a tool of the fleet, as MCP serves it
        fleet.run("from mcp_tools.nomad import embed\\nRESULT = embed('hi')['shape']").result
        fleet.search("embed a sentence")           # the gateway's tool search

`AsyncFleet` is the same with `await`. A failed tool call raises `ToolError` with the gateway's
`.code` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
"""

from ._client import AsyncFleet, Fleet, RunResult, ToolError, find_fleet

__all__ = ["AsyncFleet", "Fleet", "RunResult", "ToolError", "find_fleet"]
