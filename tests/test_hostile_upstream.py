"""agentgate against a hostile upstream: answers with ids no request has, requests sent after the
server broke its own input, a server that stops reading, floods, a 50 MB line, a JSON-RPC error
answer, a server that exits mid-call.

The upstream is tests/hostile_server.py (one process per server entry, configured by a spec
file); agentgate is driven as a host drives it, through the SDK host (`Host`) or over raw
JSON-RPC lines (`RawStdio`) where a test must see every response or close the gate's stdin.

The contract these tests hold the gate to:
1. one bad frame never ends the upstream reader: after an answer with a hostile id the call still
   gets its real answer, later calls are answered and the gate lives; an id of N.9 is not
   request N's answer;
2. a server request that cannot be answered (the server closed its stdin) does not stop the
   reader;
3. a server that stops reading cannot hang a call whose request does not fit in the pipe: the
   call is answered after its timeout as an unknown outcome, the server is killed, a second call
   queued behind it is answered as not sent, and the gate still exits when the host closes stdin;
4. a ping flood from a server that stopped reading cannot hang a call or the gate's exit;
5. a notification flood is passed over;
6. a 50 MB line is skipped without holding it in memory, and only its own top-level id counts;
7. a JSON-RPC error answer is a known failure, not an unknown outcome that blocks the tool;
8. a server that exits mid-call leaves an unknown outcome and a gate that goes on serving.
Every host request gets exactly one answer.
"""

from __future__ import annotations

import collections
import sys
from contextlib import suppress
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError

from conftest import RawStdio, pid_alive, wait_for
from kit import (
    close_peers,
    cmdline,
    gate_host,
    live_pids,
    pin,
    raw_gate,
    reap_leftovers,
    records,
    response,
    response_text,
    rule,
    said,
    send_call,
    tool,
    unread_input,
    upstream_pids,
    write_config,
    write_spec,
)

HOSTILE = Path(__file__).resolve().parent / "hostile_server.py"
REAL = "the real answer"
WRONG = '{"content":[{"type":"text","text":"WRONG: an answer to no request of the gate"}]}'
MiB = 1024 * 1024
PIPE_OVERFLOW = 1_000_000  # bytes of argument: far more than a pipe buffer (64 KiB)


def mutating(timeout: str) -> dict:
    """A remote_mutation rule the policy allows without asking."""
    return rule("remote_mutation", timeout=timeout, outcome="allow")


def hostile_server(workdir, name: str, spec: dict, rules: dict) -> dict:
    """A config entry for tests/hostile_server.py with `spec` (written to <workdir>/<name>.spec.json)."""
    spec_path = write_spec(Path(workdir) / f"{name}.spec.json", spec)
    return {"name": name, "command": [sys.executable, str(HOSTILE), str(spec_path)],
            "manifest": f"{name}.manifest.json", "rules": rules}


def pinned(workdir, *servers) -> Path:
    config = write_config(workdir, list(servers))
    pin(config)
    return config


def hostile_pids(workdir) -> list[int]:
    """Live hostile servers started for this test (their spec files are in its workdir)."""
    mark = str(workdir)
    return live_pids(lambda pid: "hostile_server.py" in (line := cmdline(pid)) and mark in line)


@pytest.fixture
def hostiles(workdir):
    """The test's workdir; afterwards every gate is closed and no hostile server of the test
    may still run (a leftover is killed, then reported)."""
    yield workdir
    close_peers()
    left = reap_leftovers(lambda: hostile_pids(workdir), "this test's hostile servers", 120)
    assert not left, f"hostile servers outlived the test: {left}"


def close_and_count(raw: RawStdio, answered: list) -> collections.Counter:
    """Close the gate's stdin, wait for it to exit (60 s) and count the responses per id: those
    the test already took (`answered`), those skipped on the way, and whatever came after."""
    raw.proc.stdin.close()
    raw.wait(60)
    rest = list(raw.skipped)
    while True:
        try:
            rest.append(raw.recv(30))
        except EOFError:
            break
    ids = list(answered) + [m.get("id") for m in rest if "method" not in m]
    return collections.Counter(ids)


# ---------------------------------------------------------------- 1. hostile answer ids

