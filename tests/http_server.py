"""An MCP server over Streamable HTTP, built with the official Python SDK's own server, for the
HTTP upstream tests.

    python3 http_server.py LEDGER [json]

It binds 127.0.0.1 on a port the system picks and prints `port N` once the socket listens (a
connection made after that waits in the backlog until the server accepts it). `json` answers
with plain JSON bodies instead of event streams. Tools:

- balance: a read.
- pay: a mutation; each execution appends one JSON line to LEDGER before it answers. With
  mode "die" it appends the line and then kills its own process mid-call, so the request was
  received and executed but never answered.
- limits: its schema carries "maximum": 9007199254740993; its structured result carries the
  literal 1.10 (the SDK would write 1.1, so the marker "@1.10@" is rewritten on the way out).
- whoami: the SHA-256 of the X-Api-Key header it received (the secret itself never leaves).
- rewrite: changes what the server presents while it serves (balance gets a new description,
  whoami is gone) and says so with notifications/tools/list_changed on the call's own stream.
"""

import hashlib
import json
import os
import sys
from typing import Annotated

from pydantic import Field

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations, ToolListChangedNotification

from loopback_asgi import serve_on_loopback

LEDGER = sys.argv[1]
JSON = "json" in sys.argv[2:]
MARKER, LITERAL = b'"@1.10@"', b"1.10"

server = MCPServer("http-bank")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def balance(account: str) -> str:
    """The balance of an account."""
    return f"{account}: 120 EUR"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def pay(to: str, amount: int, mode: str = "ok") -> str:
    """Pay someone."""
    with open(LEDGER, "a", encoding="utf-8") as f:
        f.write(json.dumps({"to": to, "amount": amount}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if mode == "die":
        os._exit(3)
    return f"paid {amount} to {to}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True), structured_output=True)
def limits(amount: Annotated[int, Field(le=9007199254740993)]) -> dict[str, object]:
    """The exchange rate for an amount."""
    return {"amount": amount, "rate": "@1.10@"}


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def whoami(ctx: Context) -> str:
    """Who the caller says it is."""
    key = (ctx.headers or {}).get("x-api-key", "")
    return "key sha256 " + hashlib.sha256(key.encode()).hexdigest() if key else "no key"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def rewrite(ctx: Context) -> str:
    """Change the tools."""
    server.remove_tool("balance")
    server.remove_tool("whoami")
    server.add_tool(lambda account: f"{account}: 120 EUR", name="balance",
                    description="The balance of an account, and more.",
                    annotations=ToolAnnotations(readOnlyHint=True))
    await ctx.session.send_notification(ToolListChangedNotification(), related_request_id=ctx.request_id)
    return "rewritten"


def literal_numbers(app):
    """Rewrite the marker to a bare number literal in every body, dropping Content-Length."""

    async def wrapped(scope, receive, send):
        async def rewriting(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if k.lower() != b"content-length"]}
            elif message["type"] == "http.response.body":
                message = {**message, "body": message.get("body", b"").replace(MARKER, LITERAL)}
            await send(message)

        await app(scope, receive, rewriting)

    return wrapped


def main():
    serve_on_loopback(literal_numbers(server.streamable_http_app(json_response=JSON)))


if __name__ == "__main__":
    main()
