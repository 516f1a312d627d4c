"""agentgate as the host's MCP server: handshake, framing, tools/list, errors, and shutdown.

Driven with the official SDK client (auto and legacy modes) and with RawStdio, which reads
every stdout line and fails on anything that is not JSON.

Ported from the reference suite (agentrt-tests.md) and behaviour section 11:
- proxy_test.go TestProxy_ListsOnlyClassifiedToolsAndTheStatusTool -> test_tools_list_*.
- behaviour 11: protocol version negotiation, ping, unknown tool -32602, serverInfo
  "gated-tools"; SPEC: stdout carries only protocol, framing on \n.
- the promises of agentgate's "The host side": the first request answered at once even while the upstream
  servers start, server/discover -32601, a malformed or oversized line answered with an error
  and the session going on, batches only under the protocol versions that have them.
- behaviour 12.2 (Pdeathsig, close kills the group): a host that kills agentgate leaves no
  upstream process.
N/A: the SDK-snapshot stateless 2026-07-28 revision (later work, per SPEC).
"""

import json
import signal

import pytest

from conftest import RawStdio, agentgate_argv, pid_alive
from kit import (
    bank,
    gate_host,
    pin,
    reap,
    result_text,
    rule,
    scripted_server,
    tool,
    upstream_pids,
    wait_gone,
    write_config,
)

VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]


def raw_gate(config) -> RawStdio:
    return RawStdio(agentgate_argv("-config", str(config)))


def is_jsonrpc(message) -> bool:
    """A JSON-RPC 2.0 response, request or notification (or a batch of them)."""
    if isinstance(message, list):
        return bool(message) and all(is_jsonrpc(m) for m in message)
    return isinstance(message, dict) and message.get("jsonrpc") == "2.0" and (
        "method" in message or ("id" in message and (("result" in message) != ("error" in message))))


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_the_sdk_host_connects_and_calls(workdir, mode):
    config = bank(workdir)
    with gate_host(config, mode=mode) as host:
        assert host.client.server_info.name == "gated-tools"
        assert [t.name for t in host.list_tools()] == ["bank_balance", "bank_pay", "bank_refund", "gate_status"]
        result = host.call("bank_balance", {"account": "A-1"})
        assert not result.is_error
        assert result_text(result) == "account A-1 holds 120.00 EUR"


def test_a_discover_without_its_envelope_is_refused_at_once_and_initialize_still_opens(workdir):
    # A host that falls back to the handshake after a refused probe (issue 31) finds the
    # handshake era still open: the refusal chose no era.
    release = workdir / "release"
    spec = {"tools": [tool("a")], "initialize_after": str(release)}
    config = write_config(workdir, [scripted_server(workdir, spec, rules={"a": rule("read_only")})])
    release.touch()
    pin(config)
    release.unlink()  # from here on the upstream answers initialize only once this file exists
    with raw_gate(config) as raw:
        raw.send({"jsonrpc": "2.0", "id": "d-1", "method": "server/discover", "params": {}})
        first = raw.recv(60)
        assert first["id"] == "d-1" and first["error"]["code"] == -32602
        init = raw.initialize("2025-06-18")
        assert init["result"]["protocolVersion"] == "2025-06-18"
        assert raw.request("ping", {})["result"] == {}
        release.touch()
        tools = raw.request("tools/list", {}, timeout=60)["result"]["tools"]
        assert [t["name"] for t in tools] == ["fs_a", "gate_status"]
        assert raw.skipped == []


@pytest.mark.parametrize("version", [*VERSIONS, "2099-01-01"])
def test_protocol_version_negotiation(workdir, version):
    config = bank(workdir)
    with raw_gate(config) as raw:
        reply = raw.initialize(version)
        result = reply["result"]
        assert result["protocolVersion"] == (version if version in VERSIONS else "2025-11-25")
        assert result["serverInfo"]["name"] == "gated-tools"
        assert "tools" in result["capabilities"]
        assert raw.request("ping")["result"] == {}
        assert raw.skipped == []


