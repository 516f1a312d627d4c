"""The tools the MCP conformance suite's server scenarios call, served by the official Python
SDK's low-level server, as agentgate's upstream in tests/test_conformance.py.

    python3 conformance_server.py stdio
    python3 conformance_server.py http

`http` binds 127.0.0.1 on a port the system picks, keeps every event of a stream so a client
can resume it (`Last-Event-ID`), suggests a `retry` and prints `port N` once the socket
listens. Each tool answers exactly what its scenario asks of a server (the suite's `list`
describes them); `test_reconnection` closes its call's event stream before answering, which a
careful client survives by reconnecting (SEP-1699), and is offered over HTTP only.

The 2026-07-28 and Tasks scenarios' fixtures (greet, slow_compute, failing_job, ...) are here
too, as a server of the handshake era serves them behind the gate: the gate makes the tasks.
`test_trigger_tool_change` flips `changing_tool`'s description and says the list changed, so
the gate withdraws it (or offers it again) and tells its listen streams.
"""

import base64
import struct
import sys
import zlib

import anyio

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from loopback_asgi import MemoryEvents, serve_on_loopback

HTTP = sys.argv[1:] == ["http"]
CLOSED = "closed a call's event stream before its answer"
NO_ARGUMENTS = {"type": "object", "properties": {}}
SCHEMA_2020_12 = {  # with the keywords the 2026-07-28 scenario adds (SEP-2106)
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {"address": {"$anchor": "addressDef", "type": "object",
                          "properties": {"street": {"type": "string"},
                                         "city": {"type": "string"}}}},
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"},
                   "contactMethod": {"type": "string", "enum": ["phone", "email"]},
                   "phone": {"type": "string"}, "email": {"type": "string"}},
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}


