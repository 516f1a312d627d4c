"""The approval round trip, end to end: an MCP host (the SDK client) calls agentgate, the
policy asks, an operator decides in another process, the identical call collects.

Ported from the reference suite (agentrt-tests.md), proxy_test.go:
TestProxy_ApprovalRoundTrip, RepeatWindowZeroAsksAgain, ApprovedWithinTheHoldCompletesInOneCall,
CanonicalMatching, SeveralApprovalsAtOnceAndTheCap, RejectedIsNotAskedAgain,
ExpiredIsNotAskedAgain, StaleGrantExecutesNothing, PolicyChangedToDenyBeforeCollection,
ChangedFixedValueAsksAgain, RunsRecordWhatHappened, ArgumentsTheRuntimeRefusesNeverCollect;
cli_test.go TestProcess_RestartCollectsAnApprovalGrantedWhileItWasGone.

Differences on purpose: the Go tests skew a clock; agentgate has none to skew, so the TTLs and
windows here are a few seconds long and the tests wait on the system clock until the stored
time has passed. A policy change between approval and collection is a rewritten config and a
fresh agentgate process, which also shows that a later process collects earlier approvals.
The fake bank's ledger counts payments; every scenario asserts the exact count.
"""

import re
import time
from pathlib import Path

from conftest import pid_alive, wait_for
from kit import DEADLINE, Bank, event_types, open_db, seen, steps, wait_until_past

PAY_BOB = {"to": "bob", "amount": 25}


def test_approval_round_trip(workdir):
    bank = Bank(workdir)
    host = bank.start()

    first = bank.call(host, PAY_BOB)
    assert first.prefix == "PENDING_APPROVAL" and not first.is_error, first
    for fragment in ("Nothing has been executed", "Do not call this tool again until",
                     "do not try another tool", "Tell the user it is waiting, with its approval id",
                     "exactly the same arguments"):
        assert fragment in first.text, fragment
    assert bank.payments() == 0
    run, approval = bank.pending(first)
    assert run.startswith("test.")
    assert f"approve {run} -approval {approval}" in host.stderr_text()

    again = bank.call(host, PAY_BOB)
    assert again.prefix == "PENDING_APPROVAL" and again.approval_id() == approval
    assert len(bank.approvals()) == 1 and bank.payments() == 0
    listed = {r["run"]: r for r in bank.runs_json()}
    assert listed[run]["status"] == "WAITING_FOR_APPROVAL" and listed[run]["pending_approval"] == approval

    done = bank.approve(run, approval, "-note", "ok")
    assert f"approval {approval}: approved" in done.stdout
    assert bank.payments() == 0  # an approval never executes by itself
    assert bank.run(run)["status"] == "WAITING_FOR_APPROVAL"

    collected = bank.call(host, PAY_BOB)
    assert not collected.is_error and collected.text == "paid 25.00 to bob", collected
    assert bank.payments() == 1
    assert bank.run(run)["status"] == "COMPLETED"
    assert bank.approval(approval)["note"] == "ok"

    third = bank.call(host, PAY_BOB)
    assert third.prefix == "DUPLICATE" and third.is_error, third
    assert "paid 25.00 to bob" in third.text
    assert bank.payments() == 1
    assert bank.run_ids() == [run]  # the collection and the duplicate began no run


def test_repeat_window_zero_asks_again(workdir):
    bank = Bank(workdir, repeat_window="0s")
    host = bank.start()
    run, first = bank.pending(bank.call(host, PAY_BOB))
    bank.approve(run, first)
    assert bank.call(host, PAY_BOB).text == "paid 25.00 to bob"
    assert bank.payments() == 1

    again = bank.call(host, PAY_BOB)
    assert again.prefix == "PENDING_APPROVAL" and not again.is_error, again
    second = again.approval_id()
    assert second and second != first and first not in again.text
    assert bank.payments() == 1


