"""A server's JSON-RPC error reaches the host as that error, and a tool listed without a
description is offered without one (issue 28, item 17).

Specification: SPEC "A gate that is invisible when it allows": a JSON-RPC error answer passes
to the host as that JSON-RPC error (its code, message and data), and it is a known failure,
recorded as such; a tool listed without a description is offered without one.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kit import (all_runs, gate_host, raw_gate, records, rule, said, steps,  # noqa: E402
                 db_path, tool)
from test_hostile_upstream import hostile_server, hostiles, mutating, pinned  # noqa: E402,F401

# A message no prose would keep as it is: a line separator, a quote, and past 1,000 bytes.
MESSAGE = "card declined\u2028\"by the bank\" " + "x" * 3000
DATA = {"retry": False, "codes": [51, 2.50], "note": "\u202eevil"}


def test_a_json_rpc_error_reaches_the_host_as_the_server_sent_it(hostiles):
    workdir = hostiles
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("pay")], "record": str(record), "calls": {"pay": [
        {"rpc_error": {"code": -32042, "message": MESSAGE, "data": DATA}},
        {"rpc_error": {"code": 7, "message": "again"}}, {"text": "paid"}]}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("20s")}))
    with gate_host(config, timeout=90) as host:
        with pytest.raises(MCPError) as caught:
            host.call("h_pay", {"to": "kim"})
        error = caught.value.error
        assert (error.code, error.message, error.data) == (-32042, MESSAGE, DATA)
        # A known failure: the tool is not blocked as after an unknown outcome.
        with pytest.raises(MCPError) as caught:
            host.call("h_pay", {"to": "lou"})
        assert (caught.value.error.code, caught.value.error.message) == (7, "again")
        assert caught.value.error.data is None
        assert said(host.call("h_pay", {"to": "max"})) == ("paid", False)
    assert len(records(record)) == 3
    first = all_runs(workdir)[0]
    assert first["status"] == "FAILED", first
    observation = next(o for _, _, _, o in steps(db_path(workdir), first["id"]) if o)
    assert observation["kind"] == "tool_error", observation
    kept = observation["content"]["rpc_error"]   # what the host was given, by size and hash
    assert re.fullmatch(r"\[\d{4} bytes, sha256 [0-9a-f]{64}\]", kept), observation


def test_an_error_past_the_result_cap_or_malformed_is_told_as_text(hostiles):
    workdir = hostiles
    spec = {"tools": [tool("look")], "calls": {"look": [
        {"rpc_error": {"code": -32000, "message": "y" * 5000}},
        {"rpc_error": {"code": "E1", "message": "a code that is no integer"}}]}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"look": rule("read_only")}))
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_result_bytes": 1024}))
    with gate_host(config, timeout=90) as host:
        text, error = said(host.call("h_look", {"n": 1}))
        assert error and "the server answered with an error: yyy" in text, text
        text, error = said(host.call("h_look", {"n": 2}))
        assert error and "a code that is no integer" in text, text


def test_a_tool_listed_without_a_description_is_offered_without_one(hostiles):
    workdir = hostiles
    bare = {"name": "bare", "inputSchema": {"type": "object"}}
    spec = {"tools": [bare, tool("told", description="Told.")]}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {
        "bare": rule("read_only"), "told": rule("read_only")}))
    with raw_gate(config) as raw:
        listed = {t["name"]: t for t in raw.request("tools/list", {}, 1)["result"]["tools"]}
    assert "description" not in listed["h_bare"], listed["h_bare"]
    assert listed["h_told"]["description"] == "Told."
    with gate_host(config, timeout=90) as host:
        offered = {t.name: t for t in host.list_tools()}
    assert offered["h_bare"].description is None
