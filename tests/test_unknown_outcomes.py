"""Rules across calls (issue 4): unknown outcomes, duplicates, host cancels, lost answers.

Every test drives real processes: agentgate over stdio through the MCP SDK host, the fake
payment server ("bank") behind it, and the operator commands in their own processes. The
payment ledger (one line per payment) is the ground truth of what executed.

Ported from the reference suite (agentrt-tests.md), from outside:
- unknown_test.go
  - TestUnknown_TimeoutAfterTheEffectWaitsForAnOperator -> test_timeout_after_the_effect_waits_for_an_operator
    (the reference moves a skewed clock one hour on to show that time resolves nothing;
    agentgate has no skewable clock, so a fresh gate process on the same records stands in)
  - TestUnknown_RejectionUnblocksAndAnIdenticalCallAsksAgain -> test_rejection_unblocks_and_an_identical_call_asks_again
    (clock +11 min past a 10 min window becomes a 3 s repeat_window waited out on the clock)
  - TestUnknown_ServerErrorIsAKnownFailure -> test_server_error_is_a_known_failure (same window change)
  - TestUnknown_ClassifiesRecordedErrors (a unit test of the classifier) -> its observable
    behaviour: test_recorded_errors_are_classified_by_what_came_back (a server's error answer is
    a known failure: DUPLICATE later, no approval; a read that timed out is an ordinary failure;
    a payment whose server died under it is unknown and waits for an operator) and
    test_timeout_after_the_effect_waits_for_an_operator (a timeout after the effect is unknown).
  - TestUnknown_StatusSaysWhatCameOfAnApprovedRequest -> test_status_says_what_came_of_an_approved_request
  - TestUnknown_StepLimitKeepsTheToolBlocked -> test_repeated_unknown_reruns_keep_the_tool_blocked
    (agentgate has no per-run step limit, so "asked in a fresh run" is not asserted; what the
    model and the ledger see is)
  - TestUnknown_CrashBeforeTheReRunKeepsTheToolBlocked: N/A as written. agentgate records the
    attempt's outcome and proposes its re-run (with the interruption approval) in one
    transaction, so a crash cannot fall between them. The other ways an unknown outcome is left
    with nothing waiting are covered: expiry (test_expiry_asks_again_rather_than_unblocks) and
    crashes at every stage (test_crash_safety.py::test_crash_matrix).
  - TestUnknown_ExpiryAsksAgainRatherThanUnblocks -> test_expiry_asks_again_rather_than_unblocks
    (approval_ttl 4s waited out on the clock instead of a skewed clock)
  - TestUnknown_CutOffBeforeExecutingIsNoAttempt: N/A, both subtests. agentgate writes the run,
    the allowed decision and `step.tool_started` in one transaction and sends the request right
    after, and it takes the lease in that same transaction, so neither "allowed but never
    executed" nor "lease lost before Execute" is a state that can exist. The nearest observable
    stage (recorded, request never read by the server) is in test_crash_safety.py::test_crash_matrix.
  - TestUnknown_UnrecordedResultCountsAsExecuted -> test_unrecorded_answer_counts_as_executed
- proxy_test.go TestProxy_HostCancelLetsTheCallFinish -> test_host_cancel_lets_the_call_finish
- issue 4: "a lost-response retry pays once through agentgate and twice straight against the
  server" -> test_a_lost_answer_retried_pays_once_through_the_gate_and_twice_straight
"""

from __future__ import annotations

import signal
import os

import pytest
from mcp.shared.exceptions import MCPError

from conftest import RawStdio, agentgate_argv, fake_argv, wait_for
from kit import (
    BALANCE,
    PAY,
    all_runs,
    allow,
    approval_in,
    approvals,
    approve,
    bank,
    bankdir,  # noqa: F401 (fixture)
    count,
    db_path,
    event_types,
    expect,
    expect_result,
    fake_bank_of,
    host,
    only_pending,
    payments,
    reject,
    release,
    response,
    response_text,
    run,
    run_in_hint,
    said,
    send_call,
    steps,
    wait_payments,
    wait_until_past,
)

KIM = {"to": "kim", "amount": 7, "mode": "block"}
LOU = {"to": "lou", "amount": 1}
# Long enough that an ordinary payment never times out on a loaded machine; a "block"
# payment, which waits for its release file, always does.
PAY_TIMEOUT = "1s"