def test_tools_list_offers_only_classified_tools_as_the_rules_say(workdir):
    rules = {"refund": None,
             "balance": {"description": "The operator's own words for balance."},
             "pay": {"fixed": {"currency": "EUR"}, "deny": ["mode"]}}
    config = bank(workdir, rules=rules)
    with raw_gate(config) as raw:
        raw.initialize()
        tools = raw.request("tools/list", {}, timeout=60)["result"]["tools"]
    assert [t["name"] for t in tools] == ["bank_balance", "bank_pay", "gate_status"]
    balance, pay, status = tools
    # each as pinned (SPEC, "A gate that is invisible when it allows"): the fake bank presents
    # annotations and nothing else beside name, description and inputSchema
    assert balance["annotations"] == {"readOnlyHint": True}
    assert pay["annotations"] == {"destructiveHint": False}
    for entry in tools:
        assert set(entry) <= {"name", "description", "inputSchema", "annotations"}, entry
    assert balance["description"] == "The operator's own words for balance."
    assert pay["description"] == "Pay an amount to someone."
    assert set(pay["inputSchema"]["properties"]) == {"to", "amount"}
    assert pay["inputSchema"]["required"] == ["to", "amount"]
    assert "currency" not in json.dumps(pay["inputSchema"]) and "mode" not in json.dumps(pay["inputSchema"])
    assert status["inputSchema"]["type"] == "object"

    with gate_host(config) as host:
        listed = host.list_tools()
        assert [t.name for t in listed] == ["bank_balance", "bank_pay", "gate_status"]
        assert all(t.output_schema is None for t in listed)


def test_an_unknown_tool_is_a_jsonrpc_error(workdir):
    config = bank(workdir)
    with raw_gate(config) as raw:
        raw.initialize()
        reply = raw.request("tools/call", {"name": "refund", "arguments": {"payment": "p"}}, timeout=60)
        assert reply["error"]["code"] == -32602
        assert '"refund"' in reply["error"]["message"]
        assert "result" not in reply
        reply = raw.request("tools/call", {"name": "bank_balance", "arguments": {"account": "B"}}, timeout=60)
        assert reply["result"]["content"][0]["text"] == "account B holds 120.00 EUR"


def test_a_malformed_line_is_answered_and_the_session_goes_on(workdir):
    config = bank(workdir)
    with raw_gate(config) as raw:
        raw.initialize()
        raw.send(b'{"jsonrpc":"2.0","id":5,"method":"ping"')  # cut short
        reply = raw.recv(60)
        assert reply["error"]["code"] == -32700
        raw.send(b"\xff\xfe not even text")
        assert raw.recv(60)["error"]["code"] == -32700
        assert raw.request("ping")["result"] == {}
        reply = raw.request("tools/call", {"name": "bank_balance", "arguments": {"account": "C"}}, timeout=60)
        assert reply["result"]["content"][0]["text"] == "account C holds 120.00 EUR"


def test_a_line_larger_than_16_mib_is_refused_and_the_session_goes_on(workdir):
    config = bank(workdir)
    with raw_gate(config) as raw:
        raw.initialize()
        pad = "x" * (16 * 1024 * 1024 + 1024)
        raw.send(('{"jsonrpc":"2.0","id":77,"method":"ping","params":{"pad":"' + pad + '"}}').encode())
        reply = raw.recv(60)
        assert reply["id"] == 77 and "error" in reply
        assert reply["error"]["code"] in (-32600, -32700)
        assert raw.request("ping")["result"] == {}


