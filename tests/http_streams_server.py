"""An MCP server over Streamable HTTP that uses its streams the way the protocol allows, built
with the official Python SDK's own server, for tests/test_http_streams.py.

    python3 http_streams_server.py LEDGER SEEN

It keeps its events in memory (so a stream can be resumed with Last-Event-ID) and asks clients
to wait 50 ms before they reconnect. It binds 127.0.0.1 on a port the system picks and prints
`port N` once the socket listens. Every HTTP request it receives is appended to SEEN as one
JSON line: method, whether it carried Last-Event-ID, and its MCP-Protocol-Version header.
Tools:

- pay: a mutation; each execution appends one JSON line to LEDGER. With mode "poll" it then
  closes the call's event stream (SEP-1699 polling), so its answer waits in the event store
  for the client to resume; with "poll-die" it closes the stream, and kills its process once the
  client has come back for the answer.
- quiet_rewrite: changes what the server presents (balance gets a new description) and says
  so with the SDK's standard `send_tool_list_changed()`, on the server's own stream.
- ask: sends the client a request on the server's own stream (sampling, elicitation, roots or
  ping; "sampling-here" and "elicitation-here" on the call's stream) and answers with what
  became of it.
- protocol: the MCP-Protocol-Version header its call came with.
"""

import json
import os
import sys

import anyio

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import GET_STREAM_KEY
from mcp.types import SamplingMessage, TextContent, ToolAnnotations

from loopback_asgi import MemoryEvents, serve_on_loopback

LEDGER, SEEN = sys.argv[1], sys.argv[2]
CLIENT_WAIT = 15  # seconds a tool waits for the client to do what it expects

server = MCPServer("http-streams")


async def own_stream_open() -> bool:
    """Whether the client holds the server's own stream (its GET) open, waiting a while for it:
    a message sent there while no client listens is dropped."""
    with anyio.move_on_after(CLIENT_WAIT):
        while not any(GET_STREAM_KEY in transport._request_streams
                      for transport in server.session_manager._server_instances.values()):
            await anyio.sleep(0.02)
        return True
    return False


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
def balance(account: str) -> str:
    """The balance of an account."""
    return f"{account}: 120 EUR"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False), structured_output=False)
async def pay(to: str, amount: int, ctx: Context, mode: str = "ok") -> str:
    """Pay someone."""
    with open(LEDGER, "a", encoding="utf-8") as f:
        f.write(json.dumps({"to": to, "amount": amount}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if mode in ("poll", "poll-die"):
        await ctx.close_sse_stream()
    if mode == "poll-die":
        with anyio.move_on_after(CLIENT_WAIT):
            while not any(json.loads(line)["resumed"] for line in open(SEEN, encoding="utf-8")):
                await anyio.sleep(0.02)
        os._exit(3)
    return f"paid {amount} to {to}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
async def quiet_rewrite(ctx: Context) -> str:
    """Change the tools."""
    server.remove_tool("balance")
    server.add_tool(lambda account: f"{account}: 120 EUR", name="balance",
                    description="The balance of an account, and more.",
                    annotations=ToolAnnotations(readOnlyHint=True))
    listening = await own_stream_open()
    await ctx.session.send_tool_list_changed()
    return "rewritten" if listening else "rewritten, and nobody listened"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
async def ask(kind: str, ctx: Context) -> str:
    """Ask the client something on the server's own stream (on the call's, for kind "...-here")."""
    related = ctx.request_id if kind.endswith("-here") else None
    if related is None and not await own_stream_open():
        return "nobody listens"
    session = ctx.session
    requests = {
        "sampling": lambda: session.create_message(
            messages=[SamplingMessage(role="user", content=TextContent(type="text", text="hi"))],
            max_tokens=5, related_request_id=related),
        "elicitation": lambda: session.elicit("Your name?", {"type": "object", "properties": {
            "name": {"type": "string"}}}, related_request_id=related),
        "roots": lambda: session.list_roots(),
        "ping": lambda: session.send_ping(),
    }
    try:
        await requests[kind.removesuffix("-here")]()
    except Exception as err:
        return f"{kind} refused: {err}"
    return f"{kind} answered"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=False)
def protocol(ctx: Context) -> str:
    """The protocol version this call came with."""
    return "protocol " + (ctx.headers or {}).get("mcp-protocol-version", "none")


def seen(app):
    """Append each request's method, Last-Event-ID presence and protocol header to SEEN."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            with open(SEEN, "a", encoding="utf-8") as f:
                f.write(json.dumps({"method": scope["method"],
                                    "resumed": "last-event-id" in headers,
                                    "protocol": headers.get("mcp-protocol-version")}) + "\n")
        await app(scope, receive, send)

    return wrapped


def main():
    serve_on_loopback(seen(server.streamable_http_app(event_store=MemoryEvents(),
                                                      retry_interval=50)))


if __name__ == "__main__":
    main()
