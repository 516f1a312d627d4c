"""The second audit's findings that are not about a hostile peer: schemas of odd shapes,
patterns read as ECMA reads them and in bounded time, where servers run, renames and unknown
outcomes, writes interrupted mid-commit, answers that arrive as a wait ends, and the top-level
id of an oversized frame. (The hostile upstream and host, the operator's view and the race
between two gates have files of their own: test_hostile_upstream.py, test_hostile_host.py,
test_operator_hardening.py, test_race_two_gates.py.)
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import wait_for  # noqa: E402
from kit import agentgate as agentgate_command  # noqa: E402
from kit import (  # noqa: E402
    bank_server, check, gate_host, open_db, payments, pin, result_text, rule, scripted_server, tool,
    write_config)


def P(text: str):
    return agentgate.parse(text.encode("utf-8"))


# ---------------------------------------------------------------- item 6: schemas of odd shapes


ODD_SCHEMAS = [
    '{"type":"object","dependencies":"x"}',
    '{"type":"object","dependencies":["a"]}',
    '{"type":"object","dependencies":{"a":[1]}}',
    '{"type":"object","dependentRequired":{"a":"b"}}',
    '{"type":"object","dependentRequired":[]}',
    '{"type":"object","properties":{"xs":{"type":"array","contains":{},"minContains":"2"}}}',
    '{"type":"object","properties":{"xs":{"type":"array","contains":{},"maxContains":-1}}}',
    '{"type":"object","properties":{"a":{"$ref":"#/required"}},"required":["a"]}',
    '{"type":"object","uniqueItems":"yes"}',
    '{"type":"object","properties":{"a":{"type":[]}}}',
    '{"type":"object","properties":{"a":{"type":[1]}}}',
]


@pytest.mark.parametrize("schema", ODD_SCHEMAS)
def test_a_schema_keyword_of_the_wrong_shape_is_refused_at_load(schema):
    assert agentgate.schema_problem(P(schema)) != ""


def test_check_refuses_the_oddly_shaped_tool_with_a_sentence_and_serves_the_rest(workdir):
    tools = [tool(f"odd{i}", json.loads(schema)) for i, schema in enumerate(ODD_SCHEMAS)]
    tools.append(tool("fine", {"type": "object", "properties": {"a": {"type": "string"}}}))
    rules = {entry["name"]: rule("read_only") for entry in tools}
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools}, rules=rules)])
    pin(config)
    done = check(config)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr  # a refused tool fails check
    for i in range(len(ODD_SCHEMAS)):
        assert f"refused odd{i}: the validator refuses its input schema" in done.stdout, done.stdout
    assert "registered fine as fs_fine" in done.stdout


def test_no_exception_from_validation_reaches_the_host(workdir, monkeypatch):
    # A $ref loop is a schema the load check accepts but no value can be checked against.
    looped = agentgate.Tool.__new__(agentgate.Tool)
    looped.schema = P('{"type":"object","$ref":"#/properties/a","properties":{"a":{"$ref":"#/properties/a"}}}')
    looped.rule = agentgate.Rule("t", {"side_effect": "read_only"}, "t")
    assert agentgate.check_arguments(looped, P('{"a":1}')) == "the arguments cannot be checked against the schema"


# ---------------------------------------------------------------- items 4 and 5: patterns


@pytest.mark.parametrize("pattern, text, matches", [
    (r"^\S+$", "a\u00a0b", False),       # \s is Unicode whitespace in ECMA
    (r"^\S+$", "a\ufeffb", False),
    (r"^\S+$", "a\u2003b", False),
    (r"^\S+$", "a\u2029b", False),
    (r"^\s$", "\u00a0", True),
    (r"^.$", "\r", False),                # . stops at every line terminator
    (r"^.$", "\u2028", False),
    (r"^.$", "\u2029", False),
    (r"^.$", "😀", True),                 # one code point, as with the u flag
    (r"^a$", "a\n", False),               # $ is the very end
    (r"^\d+$", "٣", False),               # \d is ASCII
    (r"^\w+$", "é", False),
    (r"\bfoo\b", "a foo b", True),
])
def test_a_pattern_means_what_it_means_in_ecma(pattern, text, matches):
    assert agentgate.compile_pattern(pattern).search(text) is matches


@pytest.mark.parametrize("pattern", [r"a{,2}", r"\Z", r"(a)\1", r"(?=a)", r"(?<=a)b", r"\p{L}", r"a{2,1}",
                                     r"[z-a]", r"(", r"\a"])
def test_a_pattern_ecma_reads_otherwise_or_not_at_all_is_refused(pattern):
    with pytest.raises(agentgate.PatternError):
        agentgate.compile_pattern(pattern)


def test_a_catastrophic_pattern_costs_linear_time_and_stalls_nothing(workdir):
    # ^(a+)+$ doubles its work per character under a backtracking engine: 'a' * 5000 + '!'
    # would hold the interpreter for longer than the universe has existed. Here the call is
    # answered (INVALID) and a read on the same gate is answered too.
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^(a+)+$"}}}
    tools = [tool("named", schema, annotations={"readOnlyHint": True})]
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools},
                                                    rules={"named": rule("read_only")})])
    pin(config)
    with gate_host(config, timeout=60) as host:
        bad = host.call("fs_named", {"name": "a" * 5000 + "!"})
        assert bad.is_error and result_text(bad).startswith("INVALID:"), result_text(bad)
        good = host.call("fs_named", {"name": "a" * 5000})
        assert result_text(good) == "called named"


def test_a_matching_and_a_failing_pattern_are_checked_against_unicode_whitespace(workdir):
    schema = {"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "pattern": r"^\S+$"}}}
    tools = [tool("lookup", schema, annotations={"readOnlyHint": True})]
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools},
                                                    rules={"lookup": rule("read_only")})])
    pin(config)
    with gate_host(config, timeout=60) as host:
        refused = host.call("fs_lookup", {"id": "a\u00a0b"})
        assert result_text(refused).startswith("INVALID:"), result_text(refused)
        assert result_text(host.call("fs_lookup", {"id": "ab"})) == "called lookup"


# ---------------------------------------------------------------- item 9: where servers run


def test_a_server_writing_a_relative_path_writes_in_the_home_not_beside_the_config(workdir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    server = bank_server(workdir, rules={"pay": {"outcome": "allow"}},
                         env=["FAKE_PAYMENTS_LEDGER=relative-ledger"])
    config = write_config(workdir, [server])
    pin(config, env={"HOME": str(home)})
    with gate_host(config, env={"HOME": str(home)}, timeout=60) as host:
        assert result_text(host.call("bank_pay", {"to": "x", "amount": 1})) == "paid 1.00 to x"
    assert payments(home / "relative-ledger") == 1
    assert not (workdir / "relative-ledger").exists()


def test_a_configured_cwd_is_where_the_server_runs(workdir, tmp_path):
    place = tmp_path / "place"
    place.mkdir()
    server = bank_server(workdir, rules={"pay": {"outcome": "allow"}}, cwd=str(place),
                         env=["FAKE_PAYMENTS_LEDGER=relative-ledger"])
    config = write_config(workdir, [server])
    pin(config)
    with gate_host(config, timeout=60) as host:
        host.call("bank_pay", {"to": "x", "amount": 1})
    assert payments(place / "relative-ledger") == 1


# ---------------------------------------------------------------- item 11: a rename keeps what is unknown


def open_gate(config_path):
    config = agentgate.load_config(str(config_path))
    upstreams, tools, _ = agentgate.load_all(config)
    return agentgate.Gate(config, agentgate.Store(config.database), tools), upstreams


def close_gate(gate, upstreams):
    gate.stopping.set()
    for upstream in upstreams:
        upstream.close()
    gate.store.close()


def test_renaming_a_tool_does_not_lift_an_unknown_outcome_or_the_repeat_window(workdir):
    ledger = workdir / "ledger"
    pay = {"outcome": "allow", "timeout": "1s"}
    config = write_config(workdir, [bank_server(workdir, rules={"pay": pay})])
    pin(config)
    gate, upstreams = open_gate(config)
    try:
        stuck = P('{"to":"plumber","amount":180,"mode":"block"}')
        assert gate.call(gate.tools["bank_pay"], stuck).text.startswith("UNKNOWN_OUTCOME:")
        (Path(str(ledger) + ".release")).write_text("")
    finally:
        close_gate(gate, upstreams)
    renamed = write_config(workdir, [bank_server(workdir, rules={"pay": {**pay, "rename": "send_money"}})])
    gate, upstreams = open_gate(renamed)
    try:
        again = gate.call(gate.tools["send_money"], stuck)
        assert again.text.startswith("UNKNOWN_OUTCOME:"), again.text  # still waits on an operator
        assert payments(ledger) == 1
    finally:
        close_gate(gate, upstreams)


def test_renaming_a_tool_does_not_let_a_repeat_through_the_window(workdir):
    refund = {"side_effect": "remote_mutation", "outcome": "allow"}
    config = write_config(workdir, [bank_server(workdir, rules={"refund": refund})])
    pin(config)
    same = P('{"payment":"p-1"}')
    gate, upstreams = open_gate(config)
    try:
        assert gate.call(gate.tools["bank_refund"], same).text == "refunded"
    finally:
        close_gate(gate, upstreams)
    renamed = write_config(workdir, [bank_server(workdir, rules={"refund": {**refund, "rename": "undo"}})])
    gate, upstreams = open_gate(renamed)
    try:
        assert gate.call(gate.tools["undo"], same).text.startswith("DUPLICATE:")
    finally:
        close_gate(gate, upstreams)


# ---------------------------------------------------------------- item 11: the store and the client


def test_a_write_interrupted_mid_commit_fails_every_change_of_its_batch(tmp_path):
    store = agentgate.Store(str(tmp_path / "runs.db"))
    try:
        outcome = {}

        def queued():
            try:
                outcome["result"] = store.write(lambda tx: tx.execute(
                    "INSERT INTO tool_specs(hash, spec_json) VALUES('queued', '{}')"))
            except Exception as err:  # noqa: BLE001 - the test looks at what it was
                outcome["error"] = err

        def interrupted(tx):
            raise KeyboardInterrupt()

        with store.lock:  # this thread commits the next batch: the queued change and its own
            other = threading.Thread(target=queued)
            other.start()
            while not store.jobs:
                threading.Event().wait(0.01)
            with pytest.raises(KeyboardInterrupt):
                store.write(interrupted)
        other.join(30)
        assert isinstance(outcome.get("error"), agentgate.StoreError), outcome
        assert store.read("SELECT count(*) FROM tool_specs")[0][0] == 0
    finally:
        store.close()


def test_an_answer_that_arrives_as_the_wait_ends_is_used(workdir, monkeypatch):
    config = agentgate.load_config(str(write_config(workdir, [bank_server(workdir)])))
    upstream, _ = agentgate.connect(config.servers[0])
    try:
        real_lock = threading.Lock

        class LateLock:
            """A request's wait that times out just before the answer is delivered."""

            def __init__(self):
                self.lock = real_lock()

            def acquire(self, blocking=True, timeout=-1):
                done = self.lock.acquire(blocking, timeout)
                if not done:
                    self.lock.acquire(True, 30)  # the answer lands now, after the wait gave up
                return done

            def release(self):
                self.lock.release()

        monkeypatch.setattr(agentgate.threading, "Lock", LateLock)
        result = upstream.request("tools/call", {"name": "pay", "arguments": {
            "to": "x", "amount": 1, "mode": "slow"}}, agentgate.Deadline(agentgate.SECOND), "tool")
        monkeypatch.setattr(agentgate.threading, "Lock", real_lock)
        assert result["content"][0]["text"] == "paid 1.00 to x"
    finally:
        upstream.close()