def test_approved_within_the_hold_completes_in_one_call(workdir):
    bank = Bank(workdir, hold="20s")
    host = bank.start()
    started = time.monotonic()
    call = host.submit("bank_pay", {"to": "carol", "amount": 3}, progress=True)

    run, approval = wait_for(lambda: bank.hints() and bank.hints()[0], DEADLINE, message="the operator hint")
    # the host hears that the call is being held before the operator decides
    wait_for(lambda: call.progress, DEADLINE, message="a progress notification during the hold")
    assert not call.done()
    assert bank.payments() == 0
    bank.approve(run, approval)

    result = call.result()
    elapsed = time.monotonic() - started
    text = seen("held bank_pay carol", "\n".join(b.text for b in result.content if b.type == "text"))
    assert not result.is_error and text == "paid 3.00 to carol", text
    assert elapsed < 15
    assert bank.payments() == 1
    first = call.progress[0]
    assert first.total == 20 and 0 < first.progress <= 20
    assert first.message == "waiting for an operator's approval"
    values = [p.progress for p in call.progress]
    assert values == sorted(values)


def test_a_hold_that_runs_out_answers_pending(workdir):
    bank = Bank(workdir, hold="3s")
    host = bank.start()
    started = time.monotonic()
    answer = bank.call(host, {"to": "cid", "amount": 2}, progress=True)
    elapsed = time.monotonic() - started
    assert answer.prefix == "PENDING_APPROVAL" and not answer.is_error, answer
    assert elapsed >= 2.9
    wait_for(lambda: host.progress, DEADLINE, message="a progress notification during the hold")
    assert all(p.total == 3 and 0 < p.progress <= 3 for p in host.progress)
    values = sorted(p.progress for p in host.progress)
    assert all(b - a >= 0.9 for a, b in zip(values, values[1:]))  # about once a second, no more
    assert bank.payments() == 0

    # a call that finds the request still waiting is held again, then told the same
    again = bank.call(host, {"to": "cid", "amount": 2})
    assert again.prefix == "PENDING_APPROVAL" and again.approval_id() == answer.approval_id()
    assert len(bank.approvals()) == 1 and bank.payments() == 0


def threads(pid: int) -> int:
    """How many threads the process has (agentgate runs each tools/call in a thread of its own)."""
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def test_a_host_cancel_ends_only_the_hold(workdir):
    bank = Bank(workdir, hold="30s")
    host = bank.start()
    call = host.submit("bank_pay", {"to": "cy", "amount": 4}, progress=True)
    run, approval = wait_for(lambda: bank.hints() and bank.hints()[0], DEADLINE, message="the operator hint")
    wait_for(lambda: call.progress, DEADLINE, message="a progress notification during the hold")
    holding = threads(host.pid)
    cancelled_at = time.monotonic()
    call.cancel()  # the SDK sends notifications/cancelled for the request
    # the held call ends long before its 30s hold would have
    wait_for(lambda: threads(host.pid) < holding, DEADLINE, message="the held call to end")
    assert time.monotonic() - cancelled_at < 15

    # the request still waits for the operator; nothing ran
    status = bank.call(host, {"approval_id": approval}, tool="gate_status")
    assert "PENDING" in status.text, status
    assert bank.approval(approval)["status"] == "pending"
    assert bank.run(run)["status"] == "WAITING_FOR_APPROVAL"
    assert bank.payments() == 0

    bank.approve(run, approval)
    collected = bank.call(host, {"to": "cy", "amount": 4})
    assert collected.text == "paid 4.00 to cy", collected
    assert bank.payments() == 1


def test_canonical_matching(workdir):
    bank = Bank(workdir)
    raw = bank.raw()
    first = raw.call_bytes("bank_pay", b'{"to":"dan","amount":10}')
    _, a = bank.pending(first)

    for same in (b'{ "amount": 10, "to": "dan" }', b'{"amount":10,"to":"\\u0064an"}'):
        answer = raw.call_bytes("bank_pay", same)
        assert answer.prefix == "PENDING_APPROVAL" and answer.approval_id() == a, (same, answer)
    assert len(bank.approvals("pending")) == 1

    for other in (b'{"to":"Dan","amount":10}', b'{"to":"dan","amount":10.5}',
                  b'{"amount":10.0,"to":"dan"}', b'{"to":"dan","amount":1e1}'):
        answer = raw.call_bytes("bank_pay", other)
        assert answer.prefix == "PENDING_APPROVAL" and not answer.is_error, (other, answer)
        assert a not in answer.text and answer.approval_id(), (other, answer)
    assert len(bank.approvals("pending")) == 5
    assert len({a["id"] for a in bank.approvals()}) == 5
    assert bank.payments() == 0