# Reference section 5.5: "timed out, then waits".
TIMED_OUT_THEN_WAITS = [
    "run.created", "run.started", "step.started", "step.decided", "step.policy", "step.tool_started",
    "step.tool_finished", "step.failed", "step.started", "step.decided", "step.policy", "approval.requested",
]


def status_of(gate, approval: str) -> str:
    text, error = said(gate.call("gate_status", {"approval_id": approval}))
    assert not error and text.startswith("GATE_STATUS: "), text
    return text


def test_timeout_after_the_effect_waits_for_an_operator(bankdir):
    config = bank(bankdir, rules={"pay": allow(PAY_TIMEOUT)})
    gate = host(config)

    text = expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert "may have" in text and "timed out" in text
    assert count(bankdir) == 1  # the payment landed before the gate gave up on the answer
    pending = only_pending(bankdir)
    assert pending["kind"] == "interrupted_side_effect"
    assert pending["capability"]["interrupted"]["ended"] == "timed_out"
    first = approval_in(text)
    assert first == pending["id"]
    run_id = run_in_hint(gate.stderr_text(), first)
    assert event_types(db_path(bankdir), run_id) == TIMED_OUT_THEN_WAITS

    again = expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert approval_in(again) == first
    blocked = expect(gate.call(PAY, LOU), "BLOCKED", is_error=True)
    assert first in blocked and "bank_pay" in blocked
    assert count(bankdir) == 1

    # Nothing but an operator resolves it: another gate process on the same records says the same.
    gate.close()
    gate = host(config)
    later = expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert approval_in(later) == first
    expect(gate.call(PAY, LOU), "BLOCKED", is_error=True)
    assert count(bankdir) == 1

    release(bankdir)
    approve(config, run_id, first, note="checked: it did not go through")
    expect_result(gate.call(PAY, KIM), "paid 7.00 to kim")
    assert count(bankdir) == 2
    duplicate = expect(gate.call(PAY, KIM), "DUPLICATE", is_error=True)
    assert "paid 7.00 to kim" in duplicate
    expect_result(gate.call(PAY, LOU), "paid 1.00 to lou")
    assert count(bankdir) == 3
    assert "APPROVED and executed" in status_of(gate, first)


def test_rejection_unblocks_and_an_identical_call_asks_again(bankdir):
    window = 3
    # A rejection is refused for the config's window (or the tool's, if longer).
    config = bank(bankdir, rules={"pay": allow(PAY_TIMEOUT, repeat_window=f"{window}s")},
                  repeat_window=f"{window}s")
    gate = host(config)
    request = {"to": "max", "amount": 8, "mode": "block"}

    approval = approval_in(expect(gate.call(PAY, request), "UNKNOWN_OUTCOME", is_error=False))
    run_id = run_in_hint(gate.stderr_text(), approval)
    reject(config, run_id, approval, note="it went through")
    rejected = expect(gate.call(PAY, request), "REJECTED", is_error=True)
    assert "it went through" in rejected
    expect_result(gate.call(PAY, {"to": "ned", "amount": 1}), "paid 1.00 to ned")  # the tool is free again

    asked = {approval}
    for _ in range(3):
        finished = run(bankdir, run_id)["finished_at"]
        wait_until_past(finished, window, "the repeat window after the rejection to pass")
        # A rejection does not make the outcome known: the identical call asks again, never runs.
        text = expect(gate.call(PAY, request), "UNKNOWN_OUTCOME", is_error=False)
        approval = approval_in(text)
        assert approval not in asked
        asked.add(approval)
        assert only_pending(bankdir)["id"] == approval
        run_id = run_in_hint(gate.stderr_text(), approval)
        reject(config, run_id, approval)
    assert count(bankdir) == 2  # max's first attempt and ned


def test_server_error_is_a_known_failure(bankdir):
    window = 3
    config = bank(bankdir, rules={"pay": allow(repeat_window=f"{window}s")})
    gate = host(config)
    request = {"to": "oli", "amount": 2, "mode": "error"}

    text, error = said(gate.call(PAY, request))
    assert error and "card declined for oli" in text and not text.startswith("UNKNOWN_OUTCOME")
    assert approvals(bankdir) == []
    duplicate = expect(gate.call(PAY, request), "DUPLICATE", is_error=True)
    assert "card declined" in duplicate

    finished = all_runs(bankdir, PAY)[0]["finished_at"]
    wait_until_past(finished, window, "the repeat window to pass")
    text, error = said(gate.call(PAY, request))
    assert error and "card declined for oli" in text and not text.startswith("DUPLICATE")
    assert count(bankdir) == 2
    assert approvals(bankdir) == []


