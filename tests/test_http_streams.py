"""HTTP servers that use their streams (issue 20, item 6; the HTTP half of issue 19, item 10).

agentgate speaks to a url server as a careful client does (SPEC, "HTTP servers"): it resumes an
answer's event stream the server closed (SEP-1699 polling: an event id, `retry`, then a GET with
Last-Event-ID), listens on the server's own stream (a list_changed there is acted on, a request
there answered at once) and negotiates the newest protocol version both speak.

The server is the official SDK's own (tests/http_streams_server.py) with an event store, started
by each test as a child on 127.0.0.1; a stream that breaks off mid-chunk comes from a small
standard-library server inside the test (PollingHTTP). agentgate is driven as a host drives it,
under the SDK's stdio client.
"""

from __future__ import annotations

import http.server
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import wait_for  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    Listening,
    agentgate as run_agentgate,
    approval_in,
    approvals,
    expect,
    gate_host,
    loopback_http,
    only_pending,
    pin,
    records,
    rule,
    said,
    write_config,
)

SERVER_SCRIPT = Path(__file__).resolve().parent / "http_streams_server.py"
KIM = {"to": "kim", "amount": 3}
RULES = {"balance": rule("read_only"), "quiet_rewrite": rule("read_only", "60s"),
         "ask": rule("read_only", "60s"), "protocol": rule("read_only"),
         "pay": rule("remote_mutation", "60s", outcome="allow")}


class StreamsServer(Listening):
    """tests/http_streams_server.py in its own process group; `url` once it listens."""

    def __init__(self, dir: Path):
        self.ledger, self.seen = dir / "ledger.jsonl", dir / "seen.jsonl"
        super().__init__([sys.executable, str(SERVER_SCRIPT), str(self.ledger), str(self.seen)],
                         dir / "http_server.stderr")

    def payments(self) -> int:
        return len(records(self.ledger))

    def requests(self) -> list[dict]:
        return records(self.seen)


@pytest.fixture
def served(workdir):
    """The streams server, pinned, under RULES: (server, config)."""
    server = StreamsServer(workdir)
    try:
        config = write_config(workdir, [{"name": "bank", "url": server.url, "manifest": "bank.manifest.json",
                                         "default_timeout": "30s", "rules": RULES}])
        assert pin(config).returncode == 0
        yield server, config
    finally:
        server.stop()


# ---------------------------------------------------------------- resuming an answer's stream


def test_a_payment_whose_stream_the_server_closes_is_resumed_and_paid_once(workdir, served):
    server, config = served
    gate = gate_host(config)
    try:
        text, error = said(gate.call("bank_pay", {**KIM, "mode": "poll"}))
        assert not error and text == "paid 3 to kim", text
        assert server.payments() == 1
        # The answer came on a GET that resumed the stream the server had closed.
        assert any(r["method"] == "GET" and r["resumed"] for r in server.requests()), server.requests()
        assert approvals(workdir) == []  # no unknown outcome waits for anyone

        expect(gate.call("bank_pay", {**KIM, "mode": "poll"}), "DUPLICATE")
        assert server.payments() == 1
    finally:
        gate.close()


def test_a_stream_that_cannot_be_resumed_leaves_the_outcome_unknown(workdir, served):
    server, config = served
    gate = gate_host(config)
    try:
        text = expect(gate.call("bank_pay", {**KIM, "mode": "poll-die"}), "UNKNOWN_OUTCOME", is_error=False)
        assert "may have" in text and "resuming it failed" in text, text
        assert server.payments() == 1  # it paid, closed the stream, and died as the gate came back for it
        pending = only_pending(workdir)
        assert pending["kind"] == "interrupted_side_effect" and approval_in(text) == pending["id"]
        expect(gate.call("bank_pay", {**KIM, "mode": "poll-die"}), "UNKNOWN_OUTCOME", is_error=False)
        assert server.payments() == 1
    finally:
        gate.close()


