"""Regression tests for the audit's findings, one per finding (the fifth has two: its race
cannot be reached on purpose from outside the process, so an in-process test pins it).

Each test asserts what a user sees: the answer the model is given, how many payments the fake
bank made (its ledger), what the scripted server received, and the database's rows. The gate,
the fake bank, the scripted server and the operator commands are real processes, except in
the one in-process test, where the gate is called as a Python object. Nothing here sleeps a
guessed time: every wait polls a condition with a generous deadline.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError

from conftest import pid_alive, wait_for
from kit import (
    DEADLINE,
    PAY,
    agentgate,
    allow,
    approval_in,
    approvals,
    bank,
    bank_server,
    bankdir,  # noqa: F401 (fixture)
    count,
    db_path,
    expect,
    fake_bank_of,
    gate_host,
    has_raw_controls,
    host,
    ledger,
    only_pending,
    operator,
    payments,
    pin,
    query,
    records,
    release,
    result_text,
    rule,
    run,
    run_in_hint,
    said,
    scripted_server,
    tool,
    wait_payments,
    wait_until_past,
    write_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agentgate as gatemod  # noqa: E402

INTERRUPTION = "interrupted_side_effect"


def runs_with_status(dir, status: str) -> list[str]:
    return [r for (r,) in query(db_path(dir), "SELECT id FROM runs WHERE status=? ORDER BY rowid", (status,))]


def stays(predicate, seconds: float, interval: float = 0.05, message: str = "") -> None:
    """Fail at once if `predicate` stops holding at any poll within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert predicate(), f"stopped holding: {message}"
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


def thread_count(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))


def call_or_fail(gate, name: str, args: dict):
    """An SDK tools/call that must get a result, never a JSON-RPC error."""
    try:
        return gate.call(name, args)
    except MCPError as err:
        pytest.fail(f"{name} {args} got a JSON-RPC error instead of a result: {err}\n"
                    f"gate stderr:\n{gate.stderr_text()[-3000:]}")


# ---------------------------------------------------------------- 1


def test_cancel_while_executing_keeps_the_outcome_unknown(bankdir):
    """An operator cancels a run while its payment is inside the server: the payment may well
    have landed, so the identical call must ask an operator, not pay again (even with no
    repeat window to refuse it as a duplicate)."""
    config = bank(bankdir, rules={"pay": allow("30s")}, repeat_window="0s")
    gate = host(config)
    request = {"to": "kim", "amount": 7, "mode": "block"}

    first = gate.submit(PAY, request)
    wait_payments(bankdir, 1)  # the payment landed; the server now blocks until released
    running = wait_for(lambda: runs_with_status(bankdir, "RUNNING"), DEADLINE, message="the RUNNING run")
    assert len(running) == 1, running
    run_id = running[0]
    operator(config, "cancel", run_id, "-note", "x")
    assert run(bankdir, run_id)["status"] == "CANCELLED"

    release(bankdir)
    first.result()  # the upstream call answers; what it tells the cancelled caller is not at issue
    assert count(bankdir) == 1

    text, _ = said(call_or_fail(gate, PAY, request))
    assert text.startswith(("INTERRUPTED:", "UNKNOWN_OUTCOME:")), text
    asked = approval_in(text)
    assert any(a["id"] == asked and a["kind"] == INTERRUPTION and a["status"] == "pending"
               for a in approvals(bankdir)), approvals(bankdir)
    assert count(bankdir) == 1


# ---------------------------------------------------------------- 2


def test_cancel_while_waiting_closes_the_approval(bankdir):
    """Cancelling a run that waits for an operator closes its question: the status tool no
    longer says it waits, and a later reject neither succeeds nor rewrites why the run ended."""
    config = bank(bankdir)
    gate = host(config)
    text = expect(gate.call(PAY, {"to": "ann", "amount": 3}), "PENDING_APPROVAL", is_error=False)
    approval = approval_in(text)
    run_id = run_in_hint(gate.stderr_text(), approval)
    waiting = result_text(gate.call("gate_status", {}))
    assert "1 request in this session is waiting" in waiting, waiting

    operator(config, "cancel", run_id, "-note", "x")

    status = result_text(call_or_fail(gate, "gate_status", {}))
    assert "no request in this session is waiting" in status, status
    done = agentgate("reject", run_id, "-approval", approval, "-yes", "-note", "y", "-config", str(config))
    assert done.returncode == 1, f"reject exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    ended = run(bankdir, run_id)
    assert (ended["status"], ended["reason"]) == ("CANCELLED", "operator_cancelled"), ended
    assert count(bankdir) == 0