HOSTILE_FRAMES = {
    "Infinity": '{"jsonrpc":"2.0","id":Infinity,"result":%s}' % WRONG,
    "minus-Infinity": '{"jsonrpc":"2.0","id":-Infinity,"result":%s}' % WRONG,
    "NaN": '{"jsonrpc":"2.0","id":NaN,"result":%s}' % WRONG,
    "1e1000000": '{"jsonrpc":"2.0","id":1e1000000,"result":%s}' % WRONG,
    "1e400": '{"jsonrpc":"2.0","id":1e400,"result":%s}' % WRONG,
    "a-string": '{"jsonrpc":"2.0","id":"{ID}","result":%s}' % WRONG,
    "nested-in-an-object": '{"jsonrpc":"2.0","x":{"id":{ID}},"result":%s}' % WRONG,
    "30-digits": '{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":%s}' % WRONG,
}


@pytest.mark.parametrize("frame", list(HOSTILE_FRAMES.values()), ids=list(HOSTILE_FRAMES))
def test_an_answer_with_a_hostile_id_does_not_stop_the_reader(hostiles, frame):
    workdir = hostiles
    spec = {"tools": [tool("look"), tool("ok")],
            "calls": {"look": {"before": [frame], "text": REAL}, "ok": {"text": "second answer"}}}
    # 10s bounds the old gate's failure (a dead or stalled reader); a working one answers at once.
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"look": rule("read_only", "10s"),
                                                                 "ok": rule("read_only", "10s")}))
    with gate_host(config, timeout=90) as host:
        assert said(host.call("h_look", {"q": 1})) == (REAL, False)
        assert said(host.call("h_ok", {})) == ("second answer", False)
        assert said(host.call("h_look", {"q": 2})) == (REAL, False)
        assert pid_alive(host.pid)


def test_an_answer_id_of_the_request_id_plus_0_9_is_not_that_requests_answer(hostiles):
    workdir = hostiles
    frame = '{"jsonrpc":"2.0","id":{ID}.9,"result":%s}' % WRONG
    spec = {"tools": [tool("look"), tool("ok")],
            "calls": {"look": {"before": [frame], "text": REAL}, "ok": {"text": "second answer"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"look": rule("read_only", "10s"),
                                                                 "ok": rule("read_only", "10s")}))
    with gate_host(config, timeout=90) as host:
        text, error = said(host.call("h_look", {}))
        assert "WRONG" not in text
        assert (text, error) == (REAL, False)
        assert said(host.call("h_ok", {})) == ("second answer", False)
        assert pid_alive(host.pid)


# ---------------------------------------------------------------- 2. a server request after stdin broke


def test_a_server_request_after_the_servers_stdin_closed_does_not_stop_the_reader(hostiles):
    workdir = hostiles
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("pay")], "record": str(record),
            "calls": {"pay": {"close_stdin_then_ping": True, "text": "paid after the ping"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("20s")}))
    with gate_host(config, timeout=90) as host:
        text, error = said(host.call("h_pay", {"to": "kim"}))
        assert not text.startswith("UNKNOWN_OUTCOME"), text
        assert (text, error) == ("paid after the ping", False)
        assert pid_alive(host.pid)
    assert len(records(record)) == 1


# ---------------------------------------------------------------- 3. a server that stops reading


def test_a_server_that_stops_reading_cannot_hang_a_call_or_the_gates_exit(hostiles):
    workdir = hostiles
    spec = {"tools": [tool("pay"), tool("refund")], "deaf_after_list": True}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("3s"),
                                                                 "refund": mutating("3s")}))
    raw = raw_gate(config)
    server = upstream_pids(raw.pid, "hostile_server.py")[0]

    send_call(raw, 10, "h_pay", {"to": "kim", "memo": "m" * PIPE_OVERFLOW})

    def first_is_stuck():
        # The server's stdin pipe holds a good part of the call and the server reads nothing:
        # the rest of the call cannot be written. (A gate that already killed it is past that.)
        with suppress(OSError):
            return not pid_alive(server) or unread_input(server) >= 32 * 1024
        return not pid_alive(server)

    wait_for(first_is_stuck, 60, message="the gate to be stuck writing the first call")
    send_call(raw, 11, "h_refund", {"to": "lou"})

    first = response(raw, 10, 60)
    assert response_text(first).startswith("UNKNOWN_OUTCOME:"), first
    second = response(raw, 11, 60)
    assert "result" in second, second
    assert not response_text(second).startswith("UNKNOWN_OUTCOME"), second
    wait_for(lambda: not pid_alive(server), 60, message="the deaf server to be killed")

    counts = close_and_count(raw, [1, 2, 10, 11])
    assert counts == {1: 1, 2: 1, 10: 1, 11: 1}, counts


# ---------------------------------------------------------------- 4. a ping flood


