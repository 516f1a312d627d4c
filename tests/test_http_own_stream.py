"""The server's own stream (its GET) is held open all session, so a list_changed sent there is
heard: however late the initialize answer's HTTP body ends, and after the server refused the
stream a while.

agentgate reads an answer as its event completes, before the mcp package's client has the
response and takes the session id from it. A message the gate sends in between (its
notifications/initialized, at once) went without the session: the server refused it, and the
client, which opens the server's own stream when that notification passes, found no session
and never listened all session, so a list_changed sent there was never heard. A server (or a
proxy) whose answer's stream ends a moment after the answer makes that gap wide; the server
here holds it open until the client's next message arrives. The mcp package's client also gives
the stream up for the whole session after two failed attempts to open it; agentgate tries again.
"""

from __future__ import annotations

import http.server
import json
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import wait_for  # noqa: E402
from kit import DEADLINE, gate_host, loopback_http, pin, rule, said, write_config  # noqa: E402

HOLD = 2.0  # seconds the initialize answer's stream stays open waiting for the next message
LISTEN_WAIT = 15.0  # seconds `rewrite` waits for the caller's session to hold its stream open


class LateEndingHTTP:
    """A standard-library MCP server on 127.0.0.1 whose initialize answer comes as an event
    stream that ends only once the client's next message arrived (or after HOLD). Each session
    may hold one GET stream; `rewrite` changes the description of `balance` and says so there.
    `sessions` lists the session header of every request but initialize; `refusals` GETs are
    refused with 503 before any is accepted."""

    def __init__(self):
        self.sessions, self.streams, self.changed = [], {}, False
        self.refusals = 0  # GETs still to refuse with 503, as a server restarting does
        self.next_message = threading.Event()
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                session = self.headers.get("Mcp-Session-Id")
                if message.get("method") == "initialize":
                    return self.initialize(message)
                outer.sessions.append(session)
                outer.next_message.set()
                if session is None:
                    return self.reply(400, b"")
                if "id" not in message:
                    return self.reply(202, b"")
                if message["method"] == "tools/list":
                    result = {"tools": outer.tools()}
                else:
                    result = {"content": [{"type": "text", "text": outer.rewrite(session)}]}
                self.reply(200, json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())

            def initialize(self, message):
                with outer.lock:
                    session = f"s{len(outer.streams) + 1}"
                    outer.streams[session] = None  # no stream held yet
                    outer.next_message.clear()
                result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {"listChanged": True}},
                          "serverInfo": {"name": "late", "version": "1"}}
                self.start_stream(session)
                self.event({"jsonrpc": "2.0", "id": message["id"], "result": result})
                outer.next_message.wait(HOLD)
                self.wfile.write(b"0\r\n\r\n")

            def do_GET(self):
                session = self.headers.get("Mcp-Session-Id")
                if session not in outer.streams:
                    return self.reply(400, b"")
                with outer.lock:
                    outer.refusals -= 1
                    if outer.refusals >= 0:
                        return self.reply(503, b"")
                pushed: queue.Queue = queue.Queue()
                self.start_stream(session)
                outer.streams[session] = pushed
                while (message := pushed.get()) is not None:
                    self.event(message)
                self.wfile.write(b"0\r\n\r\n")

            def start_stream(self, session):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Mcp-Session-Id", session)
                self.end_headers()
                self.wfile.flush()

            def event(self, message):
                data = b"data: " + json.dumps(message).encode() + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def reply(self, status, body):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server, self.url = loopback_http(Handler)

    def tools(self) -> list[dict]:
        balance = "The balance of an account, and more." if self.changed else "The balance of an account."
        schema = {"type": "object", "properties": {"account": {"type": "string"}}}
        return [{"name": "balance", "description": balance, "inputSchema": schema},
                {"name": "rewrite", "description": "Change the tools.", "inputSchema": {"type": "object"}}]

    def rewrite(self, session: str) -> str:
        """Change `balance`, and say so on the caller's own stream once it is held open."""
        self.changed = True
        until = time.monotonic() + LISTEN_WAIT
        while self.streams.get(session) is None:
            if time.monotonic() > until:
                return "rewritten, and nobody listened"
            time.sleep(0.02)
        self.streams[session].put({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        return "rewritten"

    def close(self) -> None:
        for pushed in list(self.streams.values()):
            if pushed is not None:
                pushed.put(None)
        self.server.shutdown()
        self.server.server_close()


def bank_config(workdir, server: LateEndingHTTP) -> Path:
    config = write_config(workdir, [{"name": "bank", "url": server.url, "manifest": "bank.manifest.json",
                                     "rules": {"balance": rule("read_only"), "rewrite": rule("read_only", "60s")}}])
    assert pin(config).returncode == 0
    return config


def hears_the_change(config) -> None:
    """A gate on `config` holds the server's own stream open and acts on the list_changed sent there."""
    gate = gate_host(config)
    try:
        assert "bank_balance" in {t.name for t in gate.list_tools()}
        text, error = said(gate.call("bank_rewrite", {}))
        assert not error and text == "rewritten", text  # the gate held its own stream open
        wait_for(lambda: "bank_balance" not in {t.name for t in gate.list_tools()}, DEADLINE,
                 message="the changed tool to be withdrawn")
        # Held before it is said: the log line may follow the withdrawal.
        wait_for(lambda: "changed its tools while serving" in gate.stderr_text(), DEADLINE)
    finally:
        gate.close()


def test_a_list_changed_is_heard_when_the_initialize_answer_ends_late(workdir):
    server = LateEndingHTTP()
    try:
        hears_the_change(bank_config(workdir, server))
        assert None not in server.sessions, server.sessions  # every message went with its session
    finally:
        server.close()


def test_a_list_changed_is_heard_after_the_servers_own_stream_was_refused_a_while(workdir):
    # The SDK's client alone gives the stream up for the session after two failed attempts.
    server = LateEndingHTTP()
    try:
        config = bank_config(workdir, server)
        server.refusals = 3
        hears_the_change(config)
        assert server.refusals < 0  # each refusal was met, and the stream then opened
    finally:
        server.close()
