"""The 2026-07-28 revision to the host (issue 31, item 1; SPEC "The 2026-07-28 revision and
Tasks, on the host side"), on the wire as a host of that revision writes it: every request
carries its `_meta` envelope and there is no handshake.

The era is the first request's: `server/discover` or an enveloped request opens the new one,
and a discover is answered without starting a server or opening the database, so a host may
probe from a process it ends at once. A refused envelope chooses no era. Every result carries
`resultType`; lists carry caching hints; the handshake's methods are not found; each request's
client info names the host for `client` conditions; `subscriptions/listen` carries a changed
tool list, tagged with its subscription, and nothing the host did not ask for.
"""

import json
import signal

import pytest

from conftest import RawStdio, agentgate_argv, children, wait_for
from kit import (DEADLINE, PAY, approvals, approve, bank, db_path, fake_banks, payments, pin, rule,
                 scripted_server, tool, write_config)

META = "io.modelcontextprotocol/"
MODERN = "2026-07-28"
TASKS = {"extensions": {META + "tasks": {}}}


def envelope(name: str | None = "modern-host", capabilities: dict | None = None) -> dict:
    meta = {META + "protocolVersion": MODERN, META + "clientCapabilities": capabilities or {}}
    if name is not None:
        meta[META + "clientInfo"] = {"name": name, "version": "1"}
    return meta


def ask(raw: RawStdio, method: str, params: dict | None = None, timeout: float = DEADLINE,
        **who) -> dict:
    """A request of the new revision: `params` with the envelope (`who`: envelope's args)."""
    params = dict(params or {})
    params["_meta"] = {**envelope(**who), **params.get("_meta", {})}
    return raw.request(method, params, timeout=timeout)


def gate(config) -> RawStdio:
    return RawStdio(agentgate_argv("-config", str(config)))


def test_a_discover_probe_starts_no_server_and_leaves_nothing_behind(workdir):
    config = bank(workdir)
    database = db_path(workdir)
    for ending in ("stdin closed", "SIGKILL"):
        with gate(config) as raw:
            discovered = ask(raw, "server/discover")["result"]
            assert discovered["supportedVersions"] == [MODERN]
            assert discovered["capabilities"]["extensions"] == {META + "tasks": {}}
            assert discovered["ttlMs"] == 0 and discovered["cacheScope"] == "private"
            assert children(raw.pid) == [] and fake_banks(workdir) == []
            assert not database.exists()  # nothing opened either
            if ending == "SIGKILL":
                raw.kill(signal.SIGKILL)
                assert raw.wait(DEADLINE) == -signal.SIGKILL
            else:
                raw.proc.stdin.close()
                assert raw.wait(DEADLINE) == 0
        assert fake_banks(workdir) == [] and not database.exists()
    # The same process serves once a request needs its servers.
    with gate(config) as raw:
        ask(raw, "server/discover")
        listed = ask(raw, "tools/list")["result"]
        assert [t["name"] for t in listed["tools"]] == ["bank_balance", "bank_pay", "bank_refund",
                                                        "gate_status"]
        assert fake_banks(workdir) and database.exists()


@pytest.mark.parametrize("meta, code, missing", [
    (None, -32602, "protocolVersion"),
    ({META + "clientCapabilities": {}}, -32602, "protocolVersion"),
    ({META + "protocolVersion": MODERN}, -32602, "clientCapabilities"),
    ({META + "protocolVersion": MODERN, META + "clientCapabilities": []}, -32602,
     "clientCapabilities"),
])
def test_an_envelope_missing_a_field_is_invalid_params_and_the_session_goes_on(
        workdir, meta, code, missing):
    config = bank(workdir)
    with gate(config) as raw:
        params = {} if meta is None else {"_meta": meta}
        refused = raw.request("server/discover", params, id="probe-1")
        assert refused["id"] == "probe-1" and refused["error"]["code"] == code, refused
        assert META + missing in refused["error"]["message"]
        # Refused, it chose no era: a handshake still opens, as a host that falls back does.
        assert raw.initialize()["result"]["serverInfo"]["name"] == "gated-tools"


def test_an_unsupported_version_names_the_supported_one_and_client_info_is_optional(workdir):
    config = bank(workdir)
    with gate(config) as raw:
        asked = {**envelope(), META + "protocolVersion": "v999.0.0"}
        refused = raw.request("server/discover", {"_meta": asked}, id=301)
        assert refused["id"] == 301
        assert refused["error"]["code"] == -32022
        assert refused["error"]["data"] == {"supported": [MODERN], "requested": "v999.0.0"}
        served = ask(raw, "server/discover", name=None)
        assert served["result"]["supportedVersions"] == [MODERN]


def test_the_handshakes_methods_and_unknown_ones_are_not_found_in_the_new_era(workdir):
    config = bank(workdir)
    with gate(config) as raw:
        ask(raw, "server/discover")
        for method in ("initialize", "ping", "logging/setLevel", "resources/subscribe",
                       "unknown/method", "tasks/result", "tasks/list"):
            refused = ask(raw, method, capabilities=TASKS)
            assert refused["error"]["code"] == -32601, (method, refused)
        assert raw.skipped == []


