"""The edges of the upstream side (issue 19, items 3, 4 and 10 over stdio).

- Item 3: an HTTP status of 500 or more after a request was sent is an unknown outcome for a
  tool that changes something (a proxy's 504 after the server paid, a server's 500 whatever
  its body says): the model is told UNKNOWN_OUTCOME, and a retry after the repeat window does
  not pay again. A read answered so stays an error: a read has no effect to be unsure of.
- Item 4: a url is shown as its scheme, host and port only, in every text a server's url can
  reach (the model's answer, `show`, pin, check, init and stderr), so a key carried in its
  path or query is never shown.
- Item 10: a change of tools announced right after the start-up listing is acted on; a
  listing after an announcement that fails quarantines the server's tools until a listing
  succeeds, retried with backoff; a call held for approval whose tool is quarantined
  meanwhile does not run when it is approved.

The HTTP servers are the hand-shaped ScriptedHTTP of test_http_upstream (a standard-library
server in the test); the stdio ones are tests/scripted_server.py. agentgate is driven as a
host drives it, through the SDK's stdio client, and by its operator commands.
"""

from __future__ import annotations

import json

import pytest

from conftest import wait_for
from kit import (
    DEADLINE,
    agentgate,
    approvals,
    approval_in,
    expect,
    gate_host,
    only_pending,
    pin,
    rule,
    said,
    wait_until_past,
)
from test_http_upstream import KIM, config_for, scripted_http, scripted_mcp, send_body  # noqa: F401


# ---------------------------------------------------------------- item 3: 5xx after sending


def paying_then_failing(status: int, paid: list):
    """A tools/call handler that pays, then answers `status`: a proxy's HTML page for a 502 or
    504, the server's own JSON-RPC error for this very request for a 500."""

    def on_call(handler, message):
        paid.append(message["params"]["arguments"])
        if status == 500:
            body = json.dumps({"jsonrpc": "2.0", "id": message["id"],
                               "error": {"code": -32603, "message": "internal error"}}).encode()
            return send_body(handler, body, status=status)
        send_body(handler, b"<html><body>504 Gateway Time-out</body></html>", "text/html", status)

    return on_call


@pytest.mark.parametrize("status", [504, 500])
def test_a_payment_answered_5xx_is_unknown_and_a_retry_after_the_window_pays_once(
        workdir, scripted_http, status):
    paid: list = []
    server = scripted_http(scripted_mcp(paying_then_failing(status, paid)))
    config = config_for(workdir, server.url,
                        {"pay": rule("remote_mutation", outcome="allow", repeat_window="1s")})
    pin(config)
    gate = gate_host(config)

    text = expect(gate.call("bank_pay", KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert f"HTTP {status}" in text and "may have" in text, text
    pending = only_pending(workdir)
    assert pending["kind"] == "interrupted_side_effect" and approval_in(text) == pending["id"]
    assert len(paid) == 1

    # The host's retry once the repeat window is over: still the operator's question, no payment.
    wait_until_past(pending["created_at"], 1.0, "the repeat window")
    again = expect(gate.call("bank_pay", KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert approval_in(again) == pending["id"]
    assert len(paid) == 1, paid


def test_a_read_answered_5xx_stays_an_error(workdir, scripted_http):
    paid: list = []
    server = scripted_http(scripted_mcp(paying_then_failing(504, paid)))
    config = config_for(workdir, server.url, {"pay": rule("read_only")})
    pin(config)
    gate = gate_host(config)
    text, error = said(gate.call("bank_pay", KIM))
    assert error and "HTTP 504" in text and not text.startswith("UNKNOWN_OUTCOME"), text
    assert approvals(workdir) == []


def test_a_4xx_stays_a_known_failure(workdir, scripted_http):
    server = scripted_http(scripted_mcp(lambda handler, message: send_body(
        handler, b"forbidden", "text/plain", 403)))
    config = config_for(workdir, server.url, {"pay": rule("remote_mutation", outcome="allow")})
    pin(config)
    gate = gate_host(config)
    text, error = said(gate.call("bank_pay", KIM))
    assert error and "HTTP 403" in text and not text.startswith("UNKNOWN_OUTCOME"), text
    assert approvals(workdir) == []


# ---------------------------------------------------------------- item 4: a url's secret


SECRET_KEY = "k3y-5e5ame-0pen"
SECRET_PATH = "p4th-0f-the-key"


def secret_url(url: str) -> str:
    """The test server's url with a key in its path and in its query, as hosted servers have."""
    return url.replace("/mcp", f"/mcp/{SECRET_PATH}/") + f"?api_key={SECRET_KEY}"


def shows_no_secret(text: str, origin: str) -> None:
    assert SECRET_KEY not in text and SECRET_PATH not in text and "api_key" not in text, text
    assert origin in text, f"{origin} not in {text}"


def test_an_unreachable_url_is_shown_as_scheme_host_and_port_only(workdir, scripted_http):
    server = scripted_http(scripted_mcp(lambda handler, message: None))
    url = secret_url(server.url)
    origin = server.url.removesuffix("/mcp")
    config = config_for(workdir, url, {"pay": rule("remote_mutation", outcome="allow")})
    pin(config)
    assert server.requests and server.requests[0][0] == f"/mcp/{SECRET_PATH}/?api_key={SECRET_KEY}"
    gate = gate_host(config)
    gate.list_tools()
    server.close()  # nothing listens there any more

    text, error = said(gate.call("bank_pay", KIM))
    assert error and "cannot reach" in text, text
    shows_no_secret(text, origin)
    run_id = only_run(workdir)
    for args in (["show", run_id], ["show", run_id, "-json"], ["runs"]):
        done = agentgate(*args, "-config", str(config))
        assert done.returncode == 0, done
        shows_no_secret(done.stdout + done.stderr, origin if args[0] == "show" else "")
    gate.close()
    shows_no_secret(gate.stderr_text(), "")

    # A gate, pin and check that start with nothing listening there say so on stderr.
    for command in ("serve", "pin", "check"):
        done = agentgate(command, "-config", str(config))
        assert done.returncode == 1 and "cannot reach" in done.stderr, done
        shows_no_secret(done.stdout + done.stderr, origin)
    host_file = workdir / "host.json"
    host_file.write_text(json.dumps({"mcpServers": {"bank": {"url": url}}}))
    done = agentgate("init", "-from", str(host_file), "-config", str(workdir / "init" / "config.json"))
    assert done.returncode == 1 and "could not be pinned" in done.stdout, done
    shows_no_secret(done.stdout + done.stderr, origin)


def test_a_redirect_is_shown_as_scheme_host_and_port_only(workdir, scripted_http):
    def redirect(handler, message):
        handler.send_response(307)
        handler.send_header("Location", f"/mcp/{SECRET_PATH}/?api_key={SECRET_KEY}")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = scripted_http(redirect)
    done = agentgate("pin", "-config", str(config_for(workdir, server.url)))
    assert done.returncode == 1 and "redirect (HTTP 307)" in done.stderr, done
    shows_no_secret(done.stderr, server.url.removesuffix("/mcp"))


def only_run(workdir) -> str:
    from kit import all_runs
    runs = all_runs(workdir)
    assert len(runs) == 1, runs
    return runs[0]["id"]
