"""A gate that is invisible when it allows (SPEC): a call's progress both ways, and each tool
offered as the server presented it at the pin.

Progress: the host's progressToken reaches the server (as a token of the gate's own for that
call), and the server's notifications/progress reach the host under the host's token, only
increasing, after what the host heard while the gate held the call; a server's message is
sanitized, and progress on a token the gate did not give is dropped.

Tool metadata: tools/list offers title, description, inputSchema, outputSchema, annotations,
icons and _meta as pinned; a change in any of them since the pin is a change (load, pin -diff);
a manifest pinned before agentgate kept them still loads, and is not reported as changed.
"""

from __future__ import annotations

import decimal
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import Host, everything_server_argv, wait_for  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    HINT_RE,
    approve,
    gate_host,
    has_raw_controls,
    pin,
    raw_gate,
    records,
    result_text,
    rule,
    scripted_server,
    tool,
    write_config,
)

LONG = "trigger-long-running-operation"


def everything(workdir, rules, **fields):
    """The npm everything server as a config entry, pinned."""
    server = {"name": "every", "command": everything_server_argv(),
              "manifest": "every.manifest.json", "rules": rules, **fields}
    config = write_config(workdir, [server])
    pin(config)
    return config


# ---------------------------------------------------------------- progress


def test_the_servers_progress_reaches_the_sdk_host_under_its_token(workdir):
    config = everything(workdir, {LONG: rule("read_only", "60s")})
    with gate_host(config) as host:
        result = host.call(f"every_{LONG}", {"duration": 0.5, "steps": 5}, progress=True)
        assert not result.is_error, result_text(result)
        # the SDK calls the callback of the token it chose, each in a task of its own
        wait_for(lambda: len(host.progress) == 5, DEADLINE, message="five progress steps")
    assert [(p.progress, p.total) for p in host.progress] == [(i, 5) for i in range(1, 6)]


def progress_server(workdir, steps, **call):
    """The scripted server with one read tool `work` that reports `steps` before answering."""
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("work")], "record": str(record),
            "calls": {"work": {"text": "worked", "progress": steps, **call}}}
    return scripted_server(workdir, spec, rules={"work": rule("read_only")}), record


def notifications(raw, ident):
    """The answer to `ident` and the progress notifications the host was sent before it."""
    answer = raw.response(ident, DEADLINE)
    told = [m["params"] for m in raw.skipped if m.get("method") == "notifications/progress"]
    raw.skipped.clear()
    return answer, told


def test_progress_keeps_the_hosts_token_increases_and_is_sanitized(workdir):
    steps = [{"progress": 1, "total": 4, "message": "step one\x1b[2J\u202e"},
             {"progress": 1, "total": 4, "message": "step one again"},  # not an increase
             {"progressToken": "not-the-gates", "progress": 2},  # a token the gate never gave
             {"progressToken": 999999, "progress": 2},
             {"progress": 2.5, "total": 4},
             {"progress": "three"},  # not a number
             {"progress": 4, "total": 4, "message": "done"}]
    server, record = progress_server(workdir, steps)
    config = write_config(workdir, [server])
    pin(config)
    with raw_gate(config) as raw:
        for ident, token in ((7, "host token"), (8, 42)):
            raw.send({"jsonrpc": "2.0", "id": ident, "method": "tools/call", "params": {
                "name": "fs_work", "arguments": {}, "_meta": {"progressToken": token}}})
            answer, told = notifications(raw, ident)
            assert answer["result"]["content"] == [{"type": "text", "text": "worked"}]
            assert [p["progressToken"] for p in told] == [token] * 3
            assert [(p["progress"], p.get("total")) for p in told] == [(1, 4), (2.5, 4), (4, 4)]
            assert "message" not in told[1] and told[2]["message"] == "done"
            assert told[0]["message"].startswith("step one") and \
                not has_raw_controls(told[0]["message"]), told[0]
        # a call without a token asks the server for none
        raw.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                  "params": {"name": "fs_work", "arguments": {}}})
        answer, told = notifications(raw, 9)
        assert "result" in answer and told == []
    calls = [entry for entry in records(record) if "call" in entry]
    tokens = [entry.get("_meta", {}).get("progressToken") for entry in calls]
    # the server is given a token of the gate's own per call, never the host's
    assert len(tokens) == 3 and tokens[2] is None
    assert all(isinstance(t, int) for t in tokens[:2]) and tokens[0] != tokens[1], tokens


def test_the_servers_progress_follows_the_progress_of_the_hold(workdir):
    server, _ = progress_server(workdir, [{"progress": 1, "total": 2, "message": "half"},
                                          {"progress": 2, "total": 2}])
    server["rules"] = {"work": rule("remote_mutation")}
    config = write_config(workdir, [server], hold="60s")
    pin(config)
    with gate_host(config) as host:
        call = host.submit("fs_work", {}, progress=True)
        run, approval = wait_for(lambda: HINT_RE.findall(host.stderr_text()), DEADLINE,
                                 message="the operator hint")[0]
        wait_for(lambda: call.progress, DEADLINE, message="progress while the call is held")
        approve(config, run, approval)
        result = call.result()
        assert result_text(result) == "worked", result_text(result)
        wait_for(lambda: any(p.message == "half" for p in call.progress), DEADLINE,
                 message="the server's progress")
        wait_for(lambda: len(call.progress) >= 3 and call.progress[-1].message != "half",
                 DEADLINE, message="the server's last progress")
    held = [p for p in call.progress if p.message == "waiting for an operator's approval"]
    after = call.progress[len(held):]
    assert held and len(after) == 2, call.progress
    values = [p.progress for p in call.progress]
    assert values == sorted(values) and len(set(values)) == len(values), values
    base = held[-1].progress
    assert [(round(p.progress - base, 6), round(p.total - base, 6)) for p in after] == \
        [(1, 2), (2, 2)], call.progress


def told_by(steps):
    """What the host is told of one call, given (source, value, total, message) steps."""
    told = []
    progress = agentgate.Progress(lambda *args: told.append(args))
    for source, value, total, message in steps:
        if source == "hold":
            progress.holding(value, total, message)
        else:
            number = agentgate.Number
            progress.server(number(value) if isinstance(value, str) else value,
                            number(total) if isinstance(total, str) else total, message)
    return [(str(v), None if t is None else str(t), m) for v, t, m in told]


def test_progress_values_only_increase_across_the_hold_and_the_server():
    # without a hold the server's own literals pass as they are
    assert told_by([("server", "0", "10", "start\x07"), ("server", "0", None, "again"),
                    ("server", "1.50", "10", None), ("server", "1.5", "10", "same"),
                    ("server", {"three": 3}, None, None), ("server", "2", [], 5)]) == [
        ("0", "10", "start\\x07"), ("1.50", "10", None), ("2", None, None)]
    # after a hold the server's count starts where the hold's ended
    assert told_by([("hold", 1.0, 15.0, "waiting"), ("hold", 2.004, 15.0, "waiting"),
                    ("server", "0", "10", "nothing yet"), ("server", "1.5", "10", "half"),
                    ("server", "1e1", "1E1", None)]) == [
        ("1.0", "15.0", "waiting"), ("2.004", "15.0", "waiting"),
        ("3.504", "12.004", "half"), ("12.004", "12.004", None)]
