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
import re

import pytest

import agentgate as agentgate_module

from conftest import RawStdio, agentgate_argv, wait_for
from kit import (
    DEADLINE,
    agentgate,
    all_runs,
    approvals,
    approval_in,
    approve,
    expect,
    gate_host,
    only_pending,
    pin,
    records,
    rule,
    said,
    scripted_server,
    wait_until_past,
    write_config,
    write_private,
)
from test_http_upstream import KIM, config_for, scripted_http, scripted_mcp, send_body  # noqa: F401
from test_list_changed import ALL, CHANGED, PINNED, Changing, names


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

    # A gate, pin and check that start with nothing listening there say so on stderr. The gate
    # serves on without that server (the status tool alone) until its host closes stdin; it
    # starts its servers once its host's first request needs them.
    for command in ("pin", "check"):
        done = agentgate(command, "-config", str(config))
        assert done.returncode == 1, done
        assert "cannot reach" in done.stderr, done
        shows_no_secret(done.stdout + done.stderr, origin)
    with RawStdio(agentgate_argv("serve", "-config", str(config))) as serving:
        assert serving.initialize()["result"]["serverInfo"]["name"] == "gated-tools"
        serving.proc.stdin.close()
        assert serving.wait(DEADLINE) == 0
        assert "cannot reach" in serving.stderr_text(), serving.stderr_text()
        shows_no_secret(serving.stderr_text(), origin)
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
    runs = all_runs(workdir)
    assert len(runs) == 1, runs
    return runs[0]["id"]


# ---------------------------------------------------------------- item 10: a server that changes its tools (stdio)


def no_program_named(text: str) -> None:
    assert not re.search(r"agentgate|\bpin\b|check|approve|\.db\b|config", text), text


RULES = {"read_file": rule("read_only"), "write_file": rule("local_mutation"), "stat": rule("read_only"),
         "slow": rule("read_only", "30s"), "poke": rule("read_only")}


def test_a_change_announced_right_after_the_start_up_listing_is_acted_on(workdir):
    # The gate's own first listing gets what was pinned; the notice follows it at once, before
    # the gate has finished loading, and every later listing gets the change.
    spec = {"pages": [{"tools": PINNED}, {"tools": CHANGED}], "notify_after_list": True}
    config = write_config(workdir, [scripted_server(workdir, spec, rules=RULES)])
    assert pin(config).returncode == 0
    host = gate_host(config)
    wait_for(lambda: names(host) == {"fs_slow", "fs_poke", "gate_status"}, DEADLINE,
             message="the changed tools to be taken off the offer")
    denied = host.call_text("fs_read_file", {"path": "/x"})
    assert denied.startswith("DENIED:") and "differently" in denied, denied
    no_program_named(denied)
    # Held before it is said: the log line may follow the withdrawal.
    wait_for(lambda: "changed read_file, write_file" in host.stderr_text(), DEADLINE)


def test_a_failed_listing_quarantines_the_servers_tools_until_a_listing_succeeds(workdir):
    server = Changing(workdir)
    host = gate_host(server.config)
    assert names(host) == ALL
    server.present(PINNED + [PINNED[0]])  # a tool listed twice: no listing can be used
    before = server.lists()
    assert host.call_text("fs_poke", {}) == "poked"
    wait_for(lambda: names(host) == {"gate_status"}, DEADLINE,
             message="every tool of the server to be taken off the offer")
    denied = host.call_text("fs_read_file", {"path": "/x"})
    assert denied.startswith("DENIED:") and "could not be asked how" in denied, denied
    no_program_named(denied)
    wait_for(lambda: "listing them again failed" in host.stderr_text(), DEADLINE)

    # Tried again with no new notice: once a listing succeeds, what it shows is offered.
    server.present(PINNED)
    wait_for(lambda: names(host) == ALL, DEADLINE, message="the tools to be offered again")
    assert server.lists() >= before + 2
    assert host.call_text("fs_read_file", {"path": "/x"}) == "called read_file"
    # Offered again before it is said: the log line may follow.
    wait_for(lambda: "its tools were listed again" in host.stderr_text(), DEADLINE)
    log = host.stderr_text()
    assert "next try in 4s" in log and "server fs: its tools were listed again; not offered now: none" in log, log


def test_a_failing_listing_is_tried_again_less_and_less_often_up_to_a_bound():
    waits = [agentgate_module.relist_wait(n) for n in (0, 1, 2, 3, 4, 5, 6, 10**6)]
    assert waits == [2, 4, 8, 16, 32, 60, 60, 60]


def test_a_call_held_for_approval_does_not_run_when_its_tool_was_quarantined_meanwhile(workdir):
    server = Changing(workdir)
    config = server.config
    raw = json.loads(config.read_text())
    raw["hold"] = "60s"  # the call waits in the gate for its approval
    raw["servers"][0]["rules"]["write_file"] = rule("remote_mutation")
    write_private(config, json.dumps(raw))
    host = gate_host(config)
    held = host.submit("fs_write_file", {"path": "/x"})
    wait_for(lambda: "decide with:" in host.stderr_text(), DEADLINE, message="the approval to wait")
    waiting = only_pending(workdir)

    server.present(CHANGED)  # write_file's schema changed
    assert host.call_text("fs_poke", {}) == "poked"
    wait_for(lambda: "not offered now: fs_read_file, fs_stat, fs_write_file" in host.stderr_text(),
             DEADLINE, message="write_file to be quarantined")
    approve(config, waiting["run_id"], waiting["id"])
    text, error = said(held.result())
    assert error and text.startswith("DENIED:") and "differently" in text, text
    no_program_named(text)
    assert [r for r in records(server.record) if r.get("call") == "write_file"] == []

    # The approval stays: once the tool is back to what was reviewed, the call collects it.
    server.present(PINNED)
    assert host.call_text("fs_poke", {}) == "poked"
    wait_for(lambda: "fs_write_file" in names(host), DEADLINE, message="write_file offered again")
    assert host.call_text("fs_write_file", {"path": "/x"}) == "called write_file"
    assert len([r for r in records(server.record) if r.get("call") == "write_file"]) == 1
