"""The operator's commands against what a careless or hostile request can put in front of them.

- A value too long to print whole is never decided on a shortened view: approve and reject
  refuse, naming -full, and decide once -full printed it whole.
- A -note or -by that is not UTF-8 is refused with one line naming the flag, nothing decided.
- A run whose lease lapsed while its process was alive (SIGSTOP), taken over by another
  gate, finishes late in the first one: show and approve display that late outcome, and the
  run stays waiting for the operator.
- An operator's cancel between the takeover's steps (white-box, in-process, as in
  test_gate_inprocess.py) is final: the takeover never revives the run.

Real processes throughout except the last test; waits poll with generous deadlines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import AGENTGATE, wait_for  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    PAY,
    Bank,
    agentgate as command,
    all_runs,
    allow,
    approvals,
    bank,
    bankdir,  # noqa: F401 (fixture)
    db_path,
    event_types,
    expect,
    host,
    kill_and_reap,
    only_pending,
    query,
    raw_gate,
    release,
    run,
    run_to_end,
    send_call,
    wait_lease_expired,
    wait_payments,
)

# A line of show's event list: sequence number, time, type, payload.
EVENT_ROW = re.compile(r"^\s*\d+\s+\d{4}-\d\d-\d\dT\S+\s+[a-z_]+\.[a-z_.]+(\s|$)")
BLOCKED_PAY = {"to": "x", "amount": 1, "mode": "block"}  # the fake bank pays, then waits for release
HIDDEN = "A" * 300 + "HIDDEN-PART" + "B" * 300  # 611 bytes: past what approve shows whole


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{text}"
    return lines[0]


def refused_for_length(done) -> None:
    assert done.returncode == 2, f"exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    assert "-full" in one_line(done.stderr), done.stderr


# ---------------------------------------------------------------- long values


def test_a_value_too_long_to_show_whole_is_decided_only_with_full(workdir):
    bank = Bank(workdir)
    gate = bank.start()
    run_id, approval = bank.pending(bank.call(gate, {"to": HIDDEN, "amount": 1}))

    refused_for_length(bank.approve(run_id, approval, ok=False))
    refused_for_length(bank.approve(run_id, None, "-yes", ok=False))
    refused_for_length(bank.operator("reject", run_id, "-approval", approval, "-note", "no"))
    refused_for_length(bank.operator("reject", run_id, "-yes", "-note", "no"))
    assert bank.approval(approval)["status"] == "pending"
    assert bank.run(run_id)["status"] == "WAITING_FOR_APPROVAL"
    assert not bank.query("SELECT 1 FROM events WHERE type='approval.decided'")

    done = bank.approve(run_id, approval, "-full")
    assert "HIDDEN-PART" in done.stdout and HIDDEN in done.stdout, done.stdout
    assert "Traceback" not in done.stderr
    assert bank.approval(approval)["status"] == "approved"
    assert bank.call(gate, {"to": HIDDEN, "amount": 1}).text == f"paid 1.00 to {HIDDEN}"
    assert bank.payments() == 1

    # A value short enough to be shown whole needs no -full, as before.
    short = "c" * 200
    run_id, approval = bank.pending(bank.call(gate, {"to": short, "amount": 2}))
    done = bank.approve(run_id, approval)
    assert short in done.stdout
    assert bank.approval(approval)["status"] == "approved"


def test_reject_of_a_value_too_long_to_show_whole_needs_full(workdir):
    bank = Bank(workdir)
    gate = bank.start()
    run_id, approval = bank.pending(bank.call(gate, {"to": HIDDEN, "amount": 3}))

    refused_for_length(bank.operator("reject", run_id, "-approval", approval, "-note", "too long to read"))
    assert bank.approval(approval)["status"] == "pending"

    done = bank.operator("reject", run_id, "-approval", approval, "-note", "too long to read", "-full")
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert HIDDEN in done.stdout
    assert bank.approval(approval)["status"] == "rejected"
    assert bank.call(gate, {"to": HIDDEN, "amount": 3}).prefix == "REJECTED"
    assert bank.payments() == 0


# ---------------------------------------------------------------- argv that is not UTF-8


def operator_bytes(bank: Bank, *args):
    """An operator command whose argv may hold raw bytes (not UTF-8)."""
    argv = [sys.executable, str(AGENTGATE), *args, "-config", str(bank.config)]
    return run_to_end(argv, dict(os.environ), None, DEADLINE)


def refused_flag(done, flag: str) -> None:
    assert done.returncode == 2, f"exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert flag in one_line(done.stderr), done.stderr


def test_a_note_or_by_that_is_not_utf8_is_refused_naming_the_flag(workdir):
    bank = Bank(workdir)
    gate = bank.start()
    run_id, approval = bank.pending(bank.call(gate, {"to": "nina", "amount": 4}))

    refused_flag(operator_bytes(bank, "reject", run_id, "-approval", approval, "-note", b"\xff\xfe"), "-note")
    refused_flag(operator_bytes(bank, "reject", run_id, "-approval", approval, "-note", "why",
                                "-by", b"op\xff"), "-by")
    refused_flag(operator_bytes(bank, "approve", run_id, "-approval", approval, "-by", b"\xfe"), "-by")
    refused_flag(operator_bytes(bank, "approve", run_id, "-approval", approval, "-note", b"ok\xff"), "-note")
    assert bank.approval(approval)["status"] == "pending"
    assert bank.run(run_id)["status"] == "WAITING_FOR_APPROVAL"
    assert not bank.query("SELECT 1 FROM events WHERE type='approval.decided'")

    bank.approve(run_id, approval, "-note", "fine", "-by", "op")  # UTF-8 flags still decide
    assert bank.approval(approval)["status"] == "approved"


# ---------------------------------------------------------------- a lease lapsed, a late outcome


def test_show_and_approve_display_the_late_outcome_of_a_run_cut_off_while_alive(bankdir):
    config = bank(bankdir, rules={"pay": allow("60s")}, lease_ttl="3s")
    first = raw_gate(config)
    send_call(first, 100, PAY, BLOCKED_PAY)
    wait_payments(bankdir, 1)
    (cut,) = [r for r in all_runs(bankdir, PAY) if r["status"] == "RUNNING"]
    os.kill(first.pid, signal.SIGSTOP)
    try:
        wait_lease_expired(bankdir, cut["id"])
        second = host(config)
        expect(second.call(PAY, BLOCKED_PAY), "INTERRUPTED", is_error=False)
        pending = only_pending(bankdir)
        assert pending["run_id"] == cut["id"] and pending["kind"] == "interrupted_side_effect"
        release(bankdir)
    finally:
        os.kill(first.pid, signal.SIGCONT)

    def late():
        return [p for (p,) in query(db_path(bankdir), "SELECT payload_json FROM events WHERE run_id=? AND "
                                             "type='step.tool_finished'", (cut["id"],)) if "late" in p]
    wait_for(late, DEADLINE, message="the late outcome to be recorded")

    shown = command("show", cut["id"], "-config", str(config))
    assert shown.returncode == 0, shown.stderr
    # Said in so many words, not only as the raw payload of an event in the event list.
    # show lists the events last, each payload on the lines under its row: what comes before is what it says.
    lines = shown.stdout.splitlines()
    first_event = next(i for i, line in enumerate(lines) if EVENT_ROW.match(line))
    told = "\n".join(lines[:first_event])
    assert "late" in told.lower() and "paid 1.00 to x" in told, shown.stdout

    printed = command("approve", cut["id"], "-config", str(config))  # stdin not a terminal: prints, refuses
    assert printed.returncode == 2, printed
    assert pending["id"] in printed.stdout
    assert "late" in printed.stdout.lower() and "paid 1.00 to x" in printed.stdout, printed.stdout

    # The late outcome revived nothing: the run still waits for the operator, nothing paid again.
    assert run(bankdir, cut["id"])["status"] == "WAITING_FOR_APPROVAL"
    assert only_pending(bankdir)["id"] == pending["id"]
    assert len(approvals(bankdir)) == 1
    wait_payments(bankdir, 1)


# ---------------------------------------------------------------- cancel during a takeover


@pytest.mark.parametrize("outcome_now", ["allow", "deny"])
def test_a_cancel_between_takeover_steps_is_final(bankdir, monkeypatch, outcome_now):
    # allow: the take-over asks an operator about the cut-off payment (a pause); deny: the
    # policy now denies payments, so the take-over ends the run. Either second step must leave
    # an operator's cancel in between as it is.
    config_path = bank(bankdir, rules={"pay": allow("60s")}, lease_ttl="3s")
    doomed = raw_gate(config_path)
    send_call(doomed, 100, PAY, BLOCKED_PAY)
    wait_payments(bankdir, 1)
    (cut,) = [r for r in all_runs(bankdir, PAY) if r["status"] == "RUNNING"]
    assert kill_and_reap(doomed) == -signal.SIGKILL
    wait_lease_expired(bankdir, cut["id"])
    if outcome_now == "deny":
        config_path = bank(bankdir, rules={"pay": {**allow("60s"), "outcome": "deny"}}, lease_ttl="3s")

    ag = agentgate
    args = ag.parse(json.dumps(BLOCKED_PAY).encode())
    config = ag.load_config(str(config_path))
    upstreams, tools, _ = ag.load_all(config)
    store = ag.Store(config.database)
    gate = ag.Gate(config, store, tools)
    try:
        took_over, cancelled, once = [], [], threading.Lock()
        original_take_over, original_write = ag.Tx.take_over, ag.Store.write

        def take_over(self, run_id, lease):
            found = original_take_over(self, run_id, lease)
            took_over.append(run_id)
            return found

        def write(self, fn, *rest, **kw):
            result = original_write(self, fn, *rest, **kw)
            with once:
                if took_over and not cancelled:
                    # The takeover's transaction has committed: an operator cancels now.
                    cancelled.append(True)
                    original_write(self, lambda tx: tx.cancel_run(took_over[0], "op", "stop"))
            return result

        monkeypatch.setattr(ag.Tx, "take_over", take_over)
        monkeypatch.setattr(ag.Store, "write", write)
        answer = gate.call(gate.tools[PAY], args)
        monkeypatch.undo()

        assert took_over and took_over[0] == cut["id"] and cancelled, "the takeover was not reached"
        assert not answer.text.startswith(("PENDING_APPROVAL:", "INTERRUPTED:")), answer.text
        assert answer.text.startswith("REJECTED:"), answer.text
        row = run(bankdir, cut["id"])
        assert row["status"] == "CANCELLED", row
        assert not approvals(bankdir, "pending"), approvals(bankdir)
        types = event_types(db_path(bankdir), cut["id"])
        assert types.count("run.finished") == 1, types
        after = types[types.index("run.finished"):]
        assert "approval.requested" not in after and "run.resumed" not in after, types
        # The next identical call is told it was cancelled too, and nothing runs again.
        again = gate.call(gate.tools[PAY], args)
        assert again.text.startswith("REJECTED:"), again.text
        assert run(bankdir, cut["id"])["status"] == "CANCELLED"
        wait_payments(bankdir, 1)
    finally:
        gate.stopping.set()
        for upstream in upstreams:
            upstream.close()
        store.close()