@pytest.mark.parametrize("head, ident", [
    (b'{"jsonrpc":"2.0","id":5,"result":{"content":[', 5),
    (b'{"jsonrpc":"2.0","result":{"id":3,"content":[', None),
    (b'{"jsonrpc":"2.0","x":{"id":3},"result":"', None),
    (b'{"jsonrpc":"2.0","x":"\\"id\\":4","id":6,"result":"', 6),
    (b'{"jsonrpc":"2.0","id":3.9,"result":"', None),
    (b'{"jsonrpc":"2.0","id":1e5,"result":"', None),
    (b'[{"id":7,"result":"', None),
])
def test_an_oversized_frame_is_matched_by_its_own_top_level_id_only(head, ident):
    reading = agentgate.FrameId()
    reading.feed(head)
    assert reading.ident == ident


@pytest.mark.parametrize("literal, ident", [
    ("7", 7), ("-1", -1), ("3.9", None), ("3.0", None), ("1e2", None), ("Infinity", None), ("NaN", None),
    ("1e1000000", None), ("9" * 30, None)])
def test_only_an_integer_literal_names_one_of_agentgates_requests(literal, ident):
    assert agentgate.int_id(agentgate.Number(literal)) == ident


# ---------------------------------------------------------------- item 4: a heartbeat nothing can starve


