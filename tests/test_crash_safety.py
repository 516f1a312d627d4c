"""Crash safety (issue 4): leases and takeover, many processes, signals, database failures.

Real processes throughout: gates under SIGKILL are driven over raw pipes (RawStdio) so they
can be killed mid-call; the gate that carries on is an SDK host on the same database and
session, started before the crash so that the dead gate's lease (lease_ttl 3s) is still live
when it first asks. A lease is waited out by polling until the stored lease_expires_at has
passed. The fake bank's ledger is the ground truth of what executed; the fake bank dies with
its gate (Linux parent-death signal), and the fixture checks that none outlives its test.

Ported from the reference suite (agentrt-tests.md):
- cli_test.go
  - TestProcess_TwoProxiesOnOneSession -> test_two_gates_on_one_session
  - TestProcess_CrashThenApproveRunsItAgainOnce -> test_crash_then_approve_runs_it_again_once
  - TestProcess_CrashThenRejectRunsNothingAndUnblocks -> test_crash_then_reject_runs_nothing_and_unblocks
  - TestProcess_CrashThenRejectAsksAgainAfterTheWindow -> test_crash_then_reject_asks_again_after_the_window
  - TestProcess_CrashOfAnApprovedPaymentAsksAgain -> test_crash_of_an_approved_payment_asks_again
  - TestProcess_StdinCloseMidCallFinishesTheStep -> test_stdin_close_mid_call_finishes_the_step
- index_test.go (these drive the calls index directly in the reference)
  - TestIndex_RowWithoutARunIsBegunUnderItsID: N/A. agentgate claims the index row and begins
    its run in one transaction (Tx.begin_run), so a row without a run cannot exist.
  - TestIndex_OneCallBeginsARow: its claim and Begin halves are N/A for the same reason; its
    observable half (an identical call while one executes is IN_PROGRESS and begins no run)
    -> test_an_identical_call_while_one_executes_is_in_progress_and_begins_no_run
  - TestIndex_ALateBeginLeavesNoRunBehind: N/A (needs a row without a run).
  - TestIndex_RowWithoutARunIsSettledWhenFound: N/A (needs a row without a run).
  - TestProxy_AbandonedCallIsEndedAndRunFresh -> test_a_read_cut_off_is_answered_afresh, in
    spirit: agentgate records "allowed" and "executing" in one transaction, so a call allowed but
    never executed cannot be produced; the nearest is a read whose server never answered (the
    fake bank is SIGSTOPped) when its gate is SIGKILLed. agentgate records a read only once it
    answers, so where the reference ends the abandoned run ("taken over after an interruption",
    2 runs), here nothing of the cut-off read was recorded: the identical read is answered
    afresh at once, with exactly one run and no approval.
- issue 4's own list: test_identical_calls_racing_from_processes_and_threads_pay_once,
  test_crash_matrix (five stages), test_a_database_failure_under_a_call_answers_unavailable,
  test_sigterm_or_sigint_mid_call_finishes_the_step. SIGKILL while the server is inside a
  payment, restart, IN_PROGRESS, INTERRUPTED, approve or reject: the crash_then_* tests.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from conftest import wait_for
from kit import (
    BALANCE,
    PAY,
    WriteLock,
    all_runs,
    allow,
    approval_in,
    approvals,
    approve,
    bank,
    bankdir,  # noqa: F401 (fixture)
    bytes_written,
    count,
    db_path,
    event_types,
    expect,
    expect_result,
    fake_bank_of,
    fake_banks,
    host,
    kill_and_reap,
    only_pending,
    pipe_drained,
    query,
    raw_gate,
    reject,
    release,
    response,
    response_text,
    run,
    run_in_hint,
    said,
    send_call,
    steps,
    stop_process,
    stored_now,
    unread_input,
    wait_lease_expired,
    wait_payments,
    wait_until_past,
)

# Reference section 5.5: "crash, interrupted, approved, re-run".
CRASH_INTERRUPTED_APPROVED_RERUN = [
    "run.created", "run.started", "step.started", "step.decided", "step.policy", "step.tool_started",
    "lease.taken_over", "step.interrupted", "step.policy", "approval.requested", "approval.decided",
    "run.resumed", "step.policy", "step.tool_started", "step.tool_finished", "run.finished",
]


def running(dir, tool: str = PAY) -> list[dict]:
    return [r for r in all_runs(dir, tool) if r["status"] == "RUNNING"]


def crash_mid_payment(dir, config, args: dict, gate=None):
    """A gate pays `args` (block mode) and is SIGKILLed while the server is inside the payment.

    The gate that carries on is started before the call (so that however slowly it starts,
    the dead gate's lease is still live when it first asks). Returns (run id of the cut-off
    call, the carrying-on SDK host)."""
    gate = gate or raw_gate(config)
    successor = host(config)
    before = count(dir)
    send_call(gate, 100, PAY, args)
    wait_payments(dir, before + 1)
    (cut_off,) = running(dir)
    assert kill_and_reap(gate) == -signal.SIGKILL
    assert run(dir, cut_off["id"])["lease_owner"], "the killed gate's lease should still be recorded"
    return cut_off["id"], successor


def in_progress_then_interrupted(dir, gate, args: dict, run_id: str) -> dict:
    """Until the dead gate's lease passes the identical call is IN_PROGRESS (asked again and
    again); once it has passed, INTERRUPTED naming the one pending interruption approval of
    that run (returned). Nothing is paid meanwhile."""
    paid = count(dir)
    expires = run(dir, run_id)["lease_expires_at"]
    while True:
        text, error = said(gate.call(PAY, args))
        if stored_now() < expires:  # answered before the lease passed, so decided under it
            assert text.startswith("IN_PROGRESS:") and not error, text
            assert count(dir) == paid, "a call under a live lease started a payment"
            time.sleep(0.2)  # pacing only: the loop ends on the clock
            continue
        # answered after the lease passed: the answer may already be the takeover's
        assert text.startswith(("IN_PROGRESS:", "INTERRUPTED:")) and not error, text
        break
    wait_lease_expired(dir, run_id)
    text = expect(gate.call(PAY, args), "INTERRUPTED", is_error=False)
    pending = only_pending(dir)
    assert pending["kind"] == "interrupted_side_effect"
    assert pending["run_id"] == run_id
    assert pending["capability"]["interrupted"]["ended"] == "cut_off"
    assert pending["capability"]["interrupted"]["run_id"] == run_id
    assert approval_in(text) == pending["id"]
    assert f"approve {run_id} -approval {pending['id']}" in gate.stderr_text()
    return pending


# ---------------------------------------------------------------- SIGKILL mid-payment


def test_crash_then_approve_runs_it_again_once(bankdir):
    config = bank(bankdir, rules={"pay": allow()}, lease_ttl="3s")
    rob = {"to": "rob", "amount": 5, "mode": "block"}
    run_id, gate = crash_mid_payment(bankdir, config, rob)
    pending = in_progress_then_interrupted(bankdir, gate, rob, run_id)

    blocked = expect(gate.call(PAY, {"to": "sue", "amount": 1}), "BLOCKED", is_error=True)
    assert pending["id"] in blocked
    expect_result(gate.call(BALANCE, {"account": "A-1"}), "account A-1 holds 120.00 EUR")
    assert approval_in(expect(gate.call(PAY, rob), "INTERRUPTED")) == pending["id"]
    assert count(bankdir) == 1

    release(bankdir)
    approve(config, run_id, pending["id"])
    expect_result(gate.call(PAY, rob), "paid 5.00 to rob")
    assert count(bankdir) == 2
    assert event_types(db_path(bankdir), run_id) == CRASH_INTERRUPTED_APPROVED_RERUN
    assert run(bankdir, run_id)["status"] == "COMPLETED"
    assert query(db_path(bankdir), "SELECT outcome FROM calls WHERE run_id=?", (run_id,)) == [(2,)]  # known
    expect(gate.call(PAY, rob), "DUPLICATE", is_error=True)
    assert count(bankdir) == 2


def test_crash_then_reject_runs_nothing_and_unblocks(bankdir):
    config = bank(bankdir, rules={"pay": allow()}, lease_ttl="3s")
    tom = {"to": "tom", "amount": 6, "mode": "block"}
    run_id, gate = crash_mid_payment(bankdir, config, tom)
    pending = in_progress_then_interrupted(bankdir, gate, tom, run_id)

    reject(config, run_id, pending["id"], note="it went through; do not repeat it")
    rejected = expect(gate.call(PAY, tom), "REJECTED", is_error=True)
    assert "it went through" in rejected
    expect_result(gate.call(PAY, {"to": "uma", "amount": 1}), "paid 1.00 to uma")
    assert count(bankdir) == 2  # tom's cut-off payment and uma


def test_crash_then_reject_asks_again_after_the_window(bankdir):
    window = 2
    config = bank(bankdir, rules={"pay": allow()}, lease_ttl="3s", repeat_window=f"{window}s")
    vic = {"to": "vic", "amount": 7, "mode": "block"}
    run_id, gate = crash_mid_payment(bankdir, config, vic)
    pending = in_progress_then_interrupted(bankdir, gate, vic, run_id)

    reject(config, run_id, pending["id"])
    wait_until_past(run(bankdir, run_id)["finished_at"], window, "the repeat window to pass")
    text = expect(gate.call(PAY, vic), "INTERRUPTED", is_error=False)
    again = only_pending(bankdir)
    assert again["kind"] == "interrupted_side_effect" and again["id"] != pending["id"]
    assert approval_in(text) == again["id"]
    assert count(bankdir) == 1


def test_crash_of_an_approved_payment_asks_again(bankdir):
    config = bank(bankdir, lease_ttl="3s")  # the default policy: a payment asks an operator
    wes = {"to": "wes", "amount": 9, "mode": "block"}
    first = raw_gate(config)
    asked = response_text(first.request("tools/call", {"name": PAY, "arguments": wes}, timeout=60))
    assert asked.startswith("PENDING_APPROVAL:"), asked
    approval = approval_in(asked)
    wait_for(lambda: "(or reject)" in first.stderr_text(), 30, message="the operator hint")
    run_id = run_in_hint(first.stderr_text(), approval)
    approve(config, run_id, approval)

    crashed, gate = crash_mid_payment(bankdir, config, wes, gate=first)  # the collecting call is cut off
    assert crashed == run_id
    pending = in_progress_then_interrupted(bankdir, gate, wes, run_id)
    assert pending["capability"]["interrupted"]["step_id"] == pending["step_id"]
    assert count(bankdir) == 1

    release(bankdir)
    approve(config, run_id, pending["id"])
    expect_result(gate.call(PAY, wes), "paid 9.00 to wes")
    assert count(bankdir) == 2
    assert run(bankdir, run_id)["status"] == "COMPLETED"


# ---------------------------------------------------------------- the crash matrix

STAGES = [
    "before_the_run_is_recorded",
    "recorded_before_the_tool_runs",
    "while_the_tool_runs",
    "answered_before_the_outcome_is_recorded",
    "after_the_outcome_is_recorded",
]


@pytest.mark.parametrize("stage", STAGES)
def test_crash_matrix(bankdir, stage):
    """SIGKILL at each stage of one allowed payment; the next identical call's answer and the
    ledger are asserted, and no stage runs the payment twice without an operator's approval.

    How each stage is reached deterministically from outside:
    - before the run is recorded: the test holds SQLite's write lock, so the gate cannot record
      the run however far it got; it is killed once it has read the call from its stdin.
    - recorded, before the tool runs: the fake bank is SIGSTOPped, so the request the gate
      sends after recording the run is never read; killed once the run is in the database and
      the request waits unread in the bank's stdin pipe.
      (The gate cannot tell this from a request the server received, so it asks an operator.)
    - while the tool runs: block mode, killed once the payment is in the ledger.
    - the tool answered, its outcome not recorded: block mode; the test holds the write lock,
      releases the payment and kills the gate once the bank has written its answer (its write
      counter in /proc grew), so the outcome cannot have been recorded.
    - after: killed once the answer reached the host.
    """
    config = bank(bankdir, rules={"pay": allow()}, lease_ttl="3s")
    zed = {"to": "zed", "amount": 3, "mode": "block"}
    other = {"to": "yul", "amount": 1}
    doomed, gate = raw_gate(config), host(config)
    bank_pid = fake_bank_of(doomed.pid)

    if stage == "before_the_run_is_recorded":
        with WriteLock(bankdir):
            send_call(doomed, 1, PAY, zed)
            wait_for(lambda: pipe_drained(doomed), 30, message="the gate to read the call")
            kill_and_reap(doomed)
        assert all_runs(bankdir, PAY) == [] and count(bankdir) == 0
        release(bankdir)
        expect_result(gate.call(PAY, zed), "paid 3.00 to zed")  # nothing had run: it runs once
        assert count(bankdir) == 1
        expect(gate.call(PAY, zed), "DUPLICATE", is_error=True)
        assert count(bankdir) == 1
        return

    if stage == "after_the_outcome_is_recorded":
        release(bankdir)
        send_call(doomed, 1, PAY, zed)
        assert response_text(response(doomed, 1)) == "paid 3.00 to zed"
        kill_and_reap(doomed)
        assert [r["status"] for r in all_runs(bankdir, PAY)] == ["COMPLETED"]
        assert "paid 3.00 to zed" in expect(gate.call(PAY, zed), "DUPLICATE", is_error=True)
        expect_result(gate.call(PAY, other), "paid 1.00 to yul")
        assert count(bankdir) == 2
        return

    if stage == "recorded_before_the_tool_runs":
        stop_process(bank_pid)
        send_call(doomed, 1, PAY, zed)
        wait_for(lambda: running(bankdir), 30, message="the run to be recorded")
        wait_for(lambda: unread_input(bank_pid), 30, message="the request to reach the bank's stdin")
        kill_and_reap(doomed)
        paid = 0
    elif stage == "while_the_tool_runs":
        send_call(doomed, 1, PAY, zed)
        wait_payments(bankdir, 1)
        kill_and_reap(doomed)
        paid = 1
    else:  # answered_before_the_outcome_is_recorded
        send_call(doomed, 1, PAY, zed)
        wait_payments(bankdir, 1)
        with WriteLock(bankdir):
            written = bytes_written(bank_pid)
            release(bankdir)
            wait_for(lambda: bytes_written(bank_pid) > written, 30, message="the bank to answer")
            kill_and_reap(doomed)
        paid = 1

    assert count(bankdir) == paid
    (cut_off,) = running(bankdir)
    pending = in_progress_then_interrupted(bankdir, gate, zed, cut_off["id"])
    # Nothing runs again without an operator: not the identical call, not another payment.
    assert approval_in(expect(gate.call(PAY, zed), "INTERRUPTED", is_error=False)) == pending["id"]
    assert pending["id"] in expect(gate.call(PAY, other), "BLOCKED", is_error=True)
    assert count(bankdir) == paid

    release(bankdir)
    approve(config, cut_off["id"], pending["id"])
    expect_result(gate.call(PAY, zed), "paid 3.00 to zed")
    assert count(bankdir) == paid + 1
    expect(gate.call(PAY, zed), "DUPLICATE", is_error=True)
    assert count(bankdir) == paid + 1


# ---------------------------------------------------------------- many processes


def test_two_gates_on_one_session(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    one, two = host(config), host(config)

    olga = {"to": "olga", "amount": 3, "mode": "slow"}
    calls = [one.submit(PAY, olga), two.submit(PAY, olga)]
    texts = [said(c.result(60))[0] for c in calls]
    assert texts.count("paid 3.00 to olga") == 1, texts
    (other,) = [t for t in texts if t != "paid 3.00 to olga"]
    assert other.startswith(("IN_PROGRESS:", "DUPLICATE:")), other
    assert count(bankdir) == 1

    first = one.submit(PAY, {"to": "pia", "amount": 1, "mode": "slow"})
    second = two.submit(PAY, {"to": "quin", "amount": 2, "mode": "slow"})
    expect_result(first.result(60), "paid 1.00 to pia")
    expect_result(second.result(60), "paid 2.00 to quin")
    assert count(bankdir) == 3


def test_an_identical_call_while_one_executes_is_in_progress_and_begins_no_run(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    one, two = host(config), host(config)
    yan = {"to": "yan", "amount": 1, "mode": "block"}

    executing = one.submit(PAY, yan)
    wait_payments(bankdir, 1)
    expect(two.call(PAY, yan), "IN_PROGRESS", is_error=False)  # another process
    expect(one.call(PAY, yan), "IN_PROGRESS", is_error=False)  # the same process
    assert len(all_runs(bankdir, PAY)) == 1
    release(bankdir)
    expect_result(executing.result(60), "paid 1.00 to yan")
    assert count(bankdir) == 1


def test_identical_calls_racing_from_processes_and_threads_pay_once(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    gates = [host(config) for _ in range(3)]
    request = {"to": "rae", "amount": 2}
    callers = 12
    barrier = threading.Barrier(callers)
    answers: list = [None] * callers

    def fire(i: int) -> None:
        barrier.wait(60)
        answers[i] = gates[i % len(gates)].submit(PAY, request).result(90)

    threads = [threading.Thread(target=fire, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert all(a is not None for a in answers), "a call failed without an answer"
    texts = [said(a)[0] for a in answers]
    assert texts.count("paid 2.00 to rae") == 1, texts
    assert all(t.startswith(("IN_PROGRESS:", "DUPLICATE:")) for t in texts if t != "paid 2.00 to rae"), texts
    assert count(bankdir) == 1
    assert len(all_runs(bankdir, PAY)) == 1
    # The calls index: one row for the request, settled with a known outcome (2).
    assert query(db_path(bankdir), "SELECT c.open, c.outcome, c.settled_at != '' FROM calls c "
                                   "JOIN runs r ON r.id = c.run_id WHERE r.tool=?", (PAY,)) == [(1, 2, 1)]


def test_a_read_cut_off_is_answered_afresh(bankdir):
    # The read's timeout is far longer than the test takes to kill its gate: with the default
    # 10s, a loaded machine once let the read time out (and be recorded as failed) first.
    config = bank(bankdir, lease_ttl="3s", rules={"balance": {"timeout": "300s"}})
    doomed, gate = raw_gate(config), host(config)
    bank_pid = fake_bank_of(doomed.pid)
    stop_process(bank_pid)  # the read will never be answered
    send_call(doomed, 1, BALANCE, {"account": "zed"})
    # The gate has sent the request on: it waits unread in the stopped bank's stdin.
    wait_for(lambda: unread_input(bank_pid), 30, message="the read to reach the bank's stdin")
    kill_and_reap(doomed)

    # A read is recorded once it answers (it has no effect a crash could leave unknown), so
    # the cut-off read left nothing behind: the identical read runs at once, no lease to wait.
    left = all_runs(bankdir, BALANCE)
    assert left == [], (left, [steps(db_path(bankdir), r["id"]) for r in left], doomed.stderr_text())
    expect_result(gate.call(BALANCE, {"account": "zed"}), "account zed holds 120.00 EUR")
    reads = all_runs(bankdir, BALANCE)
    assert [r["status"] for r in reads] == ["COMPLETED"]
    assert approvals(bankdir) == []


# ---------------------------------------------------------------- shutdown and database failure


def stop_mid_call_finishes_the_step(bankdir, stop) -> None:
    """`stop(gate)` while a slow payment is under way: the payment is answered, the gate exits 0,
    the run completes without an interruption and the upstream is closed."""
    config = bank(bankdir, rules={"pay": allow()})
    gate = raw_gate(config)
    send_call(gate, 5, PAY, {"to": "val", "amount": 8, "mode": "slow"})
    wait_payments(bankdir, 1)
    stop(gate)
    assert response_text(response(gate, 5)) == "paid 8.00 to val"
    assert gate.wait(60) == 0
    (only,) = all_runs(bankdir)
    assert only["status"] == "COMPLETED"
    kinds = event_types(db_path(bankdir), only["id"])
    assert "step.interrupted" not in kinds and kinds[-1] == "run.finished"
    wait_for(lambda: not fake_banks(bankdir), 30, message="the upstream to be closed")


def test_stdin_close_mid_call_finishes_the_step(bankdir):
    stop_mid_call_finishes_the_step(bankdir, lambda gate: gate.proc.stdin.close())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_mid_call_finishes_the_step(bankdir, sig):
    stop_mid_call_finishes_the_step(bankdir, lambda gate: gate.kill(sig))


def test_a_database_failure_under_a_call_answers_unavailable(bankdir):
    """The database is made to fail by holding its write lock from the test past the gate's
    busy timeout (deterministic, unlike swapping or chmod-ing the file under an open
    connection, which SQLite does not notice until it reopens it)."""
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)

    zed = {"to": "zed", "amount": 3}
    with WriteLock(bankdir):
        text = expect(gate.call(PAY, zed), "UNAVAILABLE", is_error=True)
    assert "nothing was executed" in text
    assert count(bankdir) == 0
    expect_result(gate.call(PAY, zed), "paid 3.00 to zed")
    assert count(bankdir) == 1

    yan = {"to": "yan", "amount": 4, "mode": "block"}
    in_flight = gate.submit(PAY, yan)
    wait_payments(bankdir, 2)
    (stranded,) = running(bankdir)
    with WriteLock(bankdir):
        release(bankdir)
        text = expect(in_flight.result(90), "UNAVAILABLE", is_error=True)
    assert "sent to the server" in text and "could not be recorded" in text
    assert count(bankdir) == 2

    # The next identical call ends the stranded run: it executed, so it asks an operator
    # rather than paying again.
    text = expect(gate.call(PAY, yan), "INTERRUPTED", is_error=False)
    assert run(bankdir, stranded["id"])["status"] != "RUNNING"
    assert approval_in(text) == only_pending(bankdir)["id"]
    assert count(bankdir) == 2
