"""A Streamable HTTP front for a stdio MCP server, so the MCP conformance suite (which reaches a
server under test by URL) can test agentgate, which a host reaches over stdio.

    python3 conformance_bridge.py STDERR_FILE -- COMMAND [ARG...]

It binds 127.0.0.1 on a port the system picks and prints `port N` once the socket listens.
Each HTTP session is one host: its `initialize` starts COMMAND (its stderr appended to
STDERR_FILE), and every JSON-RPC message passes both ways unchanged, through the official
Python SDK's server transport (sessions, event streams, priming events, `retry`,
`Last-Event-ID` replay). The one thing the bridge adds is what a stdio line cannot carry: which
request a `notifications/progress` belongs to, taken from the request that gave its token, so
it travels on that request's event stream. Ending the session (DELETE) closes COMMAND's stdin.
"""

import json
import subprocess
import sys
from uuid import uuid4

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from mcp import types
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.shared.message import ServerMessageMetadata, SessionMessage

from loopback_asgi import MemoryEvents, serve_on_loopback

MAX_LINE = 64 * 1024 * 1024


async def run_session(command, stderr_file, transport, *, task_status):
    """Pump one HTTP session's messages to and from its own COMMAND process."""
    progress_requests = {}  # progress token -> id of the request that gave it
    async with transport.connect() as (read, write):
        with open(stderr_file, "ab") as errors:
            process = await anyio.open_process(command, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=errors)
        task_status.started()

        async def to_command():
            async with process.stdin:
                async for item in read:
                    if isinstance(item, Exception):
                        continue
                    wire = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                    message = json.loads(wire)
                    token = ((message.get("params") or {}).get("_meta") or {}).get("progressToken")
                    if "id" in message and token is not None:
                        progress_requests[token] = message["id"]
                    await process.stdin.send(json.dumps(message).encode() + b"\n")

        async def from_command():
            lines = BufferedByteReceiveStream(process.stdout)
            while True:
                try:
                    line = await lines.receive_until(b"\n", MAX_LINE)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    break
                message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                related = None
                if isinstance(message, types.JSONRPCNotification) and \
                        message.method == "notifications/progress":
                    related = progress_requests.get((message.params or {}).get("progressToken"))
                await write.send(SessionMessage(message, metadata=ServerMessageMetadata(
                    related_request_id=related)))
            tasks.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(to_command)
                tasks.start_soon(from_command)
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()


class Bridge:
    """The ASGI app: one transport and one COMMAND process per MCP session."""

    def __init__(self, command, stderr_file):
        self.command, self.stderr_file = command, stderr_file
        self.sessions: dict[str, StreamableHTTPServerTransport] = {}
        self.tasks = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        session = dict(scope["headers"]).get(b"mcp-session-id")
        if session is None:
            transport = StreamableHTTPServerTransport(
                mcp_session_id=uuid4().hex, event_store=MemoryEvents(), retry_interval=500)
            self.sessions[transport.mcp_session_id] = transport
            await self.tasks.start(run_session, self.command, self.stderr_file, transport)
        elif session.decode() in self.sessions:
            transport = self.sessions[session.decode()]
        else:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"no such session"})
            return
        await transport.handle_request(scope, receive, send)

    async def lifespan(self, receive, send):
        async with anyio.create_task_group() as self.tasks:
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            self.tasks.cancel_scope.cancel()
        await send({"type": "lifespan.shutdown.complete"})


def main():
    stderr_file, command = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    serve_on_loopback(Bridge(command, stderr_file))


if __name__ == "__main__":
    main()
