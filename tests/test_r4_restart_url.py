"""Issue 29 item 2, for a url server: one stopped while the gate serves and started again on
its port is connected again (a new session, listed against its pin), and while it is down a
call fails known, with nothing sent, stderr and the status tool saying so.

The upstream is the official SDK's own server (tests/http_server.py); the second one is
started on the first's port, as a person restarting a local server would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from conftest import wait_for
from kit import DEADLINE, Listening, host, pin, rule, said, write_config
from test_http_upstream import initialize_result, scripted_http  # noqa: F401

SERVER = Path(__file__).resolve().parent / "http_server.py"
PAY = {"to": "kim", "amount": 3}


def payments(ledger: Path) -> list:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def status(gate) -> str:
    return said(gate.call("gate_status", {}))[0]


def test_a_url_server_started_again_on_its_port_is_connected_again(workdir):
    ledger = workdir / "ledger.jsonl"
    argv = [sys.executable, str(SERVER), str(ledger)]
    server = Listening(argv, workdir / "first.stderr")
    port = urlsplit(server.url).port
    rules = {"balance": rule("read_only"),
             "pay": rule("remote_mutation", outcome="allow")}
    config = write_config(workdir, [{
        "name": "bank", "url": server.url, "manifest": "bank.manifest.json",
        "default_timeout": "30s", "rules": rules}])
    pin(config)
    gate = host(config)
    again = None
    try:
        assert said(gate.call("bank_pay", PAY)) == ("paid 3 to kim", False)
        server.stop()

        # Down: the call is refused before any byte is sent, and counts
        # for nothing (its retry later is no duplicate).
        text, is_error = said(gate.call("bank_pay", {**PAY, "amount": 4}))
        assert is_error and "nothing was sent" in text, text
        assert not text.startswith(("UNKNOWN_OUTCOME", "DUPLICATE")), text
        wait_for(lambda: "server bank cannot be reached" in gate.stderr_text(),
                 DEADLINE, message="stderr to say the server went away")
        assert "until it is connected again" in gate.stderr_text()
        down = status(gate)
        assert "Server bank is down" in down and "connected again" in down, down

        # Started again on its port: a new session, the same tools.
        again = Listening(argv, workdir / "second.stderr",
                          env={"LOOPBACK_PORT": str(port)})
        wait_for(lambda: "server bank was connected again" in gate.stderr_text(),
                 DEADLINE, message="the gate to connect again")
        assert "is down" not in status(gate)
        text, is_error = said(gate.call("bank_pay", {**PAY, "amount": 4}))
        assert (text, is_error) == ("paid 4 to kim", False), text
        assert payments(ledger) == [{"to": "kim", "amount": 3},
                                    {"to": "kim", "amount": 4}]
    finally:
        gate.close()
        server.stop()
        if again:
            again.stop()


PAY_TOOL = [{"name": "pay", "description": "Pay someone.", "inputSchema": {
    "type": "object", "properties": {"to": {"type": "string"}}}}]


def forgetful_server(scripted_http, paid: list, state: dict):
    """A url server whose session changes when state["session"] does: a
    message under an older one is answered 404, as the protocol says."""

    def answer(handler, message):
        method, ident = message["method"], message["id"]
        if method == "initialize":
            reply = initialize_result(ident)
        elif handler.headers.get("Mcp-Session-Id") != state["session"]:
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        elif method == "tools/list":
            reply = {"jsonrpc": "2.0", "id": ident, "result": {"tools": PAY_TOOL}}
        else:
            paid.append(message["params"]["arguments"])
            reply = {"jsonrpc": "2.0", "id": ident, "result": {
                "content": [{"type": "text", "text": "paid"}]}}
        body = json.dumps(reply).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Mcp-Session-Id", state["session"])
        handler.end_headers()
        handler.wfile.write(body)

    return scripted_http(answer)


def test_a_server_that_forgot_the_session_ran_nothing_and_is_connected_again(
        workdir, scripted_http):
    paid, state = [], {"session": "first"}
    server = forgetful_server(scripted_http, paid, state)
    config = write_config(workdir, [{
        "name": "bank", "url": server.url, "manifest": "bank.manifest.json",
        "default_timeout": "30s",
        "rules": {"pay": rule("remote_mutation", outcome="allow")}}])
    pin(config)
    gate = host(config)
    try:
        assert said(gate.call("bank_pay", {"to": "kim"})) == ("paid", False)
        state["session"] = "second"  # the server was started again
        failed = gate.call("bank_pay", {"to": "ann"})
        text, is_error = said(failed)
        assert is_error and "no longer knows the session" in text, text
        # The gate's own answer, marked as such, naming no server.
        assert failed.meta == {"gate/answer": "FAILED"}, failed.meta
        assert "nothing ran" in text and not text.startswith("UNKNOWN"), text
        assert paid == [{"to": "kim"}]
        wait_for(lambda: "server bank was connected again" in gate.stderr_text(),
                 DEADLINE, message="the gate to connect again")
        # Nothing ran, so the identical call is no duplicate: it pays once.
        assert said(gate.call("bank_pay", {"to": "ann"})) == ("paid", False)
        assert paid == [{"to": "kim"}, {"to": "ann"}]
    finally:
        gate.close()