def test_several_approvals_at_once_and_the_cap(workdir):
    bank = Bank(workdir, max_pending=2)
    host = bank.start()
    run_a, a = bank.pending(bank.call(host, {"to": "a", "amount": 1}))
    run_b, b = bank.pending(bank.call(host, {"to": "b", "amount": 2}))

    blocked = bank.call(host, {"to": "c", "amount": 3})
    assert blocked.prefix == "BLOCKED" and blocked.is_error, blocked
    assert "2 requests" in blocked.text
    assert len(bank.approvals()) == 2  # no approval was asked for

    balance = bank.call(host, {"account": "x"}, tool="bank_balance")
    assert not balance.is_error and balance.text == "account x holds 120.00 EUR"

    bank.approve(run_b, b)
    assert bank.call(host, {"to": "b", "amount": 2}).text == "paid 2.00 to b"
    still = bank.call(host, {"to": "a", "amount": 1})
    assert still.prefix == "PENDING_APPROVAL" and still.approval_id() == a
    bank.approve(run_a, a)
    assert bank.call(host, {"to": "a", "amount": 1}).text == "paid 1.00 to a"
    assert bank.payments() == 2

    # with nothing waiting any more, the capped request may ask
    later = bank.call(host, {"to": "c", "amount": 3})
    assert later.prefix == "PENDING_APPROVAL", later
    assert bank.payments() == 2


def test_rejected_is_not_asked_again(workdir):
    bank = Bank(workdir, repeat_window="4s")
    host = bank.start()
    eve = {"to": "eve", "amount": 900}
    run, approval = bank.pending(bank.call(host, eve))
    bank.reject(run, "not to eve\n\x1b[2Jnow\u202e")

    for _ in range(2):
        answer = bank.call(host, eve)
        assert answer.prefix == "REJECTED" and answer.is_error, answer
        assert "not to eve" in answer.text and approval in answer.text
        # the operator's note reaches the model sanitized
        assert "\x1b" not in answer.text and "\u202e" not in answer.text and "\n" not in answer.text
    assert len(bank.approvals()) == 1
    assert bank.run(run)["status"] == "CANCELLED" and bank.run(run)["reason"] == "approval_rejected"
    assert bank.payments() == 0

    wait_until_past(bank.run(run)["finished_at"], 4, "the repeat window")
    asked = bank.call(host, eve)
    assert asked.prefix == "PENDING_APPROVAL", asked
    assert asked.approval_id() != approval and len(bank.approvals()) == 2
    assert bank.payments() == 0


def test_expired_is_not_asked_again(workdir):
    bank = Bank(workdir, approval_ttl="1s")
    host = bank.start()
    fay = {"to": "fay", "amount": 4}
    run, approval = bank.pending(bank.call(host, fay))
    wait_until_past(bank.approval(approval)["expires_at"], 0, "the approval's expiry")

    for _ in range(2):
        answer = bank.call(host, fay)
        assert answer.prefix == "EXPIRED" and answer.is_error, answer
        assert approval in answer.text
    assert len(bank.approvals()) == 1
    assert bank.approval(approval)["status"] == "expired"
    assert bank.run(run)["status"] == "CANCELLED" and bank.run(run)["reason"] == "approval_expired"
    told = bank.call(host, {"approval_id": approval}, tool="gate_status")
    assert "EXPIRED" in told.text and "not executed" in told.text, told
    assert bank.payments() == 0