def test_a_live_calls_lease_is_renewed_while_every_other_write_is_stalled(workdir):
    ledger = workdir / "ledger"
    config = write_config(workdir, [bank_server(workdir, rules={"pay": {"outcome": "allow", "timeout": "60s"}})],
                          lease_ttl="3s")
    pin(config)
    gate, upstreams = open_gate(config)
    try:
        answers = []
        caller = threading.Thread(target=lambda: answers.append(gate.call(
            gate.tools["bank_pay"], P('{"to":"x","amount":1,"mode":"block"}'))))
        caller.start()
        wait_for(lambda: payments(ledger) == 1, 60, message="the payment to be executing")
        first = gate.store.read_one("SELECT lease_expires_at FROM runs WHERE status='RUNNING'")[0]
        with gate.store.lock:  # every write of the calls waits: a stalled commit, say
            renewed = wait_for(lambda: gate.store.read_one(
                "SELECT lease_expires_at FROM runs WHERE status='RUNNING'")[0] > first, 30,
                message="the lease to be renewed")
        assert renewed
        Path(str(ledger) + ".release").write_text("")
        caller.join(60)
        assert answers and answers[0].text == "paid 1.00 to x"
    finally:
        close_gate(gate, upstreams)


# ---------------------------------------------------------------- item 15: what one call may bring in