def test_batches_only_where_the_protocol_has_them(workdir):
    config = bank(workdir)
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "ping"}, {"jsonrpc": "2.0", "id": 2, "method": "ping"},
             {"jsonrpc": "2.0", "method": "notifications/initialized"}]
    with raw_gate(config) as raw:
        raw.initialize("2025-06-18")
        raw.send(json.dumps(batch).encode())
        reply = raw.recv(60)
        assert isinstance(reply, dict) and reply["id"] is None and reply["error"]["code"] == -32600
        assert raw.request("ping")["result"] == {}
    with raw_gate(config) as raw:
        raw.initialize("2025-03-26")
        raw.send(json.dumps(batch).encode())
        reply = raw.recv(60)
        assert isinstance(reply, list)
        assert sorted(r["id"] for r in reply) == [1, 2]
        assert all(r["result"] == {} for r in reply)


def test_stdout_carries_only_protocol(workdir):
    spec = {"tools": [tool("a"), tool("b")], "stderr": "upstream noise on stderr\n",
            "garbage": ["upstream noise on stdout", "{}"], "calls": {"b": {"error": "nope"}}}
    config = write_config(workdir, [scripted_server(workdir, spec, rules={"a": rule("read_only"),
                                                                          "b": rule("remote_mutation")})])
    pin(config)
    seen = []
    with raw_gate(config) as raw:
        seen.append(raw.initialize())
        seen.append(raw.request("tools/list", {}, timeout=60))
        seen.append(raw.request("tools/call", {"name": "fs_a", "arguments": {}}, timeout=60))
        seen.append(raw.request("tools/call", {"name": "fs_b", "arguments": {}}, timeout=60))  # pending
        seen.append(raw.request("tools/call", {"name": "fs_a", "arguments": []}, timeout=60))  # invalid
        seen.append(raw.request("tools/call", {"name": "nope"}, timeout=60))
        seen.append(raw.request("gate/unknown", {}))
        raw.send(b"garbage")
        seen.append(raw.recv(60))
        raw.proc.stdin.close()
        while True:  # everything up to EOF must parse (recv raises on a non-JSON line)
            try:
                seen.append(raw.recv(60))
            except EOFError:
                break
        seen.extend(raw.skipped)
        assert raw.wait(60) == 0
        assert "upstream noise on stderr" not in json.dumps(seen)
    assert len(seen) >= 8
    for message in seen:
        assert is_jsonrpc(message), message
    assert "upstream noise on stdout" not in json.dumps(seen)


@pytest.mark.parametrize("when", ["at start", "after serving"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_gate_leaves_no_upstream_process(workdir, when, sig):
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    upstream = []
    try:
        with raw_gate(config) as raw:
            raw.initialize()  # servers start once a request needs them
            upstream = upstream_pids(raw.pid, "fake-payments")
            if when == "after serving":
                reply = raw.request("tools/call", {"name": "bank_pay", "arguments": {"to": "a", "amount": 1}},
                                    timeout=60)
                assert reply["result"]["content"][0]["text"] == "paid 1.00 to a"
            assert all(pid_alive(p) for p in upstream)
            raw.kill(sig)
            raw.wait(60)
            wait_gone(upstream, 30)
    finally:
        reap(upstream)


def test_a_host_that_closes_leaves_no_upstream_process(workdir):
    config = bank(workdir)
    host = gate_host(config)
    upstream = []
    try:
        host.list_tools()  # servers start once a request needs them
        upstream = upstream_pids(host.pid, "fake-payments")
        assert host.call_text("bank_balance", {"account": "x"}) == "account x holds 120.00 EUR"
        host.close()
        wait_gone(upstream, 30)
    finally:
        host.close()
        reap(upstream)


def test_a_gate_whose_tools_cannot_load_serves_the_status_tool_saying_why(workdir):
    # Issue 20: a server that registers nothing no longer stops the gate; with no other server,
    # the status tool alone is offered, and stderr says why the server is not served.
    config = write_config(workdir, [scripted_server(workdir, {"tools": [tool("a")]}, rules={})])
    pin(config)
    with raw_gate(config) as raw:
        listed = raw.request("tools/list", {}, timeout=60)
        assert [t["name"] for t in listed["result"]["tools"]] == ["gate_status"], listed
        assert "no tool registered" in raw.stderr_text()