def test_an_expired_approval_cannot_be_approved(workdir):
    bank = Bank(workdir, approval_ttl="1s")
    host = bank.start()
    gus = {"to": "gus", "amount": 5}
    run, approval = bank.pending(bank.call(host, gus))
    wait_until_past(bank.approval(approval)["expires_at"], 0, "the approval's expiry")

    late = bank.approve(run, approval, ok=False)
    assert late.returncode == 1, late
    assert "expired" in late.stderr
    assert bank.approval(approval)["status"] != "approved"

    answer = bank.call(host, gus)
    assert answer.prefix == "EXPIRED" and answer.is_error, answer
    assert bank.payments() == 0


def test_stale_grant_executes_nothing(workdir):
    bank = Bank(workdir, grant_ttl="1s")
    host = bank.start()
    gil = {"to": "gil", "amount": 4}
    run, approval = bank.pending(bank.call(host, gil))
    bank.approve(run, approval)
    wait_until_past(bank.approval(approval)["decided_at"], 1, "the grant's lifetime")

    answer = bank.call(host, gil)
    assert answer.prefix == "EXPIRED" and answer.is_error, answer
    assert bank.approval(approval)["status"] == "expired"
    assert bank.run(run)["reason"] == "approval_expired"
    assert bank.payments() == 0


def test_policy_changed_to_deny_before_collection(workdir):
    bank = Bank(workdir)
    host = bank.start()
    hal = {"to": "hal", "amount": 4}
    run, approval = bank.pending(bank.call(host, hal))
    bank.approve(run, approval)
    host.close()

    bank.write(policy={"read_only": "allow", "remote_mutation": "deny"})
    host = bank.start()
    answer = bank.call(host, hal)
    assert answer.prefix == "DENIED" and answer.is_error, answer
    assert "remote_mutation" in answer.text
    assert bank.run(run)["status"] == "FAILED"
    assert bank.payments() == 0
    again = bank.call(host, hal)
    assert again.is_error and bank.payments() == 0


def test_changed_fixed_value_asks_again(workdir):
    bank = Bank(workdir, rules={"pay": {"fixed": {"currency": "EUR"}}})
    host = bank.start()
    ida = {"to": "ida", "amount": 4}
    run, first = bank.pending(bank.call(host, ida))
    bank.approve(run, first)
    host.close()

    bank.write(rules={"pay": {"fixed": {"currency": "USD"}}})
    host = bank.start()
    answer = bank.call(host, ida)
    assert answer.prefix == "PENDING_APPROVAL" and not answer.is_error, answer
    second = answer.approval_id()
    assert second != first and first not in answer.text
    assert bank.payments() == 0

    # the new question shows the new fixed value, and approving it pays in USD
    again_run, _ = bank.pending(answer)
    assert again_run == run
    told = bank.call(host, {"approval_id": first}, tool="gate_status")
    assert "APPROVED, and then a different approval was asked for the same call" in told.text, told
    assert second in told.text
    done = bank.approve(run, second)
    assert 'currency = "USD"' in done.stdout
    assert bank.call(host, ida).text == "paid 4.00 to ida"
    assert bank.ledger_lines() == [{"amount": 4, "currency": "USD", "to": "ida"}]


def test_arguments_are_checked_again_at_collection(workdir):
    bank = Bank(workdir)
    host = bank.start()
    vic = {"to": "vic", "amount": 3, "currency": "EUR"}
    run, approval = bank.pending(bank.call(host, vic))
    bank.approve(run, approval)
    host.close()

    bank.write(rules={"pay": {"deny": ["currency"]}})
    host = bank.start()
    answer = bank.call(host, vic)
    assert answer.prefix == "INVALID" and answer.is_error, answer
    assert "currency" in answer.text
    told = bank.call(host, {"approval_id": approval}, tool="gate_status")
    assert "APPROVED but not executed: its arguments no longer matched the tool's schema" in told.text, told
    assert bank.run(run)["status"] == "FAILED"
    assert bank.payments() == 0