def test_a_ping_flood_from_a_server_that_stopped_reading_cannot_hang_a_call_or_the_gates_exit(hostiles):
    workdir = hostiles
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("pay")], "record": str(record), "calls": {"pay": {"flood_pings": 20000}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("3s")}))
    raw = raw_gate(config)

    send_call(raw, 10, "h_pay", {"to": "kim"})
    reply = response(raw, 10, 60)
    assert "result" in reply or "error" in reply, reply
    assert len(records(record)) == 1

    counts = close_and_count(raw, [1, 2, 10])
    assert counts == {1: 1, 2: 1, 10: 1}, counts


# ---------------------------------------------------------------- 5. a notification flood


def test_a_notification_flood_then_an_answer_gets_the_answer(hostiles):
    workdir = hostiles
    spec = {"tools": [tool("pay"), tool("ok")],
            "calls": {"pay": {"flood_notifications": 10000, "text": "paid after the flood"},
                      "ok": {"text": "second answer"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("60s"),
                                                                 "ok": rule("read_only", "60s")}))
    with gate_host(config, timeout=120) as host:
        assert said(host.call("h_pay", {"to": "kim"})) == ("paid after the flood", False)
        assert said(host.call("h_ok", {})) == ("second answer", False)
        assert pid_alive(host.pid)


# ---------------------------------------------------------------- 6. a 50 MB line


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


@pytest.mark.parametrize("kind", ["garbage", "answer", "nested"])
def test_a_50_mb_line_is_skipped_and_the_gate_answers(hostiles, kind):
    """garbage: a 50 MB line of garbage, then the call's answer. answer: a valid-looking 50 MB
    answer with the call's id (that call fails as too large), then the call's answer (dropped).
    nested: a valid-looking 50 MB answer whose only id is nested in an object before the result
    (it answers no request), then the call's answer."""
    workdir = hostiles
    spec = {"tools": [tool("look"), tool("ok")],
            "calls": {"look": {"big": {"bytes": 50 * MiB, "kind": kind}, "text": REAL},
                      "ok": {"text": "second answer"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"look": rule("read_only", "60s"),
                                                                 "ok": rule("read_only", "60s")}))
    with gate_host(config, timeout=120) as host:
        text, error = said(host.call("h_look", {}))
        if kind == "answer":
            assert error and "larger than 16777216 bytes" in text, text
            assert len(text) < 2000
        else:
            assert (text, error) == (REAL, False)
        assert said(host.call("h_ok", {})) == ("second answer", False)
        assert pid_alive(host.pid)
        assert peak_rss_kib(host.pid) < 200 * 1024


# ---------------------------------------------------------------- 7. a JSON-RPC error answer


def test_a_json_rpc_error_answer_is_a_known_failure_that_does_not_block_the_tool(hostiles):
    workdir = hostiles
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("pay")], "record": str(record),
            "calls": {"pay": [{"rpc_error": {"code": -32000, "message": "card declined"}},
                              {"text": "paid"}]}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("20s")}))
    with gate_host(config, timeout=90) as host:
        # Passed to the host as the server sent it (SPEC "A gate that is invisible when it
        # allows"), and a known failure: the next call is not blocked.
        with pytest.raises(MCPError) as caught:
            host.call("h_pay", {"to": "kim", "amount": 7})
        assert (caught.value.error.code, caught.value.error.message) == (-32000, "card declined")

        text, error = said(host.call("h_pay", {"to": "lou", "amount": 1}))
        assert not text.startswith("BLOCKED"), text
        assert (text, error) == ("paid", False)
    assert [entry["arguments"]["to"] for entry in records(record)] == ["kim", "lou"]


# ---------------------------------------------------------------- 8. a server that exits mid-call


def test_a_server_that_exits_mid_call_leaves_an_unknown_outcome_and_a_live_gate(hostiles):
    workdir = hostiles
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("pay")], "record": str(record), "calls": {"pay": {"exit": 3}}}
    other = {"tools": [tool("ok")], "calls": {"ok": {"text": "still here"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {"pay": mutating("30s")}),
                    hostile_server(workdir, "g", other, {"ok": rule("read_only", "30s")}))
    with gate_host(config, timeout=90) as host:
        text, error = said(host.call("h_pay", {"to": "kim"}))
        assert text.startswith("UNKNOWN_OUTCOME:"), text
        assert len(records(record)) == 1
        assert said(host.call("g_ok", {})) == ("still here", False)
        assert pid_alive(host.pid)
