"""The record, compact (issue 22): what one transaction changes in a run is chained as one event,
so a call is recorded as one event when it begins and one when it ends, carrying what the six and
the two events of earlier versions carried; verify, show and recheck read it with the same meaning.

A database of the previous version (tests/v4_database.sql.gz, schema version 4, made by the agentgate
of commit fd9a2b1 in front of the fake bank: a read, a payment approved and executed, one
rejected, one refused as invalid, and one approved whose re-run timed out, its outcome unknown and
a question pending) migrates in place, and its events, in the old shapes, read as they did.
"""

import json
import re
from pathlib import Path

from kit import Bank, database_from_dump, operator, schema_versions, settle_old_unknown
from kit import bankdir  # noqa: F401 (fixture)

DUMP = Path(__file__).resolve().parent / "v4_database.sql.gz"
BEGAN = ["run.created", "run.started", "step.started", "step.decided", "step.policy", "step.tool_started"]
ENDED = ["step.tool_finished", "run.finished"]


def stored(bank, run_id: str) -> list:
    """(type, step_id, payload) of a run's events as stored, in seq order."""
    return [(t, s, json.loads(p)) for t, s, p in bank.query(
        "SELECT type, step_id, payload_json FROM events WHERE run_id=? ORDER BY seq", (run_id,))]


def shown_events(bank, run_id: str) -> list:
    """(type, step_id, payload) of the events `show -json` lists for a run."""
    return [(e["type"], e["step_id"], e["payload"]) for e in bank.show(run_id)["events"]]


def test_an_allowed_call_is_one_event_when_it_begins_and_one_when_it_ends(bankdir):
    bank = Bank(bankdir, rules={"pay": {"outcome": "allow"}})
    host = bank.start()
    assert bank.call(host, {"to": "kim", "amount": 3}).text == "paid 3.00 to kim"
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text.startswith("account A-1")
    pay_run, read_run = [r for (r,) in bank.query("SELECT id FROM runs ORDER BY rowid")]

    began, ended = stored(bank, pay_run)
    assert (began[0], ended[0]) == ("call.began", "call.ended")
    assert [p[0] for p in began[2]["parts"]] == BEGAN
    assert [p[0] for p in ended[2]["parts"]] == ENDED
    (step_id,) = [s for (s,) in bank.query("SELECT id FROM steps WHERE run_id=?", (pay_run,))]
    assert began[1] == ended[1] == step_id
    # The parts carry what the separate events did: the request, the policy with its identity
    # and spec, the execution, and what it came to.
    parts = {p[0]: p for p in began[2]["parts"] + ended[2]["parts"]}
    assert parts["step.decided"][2]["args"] == {"to": "kim", "amount": 3}
    assert parts["step.policy"][2]["outcome"] == "allow" and parts["step.policy"][2]["policy_id"]
    assert parts["step.tool_started"][2]["tool"] == "bank_pay"
    assert parts["step.tool_finished"][2]["summary"] and parts["run.finished"][2]["status"] == "COMPLETED"
    assert all(p[1] == step_id for p in began[2]["parts"][2:] + ended[2]["parts"][:1])
    assert [t for t, _, _ in stored(bank, read_run)] == ["run.read"]

    # show prints the two events whole, as chained, and in its JSON lists each part as an event
    # of its own; runs names the host; the chain verifies.
    text = operator(bank.config, "show", pay_run).stdout
    assert re.findall(r"^ +\d+  \S+  (\S+)$", text, re.M) == ["call.began", "call.ended"], text
    assert [e[0] for e in shown_events(bank, pay_run)] == BEGAN + ENDED
    assert [e[2] for e in shown_events(bank, pay_run)] == [p[2] for p in began[2]["parts"] + ended[2]["parts"]]
    assert {r["run"]: r["host"] for r in bank.runs_json()}[pay_run] != ""
    assert "intact: 3 event(s)" in operator(bank.config, "verify").stdout
    rechecked = json.loads(operator(bank.config, "recheck", "-json").stdout)
    assert [r["same"] for r in rechecked] == [True, True]


def test_a_version_4_database_migrates_and_its_old_events_read_as_they_did(bankdir):
    path = database_from_dump(bankdir, DUMP)
    bank = Bank(bankdir, rules={"pay": {"timeout": "2s"}}, session="old4", hold="0s")
    assert bank.db_path == path and schema_versions(path) == [1, 2, 3, 4]
    old_runs = [r for (r,) in bank.query("SELECT id FROM runs ORDER BY rowid")]
    old_events = {run: stored(bank, run) for run in old_runs}
    head = bank.query("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")[0]
    assert not any(t.startswith("call.") for events in old_events.values() for t, _, _ in events)

    host = bank.start()
    host.list_tools()
    assert schema_versions(path) == [1, 2, 3, 4, 5, 6, 7]
    assert f"intact: {head[0]} event(s), seq 1 to {head[0]}" in operator(bank.config, "verify").stdout

    # Every reader reads the old shapes as they are: show lists each stored event, runs the
    # hosts, recheck finds every decision the same, and an approval's execution is seen.
    listed = {r["run"]: r for r in bank.runs_json()}
    assert sorted(listed[r]["status"] for r in old_runs) == \
        ["CANCELLED", "COMPLETED", "COMPLETED", "FAILED", "WAITING_FOR_APPROVAL"]
    for run in old_runs:
        assert shown_events(bank, run) == old_events[run]
        text = operator(bank.config, "show", run).stdout
        assert f"run       {run}" in text and all(t in text for t, _, _ in old_events[run])
    assert {listed[r]["host"] for r in old_runs if listed[r]["status"] != "FAILED"} != {""}
    rechecked = json.loads(operator(bank.config, "recheck", "-json").stdout)
    assert rechecked and all(r["same"] for r in rechecked)

    # The unknown outcome it left still blocks, and its re-run, approved now, is recorded in
    # the new shape after the old events of its run; the chain goes on from the old head.
    unknown = settle_old_unknown(bank, host, bankdir, {r: listed[r] for r in old_runs})
    events = stored(bank, unknown)
    assert events[:len(old_events[unknown])] == old_events[unknown]
    assert [t for t, _, _ in events[len(old_events[unknown]):]] == ["approval.decided", "call.changed",
                                                                      "call.ended"]
    assert [e[0] for e in shown_events(bank, unknown)][len(old_events[unknown]):] == [
        "approval.decided", "run.resumed", "step.policy", "step.tool_started", "step.tool_finished",
        "run.finished"]
    verified = operator(bank.config, "verify").stdout
    assert "intact:" in verified and f"seq 1 to {head[0]}" not in verified
    assert all(r["same"] for r in json.loads(operator(bank.config, "recheck", "-json").stdout))


def test_an_approved_call_is_seen_executed_from_the_event_that_resumed_it(bankdir):
    bank = Bank(bankdir)
    host = bank.start()
    pay = {"to": "ann", "amount": 2}
    run, approval = bank.pending(bank.call(host, pay))
    bank.approve(run, approval)
    assert bank.call(host, pay).text == "paid 2.00 to ann"
    assert [t for t, _, _ in stored(bank, run)] == ["call.began", "approval.decided", "call.changed",
                                                    "call.ended"]
    told = bank.call(host, {"approval_id": approval}, tool="gate_status")
    assert "APPROVED and executed, and it succeeded." in told.text, told