def test_recorded_errors_are_classified_by_what_came_back(bankdir):
    config = bank(bankdir, rules={"pay": allow(), "balance": {"timeout": "300ms"}})
    gate = host(config)
    bank_pid = fake_bank_of(gate.pid)

    # The server answered with an error: a known failure. No operator is asked.
    text, error = said(gate.call(PAY, {"to": "oli", "amount": 2, "mode": "error"}))
    assert error and "card declined for oli" in text
    assert "card declined" in expect(gate.call(PAY, {"to": "oli", "amount": 2, "mode": "error"}), "DUPLICATE")
    assert approvals(bankdir) == []

    # A read that timed out is an ordinary failure: there is nothing to vouch for.
    os.kill(bank_pid, signal.SIGSTOP)
    try:
        text, error = said(gate.call(BALANCE, {"account": "A-1"}))
    finally:
        os.kill(bank_pid, signal.SIGCONT)
    assert error and "timed out" in text, text
    assert not text.startswith(("UNKNOWN_OUTCOME", "INTERRUPTED")), text
    assert approvals(bankdir) == []

    # The server died inside a payment: no answer, so the outcome is unknown and an operator decides.
    call = gate.submit(PAY, KIM)
    wait_payments(bankdir, 2)
    os.kill(bank_pid, signal.SIGKILL)
    text = expect(call.result(), "UNKNOWN_OUTCOME", is_error=False)
    assert "failed without an answer from the server" in text and "may have" in text
    pending = only_pending(bankdir)
    assert pending["kind"] == "interrupted_side_effect"
    assert pending["capability"]["interrupted"]["ended"] == "no_answer"
    assert approval_in(text) == pending["id"]
    assert count(bankdir) == 2


def test_status_says_what_came_of_an_approved_request(bankdir):
    config = bank(bankdir)  # the default policy: a payment asks an operator
    gate = host(config)

    declined = {"to": "oli", "amount": 2, "mode": "error"}
    approval = approval_in(expect(gate.call(PAY, declined), "PENDING_APPROVAL", is_error=False))
    approve(config, run_in_hint(gate.stderr_text(), approval), approval)
    text, error = said(gate.call(PAY, declined))
    assert error and "card declined for oli" in text
    status = status_of(gate, approval)
    assert "APPROVED and executed, and the server reported a failure: " in status
    assert "card declined for oli" in status

    paid = {"to": "pia", "amount": 3}
    approval = approval_in(expect(gate.call(PAY, paid), "PENDING_APPROVAL", is_error=False))
    approve(config, run_in_hint(gate.stderr_text(), approval), approval)
    expect_result(gate.call(PAY, paid), "paid 3.00 to pia")
    assert "APPROVED and executed, and it succeeded." in status_of(gate, approval)

    other = bankdir / "timeouts"
    other.mkdir(mode=0o700)
    config = bank(other, rules={"pay": allow(PAY_TIMEOUT)})
    gate = host(config)
    first = approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False))
    approve(config, run_in_hint(gate.stderr_text(), first), first)  # the server still blocks: times out again
    text = expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
    following = approval_in(text)
    assert following != first
    status = status_of(gate, first)
    assert ("APPROVED and executed, but it timed out before the server answered, so whether it took "
            "effect is unknown") in status
    assert "OUTCOME UNKNOWN, waiting" in status_of(gate, following)
    assert count(other) == 2


def test_repeated_unknown_reruns_keep_the_tool_blocked(bankdir):
    config = bank(bankdir, rules={"pay": allow(PAY_TIMEOUT)})
    gate = host(config)

    current = approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False))
    for paid in (2, 3):
        approve(config, run_in_hint(gate.stderr_text(), current), current)
        text = expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
        following = approval_in(text)
        assert following != current
        current = following
        assert count(bankdir) == paid
    assert only_pending(bankdir)["id"] == current

    blocked = expect(gate.call(PAY, LOU), "BLOCKED", is_error=True)
    assert current in blocked
    assert approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)) == current
    assert count(bankdir) == 3

    reject(config, run_in_hint(gate.stderr_text(), current), current)
    expect_result(gate.call(PAY, LOU), "paid 1.00 to lou")
    assert count(bankdir) == 4


