"""HTTP upstreams (issue 12, item 6): a server with `url`, reached over Streamable HTTP through
the standard library's client, pinned, checked and gated exactly as a stdio server is.

The upstream is the official SDK's own server (tests/http_server.py), started by each test as a
child bound to 127.0.0.1 on a port the system picks; redirects, oversized answers, answers that
never come and hand-shaped event streams come from a small standard-library HTTP server inside
the test (ScriptedHTTP). agentgate is driven as a host drives it: `pin`, `check`, and a served
session under the SDK's stdio client.

Ported from the reference suite (agentrt-tests.md):
- TestPin_OverStreamableHTTPReadsTheRawSchema (both modes, json=false / json=true) ->
  test_the_schemas_number_literal_survives_pin_load_and_call; the HTTP half of
  TestCall_StructuredContentKeepsItsNumbers -> the same test's result literal 1.10.
- TestPin_OversizedHTTPResponseFails -> test_an_answer_past_the_message_cap_fails_the_pin.
- TestHTTP_RedirectIsNotFollowed (a 307 to another host is not followed and the other host is
  never reached) -> test_a_redirect_is_not_followed; agentgate also refuses a same-origin one.
- TestMessageTap_RecordsJSONAndSSEResults and TestMessageTap_SkipsEventsTheSDKIgnores ->
  test_event_stream_answers_are_read_from_their_bytes (end to end, each shape) and
  test_events_split_anywhere_read_the_same (fed one byte at a time).
- TestLimitedTransport_FailsABodyPastTheLimit: its observable half (a body past the limit
  fails) is the oversized test above.
- TestServer_ConnectTimeoutBoundsAnInitializeThatNeverAnswers, over HTTP ->
  test_connect_timeout_bounds_an_initialize_that_never_answers.
N/A:
- TestLimitedTransport_*'s exact 10-byte limit and Content-Length variants, and
  TestHTTPClient_CopiesAndNeverUsesTheDefault (an operator-supplied client is copied, the
  process default never used, CheckRedirect kept): Go API surfaces. agentgate takes no HTTP
  client from anyone; it builds one per server with redirects off and the cap in its own
  transport, which the redirect and oversized tests observe.
- TestHTTP_RedirectIsNotFollowed's "an operator client keeps its own CheckRedirect": same reason.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import AGENTGATE, wait_for  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    Listening,
    agentgate as run_agentgate,
    approvals,
    approve,
    approval_in,
    check,
    db_path,
    expect,
    gate_host,
    loopback_http,
    has_raw_controls,
    only_pending,
    pin,
    records,
    rule,
    run_in_hint,
    said,
    write_config,
    write_private,
)

SERVER_SCRIPT = Path(__file__).resolve().parent / "http_server.py"
SECRET = "s3cret-7f1c9e-do-not-print"
KIM = {"to": "kim", "amount": 3}
READS = {"balance": rule("read_only"), "limits": rule("read_only"), "whoami": rule("read_only")}


# ---------------------------------------------------------------- the SDK's server, as a child


class SDKServer(Listening):
    """tests/http_server.py in its own process group; `url` once it listens."""

    def __init__(self, dir: Path, json_response: bool = False):
        self.ledger = dir / "ledger.jsonl"
        super().__init__([sys.executable, str(SERVER_SCRIPT), str(self.ledger)] + (["json"] if json_response else []),
                         dir / "http_server.stderr")

    def payments(self) -> int:
        return len(records(self.ledger))


@pytest.fixture
def sdk_server(workdir):
    """Start the SDK's server (json_response=...) for this test; every one is killed after it."""
    started = []

    def start(json_response: bool = False) -> SDKServer:
        started.append(SDKServer(workdir, json_response))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def url_server(url: str, rules: dict | None = None, **fields) -> dict:
    return {"name": "bank", "url": url, "manifest": "bank.manifest.json", "default_timeout": "30s",
            "rules": READS if rules is None else rules, **fields}


def config_for(dir, url: str, rules: dict | None = None, **fields) -> Path:
    return write_config(dir, [url_server(url, rules, **fields)])


def one_line_error(done, *fragments: str) -> str:
    """A refusal: exit 1, one line on stderr, no traceback, every fragment in it."""
    text = done.stderr
    assert done.returncode == 1, f"exit {done.returncode}:\n{done.stdout}\n{text}"
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return text