def test_restart_collects_an_approval_granted_while_it_was_gone(workdir):
    bank = Bank(workdir, session="laptop")
    first = bank.start()
    nina = {"to": "nina", "amount": 12}
    answer = bank.call(first, nina)
    assert answer.prefix == "PENDING_APPROVAL", answer
    pid = first.pid
    first.close()
    assert not pid_alive(pid)
    assert "approve laptop." in first.stderr_text()

    run = bank.hints()[0][0]
    bank.approve(run, None, "-yes")  # the single pending approval of the run

    second = bank.start()
    assert second.pid != pid
    collected = bank.call(second, nina)
    assert collected.text == "paid 12.00 to nina", collected
    assert bank.payments() == 1
    assert bank.call(second, nina).prefix == "DUPLICATE"
    assert bank.payments() == 1


def test_arguments_the_runtime_refuses_never_collect(workdir):
    bank = Bank(workdir)
    raw = bank.raw()
    run, approval = bank.pending(raw.call_bytes("bank_pay", b'{"to":"bob","amount":25}'))

    invalid = raw.call_bytes("bank_pay", b'{"to":"bob","amount":0.1e-9223372036854775808}')
    assert invalid.prefix == "INVALID" and invalid.is_error, invalid
    assert len(bank.approvals("pending")) == 1
    bank.approve(run, approval)

    for refused in (b'{"to":"bob","amount":1,"amount":25}', b'{"to":"bob","amount":1e9223372036854775807}',
                    b'{"to":"bob","amount":1e-10000000}', b'{"to":"bob\\ud800","amount":25}'):
        answer = raw.call_bytes("bank_pay", refused)
        assert answer.prefix == "INVALID" and answer.is_error, (refused, answer)
        assert "paid" not in answer.text
    assert bank.payments() == 0

    collected = raw.call_bytes("bank_pay", b'{"to":"bob","amount":25}')
    assert collected.text == "paid 25.00 to bob" and not collected.is_error, collected
    assert bank.payments() == 1
    assert raw.proc.poll() is None  # still serving


def test_runs_record_what_happened(workdir):
    bank = Bank(workdir)
    host = bank.start()
    assert not bank.call(host, {"account": "z"}, tool="bank_balance").is_error
    assert bank.call(host, {"payment": "p"}, tool="bank_refund").prefix == "DENIED"
    run, approval = bank.pending(bank.call(host, {"to": "lee", "amount": 1}))
    bank.approve(run, approval)
    assert bank.call(host, {"to": "lee", "amount": 1}).text == "paid 1.00 to lee"
    assert bank.call(host, {}, tool="bank_balance").prefix == "INVALID"
    assert bank.payments() == 1

    ids = bank.run_ids()
    assert len(ids) == 4 and ids[2] == run  # the collection began no run of its own
    assert all(i.startswith("test.") for i in ids)
    assert [bank.run(i)["status"] for i in ids] == ["COMPLETED", "FAILED", "COMPLETED", "FAILED"]
    db = open_db(bank.db_path)
    try:
        allowed, denied, approved, invalid = (event_types(db, i) for i in ids)
        assert allowed == ["run.read"]  # an allowed read is recorded whole, in one event
        assert denied == ["run.created", "run.started", "step.started", "step.decided", "step.policy",
                          "step.failed", "step.started", "step.decided", "run.finished"]
        assert approved == ["run.created", "run.started", "step.started", "step.decided", "step.policy",
                            "approval.requested", "approval.decided", "run.resumed", "step.policy",
                            "step.tool_started", "step.tool_finished", "run.finished"]
        assert invalid == ["run.created", "run.started", "step.started", "step.decided", "step.failed",
                           "step.started", "step.decided", "run.finished"]
        denied_steps = steps(db, ids[1])
        assert len(denied_steps) == 2
        assert denied_steps[0][2]["origin"] == "model" and denied_steps[0][2]["kind"] == "tool_call"
        assert denied_steps[1][2]["origin"] == "operator" and denied_steps[1][2]["kind"] == "fail"
    finally:
        db.close()
