"""A client for a Nomad fleet, async and sync.

    from nomad_client import Fleet

    with Fleet.latest() as fleet:                  # the newest running fleet under ./runs
        fleet.call("embed", text="hello")          # a tool of the fleet, as MCP serves it
        fleet.run("from mcp_tools.nomad import embed\\nRESULT = embed('hi')['shape']").result
        fleet.search("embed a sentence")           # the gateway's tool search

    run = FleetRun.latest()                        # the same fleet's run, on disk
    for result in run.run_tasks(tasks):            # rollouts through it, as each ends
        print(result["status"], run.spans(trace_id=result["trace_id"]))

`AsyncFleet` is the same with `await`. A failed tool call raises `ToolError` with the gateway's
`.code` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
"""

from ._client import AsyncFleet, Fleet, RunResult, ToolError, find_fleet
from ._runs import FleetRun, RunFailed

__all__ = ["AsyncFleet", "Fleet", "FleetRun", "RunFailed", "RunResult", "ToolError", "find_fleet"]