# ---------------------------------------------------------------- 3


def test_a_stale_unknown_outcome_the_config_now_refuses_does_not_break_the_tool(bankdir):
    """An unknown outcome left with nothing waiting is asked about again when the tool is next
    called; if its arguments are no longer allowed, that must not turn every call to the tool
    into a protocol error."""
    config = bank(bankdir, rules={"pay": allow("1s")}, approval_ttl="1s")
    gate = host(config)
    expect(gate.call(PAY, {"to": "kim", "amount": 7, "mode": "block"}), "UNKNOWN_OUTCOME")
    wait_payments(bankdir, 1)
    gate.close()
    release(bankdir)

    question = only_pending(bankdir)
    assert question["kind"] == INTERRUPTION
    wait_until_past(question["expires_at"], 0, "the interruption approval to expire")

    # mode is now refused; the manifest (the pin) is left as it was
    write_config(bankdir, [bank_server(bankdir, rules={"pay": {**allow("1s"), "deny": ["mode"]}})],
                 approval_ttl="1s")
    gate = host(config)
    text, is_error = said(call_or_fail(gate, PAY, {"to": "lou", "amount": 1}))
    if text.startswith("BLOCKED:"):
        approval_in(text)
        assert is_error and count(bankdir) == 1, text
    else:
        assert text == "paid 1.00 to lou" and not is_error, text
        assert count(bankdir) == 2


# ---------------------------------------------------------------- 4


def test_an_unreadable_result_is_recorded_not_left_executing(workdir):
    """A result whose content block the gate cannot map: the call executed, so it is answered
    UNRECORDED and its run is closed; the identical call is a duplicate, not a take-over."""
    record = workdir / "calls.jsonl"
    spec = {"tools": [tool("transfer")], "record": str(record),
            "calls": {"transfer": {"result": {"content": [{"type": []}]}}}}
    server = scripted_server(workdir, spec, name="up",
                             rules={"transfer": rule("remote_mutation", outcome="allow")})
    config = write_config(workdir, [server])
    pin(config)
    with gate_host(config) as gate:
        request = {"n": 1}
        text, _ = said(call_or_fail(gate, "up_transfer", request))
        assert text.startswith("UNRECORDED:"), text
        statuses = [s for (s,) in query(db_path(workdir), "SELECT status FROM runs")]
        assert statuses == ["FAILED"], statuses

        again = expect(call_or_fail(gate, "up_transfer", request), "DUPLICATE", is_error=True)
        assert "could not be recorded" in again, again
    calls = [entry for entry in records(record) if "call" in entry]
    assert calls == [{"call": "transfer", "arguments": request}], calls


# ---------------------------------------------------------------- 5


def test_a_host_cancel_during_a_hold_never_executes_it_later(bankdir):
    """The host cancels a call held for an operator, then the operator approves: nothing runs
    until the model calls again, and then it runs once."""
    config = bank(bankdir, hold="20s")
    gate = host(config)
    request = {"to": "cy", "amount": 4}
    held = gate.submit(PAY, request, progress=True)
    wait_for(lambda: held.progress, DEADLINE, message="a progress notification during the hold")
    question = only_pending(bankdir)
    run_id = run_in_hint(gate.stderr_text(), question["id"])
    holding = thread_count(gate.pid)

    held.cancel()  # the SDK sends notifications/cancelled for the request
    wait_for(lambda: thread_count(gate.pid) < holding, DEADLINE, message="the held call to end")
    operator(config, "approve", run_id, "-approval", question["id"])

    stays(lambda: count(bankdir) == 0, 3.0, message="no payment before the model calls again")
    assert run(bankdir, run_id)["status"] == "WAITING_FOR_APPROVAL"
    text, is_error = said(call_or_fail(gate, PAY, request))
    assert text == "paid 4.00 to cy" and not is_error, text
    assert count(bankdir) == 1


class CancelledAtTheNextPoll(threading.Event):
    """A host's cancel flag that, the first time the hold waits on it, lets `meanwhile` run
    (the operator approves) and is then set: both arrive within one poll of the hold."""

    def __init__(self, meanwhile):
        super().__init__()
        self.meanwhile, self.fired = meanwhile, False

    def wait(self, timeout=None):
        if not self.fired:
            self.fired = True
            self.meanwhile()
            self.set()
            return True
        return super().wait(timeout)


