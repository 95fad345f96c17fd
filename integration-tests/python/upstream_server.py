"""A real MCP server (the official Python SDK) for the gateway's tests.

Its tool `environment` lists the names of the variables in its environment. Its tool
`add_tool` adds a tool with the given name and description and says the list changed (on a
`subscriptions/listen` stream, and unasked for clients on earlier protocols). Its tool `shout`
upper-cases a text and appends what it received in `_meta` (traceparent,
baggage) as one JSON line to the --record file, so a test can check the call stayed in the
caller's trace.

    upstream_server.py --transport stdio --record FILE
    upstream_server.py --transport http --record FILE --port-file FILE
"""

import argparse
import json
import socket

from mcp.server.mcpserver import Context, MCPServer

parser = argparse.ArgumentParser()
parser.add_argument("--transport", choices=["stdio", "http"], required=True)
parser.add_argument("--record", required=True)
parser.add_argument("--port-file")
args = parser.parse_args()

app = MCPServer("echo")


@app.tool()
def shout(text: str, ctx: Context) -> str:
    """Upper-cases the text."""
    meta = ctx.request_context.meta or {}
    with open(args.record, "a") as f:
        f.write(json.dumps({"transport": args.transport, "traceparent": meta.get("traceparent"),
                            "baggage": meta.get("baggage")}) + "\n")
    return text.upper()


@app.tool()
def environment() -> list[str]:
    """The names of the variables in this server's environment."""
    import os

    return sorted(os.environ)


@app.tool()
async def add_tool(name: str, description: str, ctx: Context) -> str:
    """Adds a tool that answers with its own name, and announces the change."""

    def added() -> str:
        return name

    app.add_tool(added, name=name, description=description)
    await ctx.notify_tools_changed()
    try:
        await ctx.session.send_tool_list_changed()
    except Exception:  # noqa: BLE001 - a modern connection has no unasked notifications
        pass
    return name


if __name__ == "__main__":
    if args.transport == "stdio":
        app.run()
    else:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(port))
        import os

        os.replace(args.port_file + ".tmp", args.port_file)
        app.run(transport="streamable-http", host="127.0.0.1", port=port)