def png_1x1() -> str:
    """A valid one-pixel PNG, base64."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc
    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixel = zlib.compress(b"\0\xff\0\0")  # filter byte, then one red RGB pixel
    body = chunk(b"IHDR", header) + chunk(b"IDAT", pixel) + chunk(b"IEND", b"")
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + body).decode()


def wav_silence() -> str:
    """A valid WAV of 8 silent 8-bit samples, base64."""
    samples = b"\x80" * 8
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" \
        + struct.pack("<I", len(samples)) + samples
    return base64.b64encode(b"RIFF" + struct.pack("<I", len(riff)) + riff).decode()


IMAGE = types.ImageContent(type="image", data=png_1x1(), mime_type="image/png")
AUDIO = types.AudioContent(type="audio", data=wav_silence(), mime_type="audio/wav")


def text(value: str) -> types.TextContent:
    return types.TextContent(type="text", text=value)


def embedded(uri: str, mime: str, value: str) -> types.EmbeddedResource:
    return types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
        uri=uri, mime_type=mime, text=value))


async def progress(ctx, token) -> types.CallToolResult:
    for step in (0, 50, 100):
        if token is not None:
            await ctx.session.send_progress_notification(
                token, step, 100, related_request_id=ctx.request_id)
        await anyio.sleep(0.05)
    return types.CallToolResult(content=[text("Progress test completed")])


async def reconnection(ctx, token) -> types.CallToolResult:
    # Closing the stream before the answer exists is the point: the answer is stored as an
    # event and reaches a client that reconnects with the last event id it saw.
    # The SDK offers the close only to a client that negotiated 2025-11-25 (older ones cannot
    # resume); stderr says when it happened, so a test can tell a resumed call from one that
    # was never interrupted.
    if ctx.close_sse_stream is not None:
        await ctx.close_sse_stream()
        print(CLOSED, file=sys.stderr, flush=True)
    await anyio.sleep(0.2)
    return types.CallToolResult(content=[text("Reconnection test completed successfully")])


async def greet(ctx, token, name="") -> types.CallToolResult:
    return types.CallToolResult(content=[text(f"Hello, {name}!")])


async def slow_compute(ctx, token, seconds=0, label="") -> types.CallToolResult:
    await anyio.sleep(seconds)
    return types.CallToolResult(content=[text(f"computed {label} in {seconds} s")])


async def failing_job(ctx, token) -> types.CallToolResult:
    await anyio.sleep(1)
    return types.CallToolResult(content=[text("the job failed")], is_error=True)


async def protocol_error_job(ctx, token):
    raise MCPError(-32603, "the job crashed")


async def missing_capability(ctx, token):
    raise MCPError(-32021, "this tool needs sampling, which the client did not declare",
                   {"requiredCapabilities": {"sampling": {}}})


FLIPPED = ["Changes when triggered.", "Changed, as triggered."]


async def trigger_tool_change(ctx, token) -> types.CallToolResult:
    FLIPPED.reverse()
    await ctx.session.send_tool_list_changed()
    return types.CallToolResult(content=[text("the tool list changed")])


def fixed(*blocks, is_error: bool = False):
    async def answer(ctx, token) -> types.CallToolResult:
        return types.CallToolResult(content=list(blocks), is_error=is_error)
    return answer


TOOLS = {
    "test_simple_text": ("Returns one text block.", NO_ARGUMENTS,
                         fixed(text("This is a simple text response for testing."))),
    "test_image_content": ("Returns one image.", NO_ARGUMENTS, fixed(IMAGE)),
    "test_audio_content": ("Returns one audio clip.", NO_ARGUMENTS, fixed(AUDIO)),
    "test_embedded_resource": ("Returns one embedded resource.", NO_ARGUMENTS, fixed(
        embedded("test://embedded-resource", "text/plain",
                 "This is an embedded resource content."))),
    "test_multiple_content_types": ("Returns text, an image and a resource.", NO_ARGUMENTS, fixed(
        text("Multiple content types test:"), IMAGE,
        embedded("test://mixed-content-resource", "application/json",
                 '{"test":"data","value":123}'))),
    "test_error_handling": ("Always fails.", NO_ARGUMENTS, fixed(
        text("This tool intentionally returns an error for testing"), is_error=True)),
    "test_tool_with_progress": ("Reports progress 0, 50, 100.", NO_ARGUMENTS, progress),
    "json_schema_2020_12_tool": ("Tool with JSON Schema 2020-12 features", SCHEMA_2020_12,
                                 fixed(text("ok"))),
}
NAME = {"type": "object", "properties": {"name": {"type": "string"}}}
SLOW = {"type": "object", "properties": {"seconds": {"type": "number"},
                                         "label": {"type": "string"}}}
FILE = {"type": "object", "properties": {"filename": {"type": "string"}}}
TOOLS.update({
    "greet": ("Greets by name.", NAME, greet),
    "slow_compute": ("Sleeps, then answers.", SLOW, slow_compute),
    "failing_job": ("Fails after a second.", NO_ARGUMENTS, failing_job),
    "protocol_error_job": ("Answers a JSON-RPC error.", NO_ARGUMENTS, protocol_error_job),
    "confirm_delete": ("Deletes a file (here, says so).", FILE,
                       fixed(text("deleted, without asking: no elicitation here"))),
    "test_missing_capability": ("Needs sampling.", NO_ARGUMENTS, missing_capability),
    "test_streaming_elicitation": ("Would elicit.", NO_ARGUMENTS,
                                   fixed(text("no elicitation behind the gate"))),
    "test_logging_tool": ("Would log.", NO_ARGUMENTS, fixed(text("logged nothing"))),
    "test_trigger_tool_change": ("Changes changing_tool.", NO_ARGUMENTS, trigger_tool_change),
    "changing_tool": (None, NO_ARGUMENTS, fixed(text("unchanged"))),
})


if HTTP:
    TOOLS["test_reconnection"] = ("Closes its event stream before it answers.", NO_ARGUMENTS,
                                  reconnection)


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[
        types.Tool(name=name, description=description or FLIPPED[0], input_schema=schema,
                   annotations=types.ToolAnnotations(read_only_hint=True))
        for name, (description, schema, _) in TOOLS.items()])


async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
    token = (params.meta or {}).get("progress_token")
    answer = TOOLS[params.name][2]
    if params.name in ("greet", "slow_compute"):
        return await answer(ctx, token, **(params.arguments or {}))
    return await answer(ctx, token)


server = Server("conformance-tools", version="1.0.0", on_list_tools=list_tools,
                on_call_tool=call_tool)


async def serve_stdio():
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def handshake_era_only(app):
    """Refuse the stateless revisions after 2025-11-25 as a server of that year does (a 400
    without a JSON-RPC body), so a client falls back to `initialize`: the suite's own reference
    server speaks up to 2025-11-25, and only there does a stream close mid-call."""

    async def wrapped(scope, receive, send):
        version = dict(scope.get("headers", [])).get(b"mcp-protocol-version")
        if version is not None and version.decode() not in HANDSHAKE_PROTOCOL_VERSIONS:
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Unsupported protocol version"})
            return
        await app(scope, receive, send)

    return wrapped


def serve_http():
    serve_on_loopback(handshake_era_only(
        server.streamable_http_app(event_store=MemoryEvents(), retry_interval=200)))


if __name__ == "__main__":
    if HTTP:
        serve_http()
    else:
        anyio.run(serve_stdio)