def test_a_host_cancel_and_an_approval_in_one_hold_poll_execute_nothing(workdir):
    """The race the end-to-end test above cannot aim at: the host's cancel and the operator's
    approval both land while the hold sleeps. The cancelled call must not execute."""
    config_path = write_config(workdir, [bank_server(workdir)], hold="20s")
    pin(config_path)
    config = gatemod.load_config(str(config_path))
    upstreams, tools, _ = gatemod.load_all(config)
    store = gatemod.Store(config.database)
    gate = gatemod.Gate(config, store, tools)
    try:
        pay = gate.tools[PAY]
        args = gatemod.parse(b'{"to":"cy","amount":4}')

        def approve():
            approval_id, shown = store.read_one("SELECT id, hash FROM approvals WHERE status='pending'")
            assert store.write(lambda tx: tx.decide_approval(approval_id, shown, "approved", "operator",
                                                             "ok")) == "decided"

        cancelled = CancelledAtTheNextPoll(approve)
        answer = gate.call(pay, args, cancelled=cancelled)
        assert cancelled.fired
        assert answer.text.startswith("PENDING_APPROVAL:"), answer.text
        assert payments(ledger(workdir)) == 0
        assert gate.call(pay, args).text == "paid 4.00 to cy"
        assert payments(ledger(workdir)) == 1
    finally:
        gate.stopping.set()
        for upstream in upstreams:
            upstream.close()
        store.close()


# ---------------------------------------------------------------- 6


def test_a_call_to_a_dead_server_is_a_known_failure(bankdir):
    """The bank died before the call: nothing was sent, so the failure is known and no
    operator is asked whether it took effect."""
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)
    bank_pid = fake_bank_of(gate.pid)
    os.kill(bank_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(bank_pid), DEADLINE, message="the fake bank to die")

    text, is_error = said(call_or_fail(gate, PAY, {"to": "kim", "amount": 3}))
    assert is_error, text
    assert '"bank"' in text, text
    assert not text.startswith(("UNKNOWN_OUTCOME:", "INTERRUPTED:")), text
    assert [a for a in approvals(bankdir) if a["kind"] == INTERRUPTION] == []
    assert approvals(bankdir) == []
    assert count(bankdir) == 0


# ---------------------------------------------------------------- 7


def test_a_duplicate_does_not_pass_on_raw_control_characters(bankdir):
    """Text the server chose is shown as data in the result, but sanitized in the DUPLICATE
    sentence that quotes it."""
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)
    request = {"to": "x\u001b[2J\u202e", "amount": 2, "mode": "structured"}

    first = call_or_fail(gate, PAY, request)
    assert not first.is_error, result_text(first)
    assert "\u001b" in first.structured_content["to"]  # the result itself is passed on as it came

    text = expect(call_or_fail(gate, PAY, request), "DUPLICATE", is_error=True)
    assert "\u001b" not in text and "\u202e" not in text, repr(text)
    assert has_raw_controls(text) == "", repr(text)
    assert count(bankdir) == 1


# ---------------------------------------------------------------- 8


def test_an_operators_note_cannot_overflow_the_rejection(bankdir):
    """A note of 300 right-to-left overrides: each grows eightfold when made visible, and the
    model's sentence must still stay within its bound, with none of them raw."""
    config = bank(bankdir)
    gate = host(config)
    request = {"to": "eve", "amount": 9}
    approval = approval_in(expect(gate.call(PAY, request), "PENDING_APPROVAL"))
    run_id = run_in_hint(gate.stderr_text(), approval)
    operator(config, "reject", run_id, "-approval", approval, "-yes", "-note", "\u202e" * 300)

    text = expect(call_or_fail(gate, PAY, request), "REJECTED", is_error=True)
    assert len(text.encode("utf-8")) < 1200, (len(text.encode("utf-8")), text)
    assert "\u202e" not in text, repr(text)
    assert has_raw_controls(text) == "", repr(text)
    assert count(bankdir) == 0


def test_a_status_call_whose_arguments_are_not_usable_json_is_invalid(workdir):
    """The status tool answers INVALID, like every other tool, when the boundary check refuses
    its arguments (here a repeated key), instead of reading them leniently."""
    from conftest import RawStdio, agentgate_argv

    config = write_config(workdir, [bank_server(workdir)])
    pin(config)
    gate = RawStdio(agentgate_argv("-config", str(config)))
    try:
        gate.initialize()
        frame = (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"gate_status",'
                 b'"arguments":{"approval_id":"a","approval_id":"b"}}}')
        gate.send(frame)
        answer = gate.recv(60)
        assert answer["id"] == 7 and answer["result"]["isError"] is True, answer
        text = answer["result"]["content"][0]["text"]
        assert text.startswith("INVALID:") and "duplicate key" in text, text
    finally:
        gate.close()