class PollingHTTP:
    """A standard-library MCP server on 127.0.0.1 whose every tools/call answer is polled for:
    the call's event stream names event "e1" and then breaks off (with `abrupt`, in the middle
    of a chunk, as a dropped connection does), and the answer comes on a GET that resumes from
    "e1". `calls` counts executions; `resumed` lists the Last-Event-ID of each GET."""

    PAY = {"name": "pay", "inputSchema": {"type": "object", "properties": {
        "to": {"type": "string"}, "amount": {"type": "integer"}}}}

    def __init__(self, abrupt: bool):
        self.calls, self.resumed, self.call_id = 0, [], None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                method = message.get("method")
                if "id" not in message:
                    return self.reply(202, b"")
                if method == "initialize":
                    result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                              "serverInfo": {"name": "polling", "version": "1"}}
                elif method == "tools/list":
                    result = {"tools": [outer.PAY]}
                else:
                    outer.calls += 1
                    outer.call_id = message["id"]
                    return self.poll()
                self.reply(200, json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())

            def poll(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = b"id: e1\nretry: 10\ndata: \n\n"
                if abrupt:  # the chunk promises more than comes, and the connection drops
                    self.wfile.write(b"%x\r\n" % (len(event) + 100) + event)
                else:
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
                self.wfile.flush()
                self.close_connection = True

            def do_GET(self):
                last = self.headers.get("Last-Event-ID")
                if last is None:
                    return self.reply(405, b"")
                outer.resumed.append(last)
                answer = {"jsonrpc": "2.0", "id": outer.call_id,
                          "result": {"content": [{"type": "text", "text": "paid once"}]}}
                body = b"id: e2\ndata: " + json.dumps(answer).encode() + b"\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def reply(self, status, body):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Mcp-Session-Id", "s1")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server, self.url = loopback_http(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("abrupt", [False, True], ids=["closed", "dropped"])
def test_an_answer_is_fetched_from_where_the_stream_broke_off(workdir, abrupt):
    server = PollingHTTP(abrupt)
    try:
        config = write_config(workdir, [{"name": "bank", "url": server.url, "manifest": "bank.manifest.json",
                                         "rules": {"pay": rule("remote_mutation", "60s", outcome="allow")}}])
        pin(config)
        gate = gate_host(config)
        try:
            text, error = said(gate.call("bank_pay", KIM))
            assert not error and text == "paid once", text
        finally:
            gate.close()
        assert server.calls == 1 and server.resumed == ["e1"], (server.calls, server.resumed)
        assert approvals(workdir) == []
    finally:
        server.close()


# ---------------------------------------------------------------- the server's own stream


def test_a_list_changed_on_the_servers_own_stream_quarantines_the_changed_tool(served):
    server, config = served
    gate = gate_host(config)
    try:
        assert {t.name for t in gate.list_tools()} >= {"bank_balance", "bank_quiet_rewrite"}
        text, error = said(gate.call("bank_quiet_rewrite", {}))
        assert not error and text == "rewritten", text  # the server saw the gate listen on its stream
        wait_for(lambda: "bank_balance" not in {t.name for t in gate.list_tools()}, DEADLINE,
                 message="the changed tool to be withdrawn")
        denied, _ = said(gate.call("bank_balance", {"account": "A-1"}))
        assert denied.startswith("DENIED:") and "differently" in denied, denied
        # Held before it is said: the log line may follow the withdrawal.
        wait_for(lambda: "changed its tools while serving" in gate.stderr_text(), DEADLINE)
        text, error = said(gate.call("bank_protocol", {}))
        assert not error and text.startswith("protocol "), text  # the unchanged tools go on working
    finally:
        gate.close()


def test_a_request_on_the_servers_own_stream_is_answered_at_once(served):
    server, config = served
    gate = gate_host(config)
    try:
        # Each call ends with the server's own answer, not the gate's deadline.
        for kind in ("sampling", "elicitation", "roots", "sampling-here", "elicitation-here"):
            text, error = said(gate.call("bank_ask", {"kind": kind}))
            assert not error and text.startswith(f"{kind} refused: ") and "does not offer" in text, text
        text, error = said(gate.call("bank_ask", {"kind": "ping"}))
        assert not error and text == "ping answered", text
    finally:
        gate.close()


# ---------------------------------------------------------------- the protocol version


def test_the_newest_version_both_speak_is_negotiated(served):
    server, config = served
    newest = agentgate.PROTOCOL_VERSIONS[-1]
    gate = gate_host(config)
    try:
        text, error = said(gate.call("bank_protocol", {}))
        assert not error and text == f"protocol {newest}", text
    finally:
        gate.close()
    # Every request after initialize names the version the server answered.
    posts = [r for r in server.requests() if r["method"] == "POST"]
    assert any(r["protocol"] == newest for r in posts), posts
    assert all(r["protocol"] in (None, newest) for r in posts), posts  # None: an initialize


def test_event_ids_are_kept_as_the_stream_names_them():
    stream = agentgate._EventStream()
    assert stream.feed(b"id: 7\nretry: 50\ndata:\n\n") == [b""]  # a priming event: an id, no message
    assert stream.last_id == b"7"
    assert stream.feed(b'id:8\ndata: {"a":1}\n\nid: bad\0id\n\n') == [b'{"a":1}']
    assert stream.last_id == b"8"  # an id holding NUL is ignored, as the SSE standard says


# A stdio server that records what initialize asked for and answers the version it is given.
VERSIONED_SERVER = """
import json, sys
asked, answer = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    message = json.loads(line)
    if message.get("method") == "initialize":
        open(asked, "w").write(message["params"]["protocolVersion"])
        result = {"protocolVersion": answer, "capabilities": {"tools": {}}, "serverInfo": {"name": "v", "version": "0"}}
    elif message.get("method") == "tools/list":
        result = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
    else:
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
"""


def versioned_config(workdir, answer: str):
    script = workdir / "versioned_server.py"
    script.write_text(VERSIONED_SERVER)
    asked = workdir / "asked.txt"
    config = write_config(workdir, [{"name": "v", "command": [sys.executable, str(script), str(asked), answer],
                                     "manifest": "v.manifest.json", "rules": {"echo": rule("read_only")}}])
    return config, asked


def test_a_stdio_server_is_asked_the_newest_version_and_may_answer_an_older_one(workdir):
    config, asked = versioned_config(workdir, "2025-03-26")
    done = pin(config)
    assert done.returncode == 0, done.stderr
    assert asked.read_text() == agentgate.PROTOCOL_VERSIONS[-1]


def test_a_server_answering_a_version_the_gate_does_not_speak_is_refused(workdir):
    config, asked = versioned_config(workdir, "1999-01-01")
    done = run_agentgate("pin", "-config", str(config))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert 'the server answered protocol version "1999-01-01"' in done.stderr, done.stderr