def test_arguments_over_the_cap_are_invalid_and_not_kept(workdir):
    config = write_config(workdir, [bank_server(workdir, rules={"pay": {"outcome": "allow"}})],
                          max_argument_bytes=4096)
    pin(config)
    big = "x" * 200_000
    with gate_host(config, timeout=60) as host:
        refused = host.call("bank_pay", {"to": big, "amount": 1})
        assert refused.is_error and result_text(refused).startswith("INVALID:"), result_text(refused)
        assert "more than the 4096" in result_text(refused)
        assert result_text(host.call("bank_pay", {"to": "x", "amount": 1})) == "paid 1.00 to x"
    assert payments(workdir / "ledger") == 1
    db = open_db(workdir / "runs.db")
    longest = db.execute("SELECT max(length(decision_json)) FROM steps").fetchone()[0]
    longest_event = db.execute("SELECT max(length(payload_json)) FROM events").fetchone()[0]
    db.close()
    assert longest < 1000 and longest_event < 2000, (longest, longest_event)  # not kept


def test_max_argument_bytes_is_checked_at_load(workdir):
    for bad in (10, "1MB", 1.5, 10**12):
        config = write_config(workdir, [bank_server(workdir)], max_argument_bytes=bad)
        done = check(config)
        assert done.returncode == 1 and "max_argument_bytes" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_a_large_argument_of_a_read_is_stored_once(workdir):
    config = write_config(workdir, [bank_server(workdir)])
    pin(config)
    big = "y" * 300_000
    with gate_host(config, timeout=60) as host:
        assert result_text(host.call("bank_balance", {"account": big})).startswith("account y")
    db = open_db(workdir / "runs.db")
    kept = sum(db.execute(f"SELECT coalesce(sum(instr({column}, 'yyyyyyyyyy') > 0), 0) FROM {table}").fetchone()[0]
               for table, column in (("steps", "decision_json"), ("steps", "policy_json"), ("events", "payload_json")))
    db.close()
    assert kept == 1  # the step's decision; the events carry its size and hash (the result is the server's)
    done = agentgate_command("verify", "-config", str(config))
    assert done.returncode == 0 and "intact" in done.stdout, done.stdout