def free_port() -> int:
    """A port nothing listens on: bound, then released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- a hand-shaped HTTP server


class ScriptedHTTP:
    """A standard-library HTTP server on 127.0.0.1 in this process. `answer(handler, message)`
    writes the whole response to one JSON-RPC message POSTed to it; `requests` counts what came."""

    def __init__(self, answer):
        self.requests = []
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                message = json.loads(body)
                outer.requests.append((self.path, message))
                if "id" not in message:  # a notification
                    self.send_response(202)
                    self.end_headers()
                    return
                answer(self, message)

            def do_GET(self):
                outer.requests.append((self.path, None))
                self.send_response(405)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server, self.url = loopback_http(Handler)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted_http():
    started = []

    def start(answer) -> ScriptedHTTP:
        started.append(ScriptedHTTP(answer))
        return started[-1]

    yield start
    for server in started:
        server.close()


def send_body(handler, body: bytes, content_type: str = "application/json", status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def initialize_result(ident) -> dict:
    return {"jsonrpc": "2.0", "id": ident, "result": {
        "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
        "serverInfo": {"name": "scripted-http", "version": "1"}}}


def list_answer(tools_json: str, ident) -> bytes:
    """A tools/list answer, its tools written as given (literals and all)."""
    return f'{{"jsonrpc":"2.0","id":{json.dumps(ident)},"result":{{"tools":{tools_json}}}}}'.encode()


REAL_TOOLS = '[{"name":"real","description":"the real one","inputSchema":{"type":"object","properties":' \
             '{"n":{"type":"number","maximum":1.10}}}}]'
OTHER_TOOLS = '[{"name":"other","inputSchema":{"type":"object"}}]'


# ---------------------------------------------------------------- pin, check and the gate


def test_pin_check_and_a_read_through_the_gate(workdir, sdk_server):
    server = sdk_server()
    config = config_for(workdir, server.url)

    done = pin(config)
    assert "server bank: 5 tools pinned" in done.stdout, done.stdout
    for line in ("balance", "limits", "pay", "whoami", "rewrite"):
        assert line in done.stdout
    checked = check(config)
    assert checked.returncode == 0, checked.stderr
    for name in ("balance", "limits", "whoami"):
        assert f"registered {name} as bank_{name} (read_only)" in checked.stdout
    assert "unclassified pay: no rule" in checked.stdout

    gate = gate_host(config)
    assert sorted(t.name for t in gate.list_tools()) == ["bank_balance", "bank_limits", "bank_whoami", "gate_status"]
    text, error = said(gate.call("bank_balance", {"account": "A-1"}))
    assert not error and "A-1: 120 EUR" in text, text


@pytest.mark.parametrize("json_response", [False, True], ids=["event-stream", "json"])
def test_the_schemas_number_literal_survives_pin_load_and_call(workdir, sdk_server, json_response):
    server = sdk_server(json_response)
    config = config_for(workdir, server.url)
    pin(config)

    manifest = (workdir / "bank.manifest.json").read_text()
    assert '"maximum": 9007199254740993' in manifest  # not 9007199254740992, not 9.007199254740993e15
    assert check(config).returncode == 0

    gate = gate_host(config)
    # Issue 20: the structured content passes beside the server's own text (which the gate
    # used to replace with its JSON); the literals live on in it and in the record below.
    result = gate.call("bank_limits", {"amount": 9007199254740993})
    assert not result.is_error and result.structured_content["amount"] == 9007199254740993, result
    # The gate checks the call against the literal itself: one past it is refused before sending.
    expect(gate.call("bank_limits", {"amount": 9007199254740994}), "INVALID", is_error=True)
    gate.close()
    recorded = b"".join(p.read_bytes() for p in workdir.glob(db_path(workdir).name + "*"))
    assert b'"rate":1.10' in recorded


def test_headers_come_from_the_environment_and_the_secret_is_never_shown(workdir, sdk_server):
    server = sdk_server()
    config = config_for(workdir, server.url, headers={"X-Api-Key": "${BANK_KEY}"})
    env = {"BANK_KEY": SECRET}

    outputs = [pin(config, env=env), check(config, env=env)]
    gate = gate_host(config, env=env)
    text, error = said(gate.call("bank_whoami", {}))
    assert not error and "key sha256 " + hashlib.sha256(SECRET.encode()).hexdigest() in text, text
    gate.close()

    for done in outputs:
        assert SECRET not in done.stdout + done.stderr
    assert SECRET not in gate.stderr_text()
    assert SECRET not in config.read_text() and "${BANK_KEY}" in config.read_text()
    for path in workdir.iterdir():
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path.name


def test_a_header_naming_an_unset_variable_is_refused_in_one_sentence(workdir, sdk_server):
    config = config_for(workdir, "http://127.0.0.1:9/mcp", headers={"Authorization": "Bearer ${NO_SUCH_TOKEN}"})
    for command in ("pin", "check"):
        done = run_agentgate(command, "-config", str(config), env={"NO_SUCH_TOKEN": None})
        one_line_error(done, 'server "bank".headers.Authorization', "NO_SUCH_TOKEN", "not set")


def test_without_the_mcp_package_a_url_server_is_pinned_and_served(workdir, sdk_server):
    # The serving gate speaks HTTP through the standard library: only login needs mcp.
    fake = workdir / "fake"
    (fake / "mcp").mkdir(parents=True)
    (fake / "mcp" / "__init__.py").write_text('raise ImportError("this mcp is not installed")\n')
    env = {"PYTHONPATH": str(fake)}
    config = config_for(workdir, sdk_server().url)
    assert pin(config, env=env).returncode == 0
    gate = gate_host(config, env=env)
    text, error = said(gate.call("bank_balance", {"account": "A-1"}))
    assert not error and "A-1: 120 EUR" in text, text


def test_the_mcp_package_is_not_imported_until_a_url_server_starts():
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import agentgate; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'httpx2', 'asyncio')))")
    done = subprocess.run([sys.executable, "-c", probe, str(AGENTGATE.parent)], capture_output=True,
                          text=True, timeout=DEADLINE)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done


@pytest.mark.parametrize("fields, fragments", [
    ({"env": ["A=b"]}, ['server "bank".env means nothing for a server reached by url']),
    ({"inherit_env": ["HOME"]}, ['server "bank".inherit_env means nothing']),
    ({"cwd": "/tmp"}, ['server "bank".cwd means nothing']),
    ({"url": "ftp://127.0.0.1/mcp"}, ['server "bank".url must be an http:// or https:// address']),
    ({"url": "http:///mcp"}, ["must be an http:// or https:// address"]),
    ({"url": "http://me:pw@127.0.0.1:9/mcp"}, ['server "bank".url must not carry a user or password']),
    ({"headers": {"X-Key": 5}}, ['server "bank".headers must be an object of header name to string']),
    ({"headers": {"Bad Name": "x"}}, ['"Bad Name" is not a header name']),
    ({"headers": {"X-Key": "${1ABC}"}}, ["a variable is written ${NAME}"]),
    ({"command": ["server"]}, ['server "bank" needs exactly one of command (an argv list) or url']),
], ids=["env", "inherit_env", "cwd", "ftp", "no-host", "userinfo", "header-type", "header-name", "variable-name", "both"])
def test_a_url_server_is_refused_what_means_nothing_for_it(workdir, fields, fragments):
    config = write_config(workdir, [{**url_server("http://127.0.0.1:9/mcp"), **fields}])
    one_line_error(check(config), *fragments)


def test_headers_are_refused_on_a_command_server(workdir):
    server = {"name": "bank", "command": ["true"], "manifest": "m.json", "headers": {"X": "y"}}
    one_line_error(check(write_config(workdir, [server])), 'server "bank".headers is sent only to a server reached by url')


def test_a_header_value_with_a_line_break_is_refused_without_showing_it(workdir):
    config = config_for(workdir, "http://127.0.0.1:9/mcp", headers={"X-Api-Key": "${BANK_KEY}"})
    text = one_line_error(check(config, env={"BANK_KEY": SECRET + "\r\nX-Evil: 1"}),
                          'server "bank".headers.X-Api-Key holds a control character')
    assert SECRET not in text


# ---------------------------------------------------------------- mutations, unknown outcomes, unreachable servers


def test_a_payment_waits_for_approval_and_runs_once(workdir, sdk_server):
    server = sdk_server()
    config = config_for(workdir, server.url, {**READS, "pay": rule("remote_mutation")})
    pin(config)
    gate = gate_host(config)

    # The SDK's pay has an output schema, now offered: the gate's own answers on it come as
    # errors, which the host's SDK does not validate against it.
    first = expect(gate.call("bank_pay", KIM), "PENDING_APPROVAL", is_error=True)
    approval = approval_in(first)
    assert server.payments() == 0
    approve(config, run_in_hint(gate.stderr_text(), approval), approval)
    assert server.payments() == 0  # an approval never executes by itself

    text, error = said(gate.call("bank_pay", KIM))
    assert not error and "paid 3 to kim" in text, text
    assert server.payments() == 1
    expect(gate.call("bank_pay", KIM), "DUPLICATE")
    assert server.payments() == 1


def test_a_server_that_dies_mid_call_leaves_the_outcome_unknown(workdir, sdk_server):
    server = sdk_server()
    dying = {**KIM, "mode": "die"}
    config = config_for(workdir, server.url, {**READS, "pay": rule("remote_mutation", outcome="allow")})
    pin(config)
    gate = gate_host(config)

    # an error: pay has an output schema, which the gate's own answers cannot meet
    text = expect(gate.call("bank_pay", dying), "UNKNOWN_OUTCOME", is_error=True)
    assert "may have" in text and "connection was lost before the server answered" in text, text
    assert server.payments() == 1  # it executed, then the server died before answering
    pending = only_pending(workdir)
    assert pending["kind"] == "interrupted_side_effect"
    assert pending["capability"]["interrupted"]["ended"] == "no_answer"
    assert approval_in(text) == pending["id"]

    # The host's blind retry does not pay again, and nothing else that pays runs meanwhile.
    again = expect(gate.call("bank_pay", dying), "UNKNOWN_OUTCOME", is_error=True)
    assert approval_in(again) == pending["id"]
    expect(gate.call("bank_pay", {"to": "lou", "amount": 1}), "BLOCKED", is_error=True)
    assert server.payments() == 1

    # The session is gone: a read fails at once, naming the server, and is no unknown outcome.
    text, error = said(gate.call("bank_balance", {"account": "A-1"}))
    assert error and 'server "bank"' in text and not text.startswith("UNKNOWN_OUTCOME"), text
    assert not has_raw_controls(text)


def test_a_server_that_stopped_listening_executes_nothing(workdir, sdk_server):
    server = sdk_server()
    config = config_for(workdir, server.url, {**READS, "pay": rule("remote_mutation", outcome="allow")})
    pin(config)
    gate = gate_host(config)
    gate.list_tools()
    server.kill()

    text, error = said(gate.call("bank_pay", KIM))
    assert error and not text.startswith("UNKNOWN_OUTCOME"), text
    assert "cannot reach" in text and "nothing was sent" in text, text
    assert server.payments() == 0 and approvals(workdir) == []


def test_nothing_listening_fails_pin_and_check_saying_nothing_was_sent(workdir):
    config = config_for(workdir, f"http://127.0.0.1:{free_port()}/mcp", {})
    reached = 'server "bank": connect: cannot reach http://127.0.0.1:'
    one_line_error(run_agentgate("pin", "-config", str(config)), reached, "nothing was sent")
    assert not (workdir / "bank.manifest.json").exists()
    write_private(workdir / "bank.manifest.json", json.dumps({"server": "bank", "tools": {}}))
    one_line_error(check(config), reached, "nothing was sent")


PAY_TOOLS = '[{"name":"pay","description":"Pay someone.","inputSchema":{"type":"object","properties":' \
            '{"to":{"type":"string"},"amount":{"type":"number"}},"required":["to","amount"]}}]'


def scripted_mcp(on_call):
    """An answer function for ScriptedHTTP: initialize and tools/list (PAY_TOOLS) in JSON bodies,
    tools/call handed to `on_call(handler, message)`."""

    def answer(handler, message):
        if message["method"] == "initialize":
            return send_body(handler, json.dumps(initialize_result(message["id"])).encode())
        if message["method"] == "tools/list":
            return send_body(handler, list_answer(PAY_TOOLS, message["id"]))
        if message["method"] == "tools/call":
            return on_call(handler, message)
        send_body(handler, json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {}}).encode())

    return answer


def test_a_payment_that_outlives_its_timeout_is_unknown_and_closing_does_not_wait(workdir, scripted_http):
    server = scripted_http(scripted_mcp(lambda handler, message: server.release.wait(DEADLINE)))
    config = config_for(workdir, server.url, {"pay": rule("remote_mutation", timeout="2s", outcome="allow")})
    pin(config)
    gate = gate_host(config)

    text = expect(gate.call("bank_pay", KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert "timed out" in text and "may have" in text, text
    assert only_pending(workdir)["capability"]["interrupted"]["ended"] == "timed_out"
    calls = wait_for(lambda: [m for _, m in server.requests if m and m.get("method") == "tools/call"],
                     DEADLINE, message="the call at the server")
    assert len(calls) == 1 and calls[0]["params"] == {"name": "pay", "arguments": KIM}
    wait_for(lambda: any(m and m.get("method") == "notifications/cancelled" and
                         m["params"]["requestId"] == calls[0]["id"] for _, m in server.requests),
             DEADLINE, message="the cancel notice for the timed-out call")
    # The server never answers: the gate still ends when the host goes (Host.close fails the
    # test by its own deadline otherwise).
    gate.close()


def test_a_request_from_the_server_inside_an_answer_is_answered(workdir, scripted_http):
    answered = threading.Event()

    def on_call(handler, message):
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        ping = {"jsonrpc": "2.0", "id": "srv-1", "method": "ping"}
        handler.wfile.write(b"event: message\ndata: " + json.dumps(ping).encode() + b"\n\n")
        handler.wfile.flush()
        # The result follows only once agentgate has answered the ping (on another POST).
        assert answered.wait(DEADLINE)
        result = {"jsonrpc": "2.0", "id": message["id"],
                  "result": {"content": [{"type": "text", "text": "paid after the ping"}]}}
        handler.wfile.write(b"data: " + json.dumps(result).encode() + b"\n\n")
        handler.close_connection = True

    def answer(handler, message):
        if "method" not in message:  # an answer from agentgate
            if message.get("id") == "srv-1" and message.get("result") == {}:
                answered.set()
            handler.send_response(202)
            handler.end_headers()
            return
        scripted_mcp(on_call)(handler, message)

    server = scripted_http(answer)
    config = config_for(workdir, server.url, {"pay": rule("remote_mutation", outcome="allow")})
    pin(config)
    gate = gate_host(config)
    text, error = said(gate.call("bank_pay", KIM))
    assert not error and "paid after the ping" in text, text
    assert answered.is_set()


# ---------------------------------------------------------------- what the transport refuses


@pytest.mark.parametrize("where", ["another-host", "same-origin"])
def test_a_redirect_is_not_followed(workdir, scripted_http, where):
    elsewhere = scripted_http(lambda handler, message: send_body(handler, json.dumps(initialize_result(message["id"])).encode()))

    def redirect(handler, message):
        target = elsewhere.url if where == "another-host" else "/elsewhere"
        handler.send_response(307)
        handler.send_header("Location", target)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = scripted_http(redirect)
    config = config_for(workdir, server.url)
    done = run_agentgate("pin", "-config", str(config))
    one_line_error(done, 'server "bank": connect:', "redirect (HTTP 307)", "not followed")
    assert elsewhere.requests == []
    assert [path for path, _ in server.requests] == ["/mcp"]


def test_an_answer_past_the_message_cap_fails_the_pin(workdir, scripted_http):
    def answer(handler, message):
        if message["method"] == "initialize":
            return send_body(handler, json.dumps(initialize_result(message["id"])).encode())
        description = "d" * agentgate.MAX_MESSAGE_BYTES
        tools = json.dumps([{"name": "big", "description": description, "inputSchema": {"type": "object"}}])
        send_body(handler, list_answer(tools, message["id"]))

    server = scripted_http(answer)
    done = run_agentgate("pin", "-config", str(config_for(workdir, server.url)))
    one_line_error(done, 'server "bank": list tools:', f"larger than {agentgate.MAX_MESSAGE_BYTES} bytes")


def test_connect_timeout_bounds_an_initialize_that_never_answers(workdir, scripted_http):
    server = scripted_http(lambda handler, message: server.release.wait(DEADLINE))
    config = config_for(workdir, server.url, connect_timeout="3s")
    done = run_agentgate("pin", "-config", str(config))
    one_line_error(done, 'server "bank": connect: timed out after 3s')
    # Only the initialize was a request (the cancel notice after it may or may not arrive
    # before agentgate exits).
    assert [m["method"] for _, m in server.requests if m and "id" in m] == ["initialize"]


EVENT_SHAPES = {
    # CRLF line ends, a named event with an id.
    "crlf-named": lambda body: b"event: message\r\nid: 1\r\ndata: " + body + b"\r\n\r\n",
    # A comment, then the message split across two data lines.
    "split-data": lambda body: b": ping\ndata: " + body[:body.index(b'"id"')] + b"\ndata: "
                               + body[body.index(b'"id"'):] + b"\n\n",
    # An event of another name first (the SDK ignores it), then a padded name.
    "other-event": lambda body: b"event: other\ndata: " + list_answer(OTHER_TOOLS, 2) + b"\n\n"
                                + b"event:  message \ndata: " + body + b"\n\n",
    # Lines ended by a bare CR.
    "cr-only": lambda body: b"event: message\rdata: " + body + b"\r\r",
    # The stream ends inside the event.
    "unterminated": lambda body: b"data: " + body,
}


@pytest.mark.parametrize("shape", list(EVENT_SHAPES))
def test_event_stream_answers_are_read_from_their_bytes(workdir, scripted_http, shape):
    def answer(handler, message):
        if message["method"] == "initialize":
            return send_body(handler, json.dumps(initialize_result(message["id"])).encode())
        body = EVENT_SHAPES[shape](list_answer(REAL_TOOLS, message["id"]))
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for i in range(len(body)):  # one byte at a time: events split anywhere
            handler.wfile.write(body[i:i + 1])
        handler.close_connection = True

    server = scripted_http(answer)
    config = config_for(workdir, server.url, {})
    pin(config)
    manifest = (workdir / "bank.manifest.json").read_text()
    assert list(json.loads(manifest)["tools"]) == ["real"]
    assert '"maximum": 1.10' in manifest


def test_events_split_anywhere_read_the_same():
    body = list_answer(REAL_TOOLS, 7)
    for shape in EVENT_SHAPES.values():
        stream = shape(body)
        whole = agentgate._EventStream().feed(stream, final=True)
        reader, bytewise = agentgate._EventStream(), []
        for i in range(len(stream)):
            bytewise += reader.feed(stream[i:i + 1])
        bytewise += reader.feed(b"", final=True)
        assert whole == bytewise and len(whole) == 1
        assert agentgate.canonical(agentgate.parse(whole[0])) == agentgate.canonical(agentgate.parse(body))


def test_closing_is_idempotent_and_a_later_request_fails_at_once_unsent(workdir, sdk_server):
    server = sdk_server()
    config = agentgate.load_config(str(config_for(workdir, server.url)))
    upstream, live = agentgate.connect(config.servers[0])
    assert sorted(live) == ["balance", "limits", "pay", "rewrite", "whoami"]
    upstream.close()
    upstream.close()
    wait_for(lambda: upstream.connections == set(), DEADLINE, message="every connection to end")
    with pytest.raises(agentgate.UpstreamError) as failed:
        upstream.request("tools/call", {"name": "pay", "arguments": KIM},
                         agentgate.Deadline(30 * agentgate.SECOND), 'tool "pay"')
    assert failed.value.outcome == "not_sent" and 'server "bank"' in str(failed.value)
    assert server.payments() == 0


def test_a_change_of_tools_announced_on_a_calls_stream_is_acted_on(workdir, sdk_server):
    server = sdk_server()
    config = config_for(workdir, server.url, rules={**READS, "rewrite": rule("read_only")})
    assert pin(config).returncode == 0
    gate = gate_host(config)
    assert {t.name for t in gate.list_tools()} == {"bank_balance", "bank_limits", "bank_whoami", "bank_rewrite",
                                                   "gate_status"}
    text, error = said(gate.call("bank_rewrite", {}))
    assert not error and "rewritten" in text, text
    wait_for(lambda: {t.name for t in gate.list_tools()} == {"bank_limits", "bank_rewrite", "gate_status"},
             DEADLINE, message="the host to be told balance changed and whoami is gone")
    text, error = said(gate.call("bank_balance", {"account": "A-1"}))
    assert error and text.startswith("DENIED:"), text
    # Held before it is said: the log line may follow the withdrawal.
    wait_for(lambda: "changed balance; removed whoami; not offered now: bank_balance, bank_whoami"
             in gate.stderr_text(), DEADLINE)