def test_every_result_carries_its_type_and_a_list_its_caching_hints(workdir):
    config = bank(workdir)
    with gate(config) as raw:
        listed = ask(raw, "tools/list")["result"]
        assert listed["resultType"] == "complete"
        assert listed["ttlMs"] == 0 and listed["cacheScope"] == "private"
        called = ask(raw, "tools/call", {"name": "bank_balance", "arguments": {"account": "A-1"}})
        result = called["result"]
        assert result["resultType"] == "complete"
        assert result["content"] == [{"type": "text", "text": "account A-1 holds 120.00 EUR"}]
        status = ask(raw, "tools/call", {"name": "gate_status", "arguments": {}})["result"]
        assert status["resultType"] == "complete"
        assert status["content"][0]["text"].startswith("GATE_STATUS:")
    # The handshake era is as it was: no resultType.
    with gate(config) as raw:
        raw.initialize()
        plain = raw.request("tools/list", {}, timeout=DEADLINE)["result"]
        assert "resultType" not in plain and "ttlMs" not in plain


def test_each_requests_client_info_is_the_host_name_the_policy_reads(workdir):
    rules = {"pay": {"when": [{"client": ["trusted-host"], "outcome": "allow",
                               "reason": "the trusted host pays"}]}}
    config = bank(workdir, rules=rules)
    ledger = workdir / "ledger"
    with gate(config) as raw:
        paid = ask(raw, "tools/call", {"name": PAY, "arguments": {"to": "a", "amount": 1}},
                   name="trusted-host")["result"]
        assert paid["content"][0]["text"] == "paid 1.00 to a"
        # One connection, another host name: the policy hears this request's.
        held = ask(raw, "tools/call", {"name": PAY, "arguments": {"to": "b", "amount": 2}},
                   name="another-host")["result"]
        assert held["content"][0]["text"].startswith("PENDING_APPROVAL:"), held
        assert payments(ledger) == 1


CHANGES = {"poke": {"text": "poked", "notify_list_changed": 1}}


def test_a_listen_stream_is_told_of_a_changed_tool_list_and_of_nothing_unasked(workdir):
    tools = workdir / "tools.json"
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools.write_text(json.dumps([tool("read_file", schema, "Read a file."), tool("poke", schema)]))
    spec = {"tools_from": str(tools), "calls": CHANGES}
    rules = {"read_file": rule("read_only"), "poke": rule("read_only")}
    config = write_config(workdir, [scripted_server(workdir, spec, rules=rules)])
    assert pin(config).returncode == 0
    with gate(config) as raw:
        ask(raw, "tools/list")
        raw.send({"jsonrpc": "2.0", "id": "tools-stream", "method": "subscriptions/listen",
                  "params": {"notifications": {"toolsListChanged": True}, "_meta": envelope()}})
        raw.send({"jsonrpc": "2.0", "id": "prompts-stream", "method": "subscriptions/listen",
                  "params": {"notifications": {"promptsListChanged": True}, "_meta": envelope()}})
        acks = [raw.recv(DEADLINE), raw.recv(DEADLINE)]
        assert [a["method"] for a in acks] == ["notifications/subscriptions/acknowledged"] * 2
        tagged = {a["params"]["_meta"][META + "subscriptionId"]: a["params"] for a in acks}
        assert tagged["tools-stream"]["notifications"] == {"toolsListChanged": True}
        assert tagged["prompts-stream"]["notifications"] == {}  # the gate offers no prompts
        tools.write_text(json.dumps([tool("read_file", schema, "Read a file. Changed."),
                                     tool("poke", schema)]))
        poked = ask(raw, "tools/call", {"name": "fs_poke", "arguments": {}})
        assert poked["result"]["content"][0]["text"] == "poked"

        def told():
            return [m for m in raw.skipped if m.get("method") == "notifications/tools/list_changed"]
        wait_for(lambda: told() or raw.skipped.append(raw.recv(DEADLINE)), DEADLINE,
                 message="the listen stream to be told the tool list changed")
        assert [m["params"]["_meta"][META + "subscriptionId"] for m in told()] == ["tools-stream"]
        listed = ask(raw, "tools/list")["result"]["tools"]
        assert [t["name"] for t in listed] == ["fs_poke", "gate_status"]
        # A cancelled stream is told nothing more, and answered nothing.
        raw.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": "tools-stream"}})
        assert not [m for m in raw.skipped if m.get("id") in ("tools-stream", "prompts-stream")]


def test_each_requests_client_info_picks_the_hosts_hold(workdir):
    config = bank(workdir, hold={"patient-host": "60s", "*": "0s"})
    ledger = workdir / "ledger"
    with gate(config) as raw:
        hurried = ask(raw, "tools/call", {"name": PAY, "arguments": {"to": "b", "amount": 2}},
                      name="hurried-host")["result"]
        assert hurried["content"][0]["text"].startswith("PENDING_APPROVAL:"), hurried
        raw.send({"jsonrpc": "2.0", "id": "patient", "method": "tools/call",
                  "params": {"name": PAY, "arguments": {"to": "a", "amount": 1},
                             "_meta": envelope("patient-host")}})
        waiting = wait_for(lambda: [a for a in approvals(workdir, "pending")
                                    if a["run_id"] != hurried_run(workdir)], DEADLINE,
                           message="the patient host's call to wait")
        approve(config, waiting[0]["run_id"], waiting[0]["id"])
        paid = raw.response("patient", DEADLINE)["result"]  # held, then answered
        assert paid["content"][0]["text"] == "paid 1.00 to a"
        assert payments(ledger) == 1


def hurried_run(workdir) -> str:
    """The run of the first payment asked (the hurried host's)."""
    return approvals(workdir)[0]["run_id"]