def test_expiry_asks_again_rather_than_unblocks(bankdir):
    config = bank(bankdir, rules={"pay": allow(PAY_TIMEOUT)}, approval_ttl="4s")
    gate = host(config)

    first = approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False))
    wait_until_past(only_pending(bankdir)["expires_at"], 0, "the first question to expire")

    blocked = expect(gate.call(PAY, LOU), "BLOCKED", is_error=True)
    second = approval_in(blocked)
    assert second != first  # the same question asked again in a fresh run, not the tool unblocked
    assert approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)) == second
    assert only_pending(bankdir)["id"] == second

    wait_until_past(only_pending(bankdir)["expires_at"], 0, "the second question to expire")
    third = approval_in(expect(gate.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False))
    assert third not in (first, second)
    assert only_pending(bankdir)["id"] == third
    assert count(bankdir) == 1


def test_unrecorded_answer_counts_as_executed(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)
    request = {"to": "ria", "amount": 4, "mode": "deep"}

    text = expect(gate.call(PAY, request), "UNRECORDED", is_error=False)
    assert "so it executed" in text and "could not be recorded" in text and "failed" not in text
    assert count(bankdir) == 1
    duplicate = expect(gate.call(PAY, request), "DUPLICATE", is_error=True)
    assert "could not be recorded" in duplicate and "it failed" not in duplicate
    expect_result(gate.call(PAY, LOU), "paid 1.00 to lou")
    assert count(bankdir) == 2
    assert approvals(bankdir) == []

    first = all_runs(bankdir, PAY)[0]
    observation = steps(db_path(bankdir), first["id"])[0][3]
    assert observation["kind"] == "tool_error"
    assert observation["content"]["ending"] == "unrecorded"


def test_host_cancel_lets_the_call_finish(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)

    # The host gives up after 3 s (a host timeout; the SDK also sends notifications/cancelled),
    # while the payment blocks inside the server: a call cancelled before it is sent is not.
    timed_out = {"to": "kim", "amount": 7, "mode": "block"}
    pending = gate.submit(PAY, timed_out, timeout=3)
    wait_payments(bankdir, 1)
    with pytest.raises(MCPError):
        pending.result()
    release(bankdir)
    # The host cancels explicitly while the payment is inside the server.
    cancelled = {"to": "kim", "amount": 8, "mode": "slow"}
    pending = gate.submit(PAY, cancelled)
    wait_payments(bankdir, 2)
    pending.cancel()

    wait_for(lambda: [r["status"] for r in all_runs(bankdir, PAY)] == ["COMPLETED", "COMPLETED"], 30,
             message="both upstream calls to finish and be recorded")
    assert "paid 7.00 to kim" in expect(gate.call(PAY, timed_out), "DUPLICATE", is_error=True)
    assert "paid 8.00 to kim" in expect(gate.call(PAY, cancelled), "DUPLICATE", is_error=True)
    assert count(bankdir) == 2


def test_a_lost_answer_retried_pays_once_through_the_gate_and_twice_straight(bankdir):
    config = bank(bankdir, rules={"pay": allow()})
    gate = host(config)
    request = {"to": "grocer", "amount": 42, "mode": "slow"}

    with pytest.raises(MCPError):
        gate.call(PAY, request, timeout=0.3)  # the answer is lost
    retry, _ = said(gate.call(PAY, request))  # the blind retry, at once
    assert retry.startswith(("IN_PROGRESS:", "DUPLICATE:")), retry
    wait_for(lambda: [r["status"] for r in all_runs(bankdir, PAY)] == ["COMPLETED"], 30,
             message="the payment to be recorded")
    assert "paid 42.00 to grocer" in expect(gate.call(PAY, request), "DUPLICATE", is_error=True)
    assert count(bankdir) == 1

    # The same two calls straight against the server: the retry pays again.
    straight = bankdir / "straight-ledger"
    server = RawStdio(fake_argv(), env={"FAKE_PAYMENTS_LEDGER": str(straight)})
    server.initialize()
    send_call(server, 10, "pay", request)  # nobody waits for this answer: it is lost
    send_call(server, 11, "pay", request)  # the blind retry
    assert {response_text(response(server, 10)), response_text(response(server, 11))} == {"paid 42.00 to grocer"}
    assert payments(straight) == 2
    server.close()
