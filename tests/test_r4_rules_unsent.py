"""A call that failed before any byte of it reached its server executed nothing (issue 29
item 3, SPEC "Rules across calls span the database"): it counts for no duplicate and no limit,
and the retry runs normally once the server is back.

Real processes: the fake payment server behind the gate is killed with SIGKILL before the call;
a second gate on the same records (with a live server) takes the retry.
"""

from __future__ import annotations

import os
import signal

from conftest import pid_alive, wait_for
from kit import (
    DEADLINE,
    PAY,
    allow,
    approval_in,
    approve,
    approvals,
    bank,
    bankdir,  # noqa: F401 (fixture)
    count,
    expect,
    expect_result,
    fake_bank_of,
    host,
    run_in_hint,
    said,
)

RENT = {"to": "landlord", "amount": 950}


def kill_bank(gate) -> None:
    bank_pid = fake_bank_of(gate.pid)
    os.kill(bank_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(bank_pid), DEADLINE, message="the fake bank to die")


def failed_unsent(result) -> str:
    text, is_error = said(result)
    assert is_error and not text.startswith(("UNKNOWN_OUTCOME", "DUPLICATE")), text
    return text


def test_a_call_its_server_never_got_is_no_duplicate_and_uses_no_limit(bankdir):
    limit = {"calls": 1, "per": "1h", "then": "deny"}
    config = bank(bankdir, rules={"pay": allow(limits=[limit])})
    first = host(config)
    kill_bank(first)
    failed_unsent(first.call(PAY, RENT))
    assert count(bankdir) == 0

    second = host(config)
    expect_result(second.call(PAY, RENT), "paid 950.00 to landlord")
    assert "paid 950.00" in expect(second.call(PAY, RENT), "DUPLICATE", is_error=True)
    expect(second.call(PAY, {"to": "grocer", "amount": 5}), "DENIED", is_error=True)
    assert count(bankdir) == 1


def test_an_approved_call_its_server_never_got_is_asked_again_not_a_duplicate(bankdir):
    config = bank(bankdir)  # the default policy: a payment asks an operator
    first = host(config)
    approval = approval_in(expect(first.call(PAY, RENT), "PENDING_APPROVAL", is_error=False))
    kill_bank(first)
    approve(config, run_in_hint(first.stderr_text(), approval), approval)
    failed_unsent(first.call(PAY, RENT))
    assert count(bankdir) == 0

    # Nothing ran: the retry is a new request for the operator, and once approved it pays.
    second = host(config)
    again = approval_in(expect(second.call(PAY, RENT), "PENDING_APPROVAL", is_error=False))
    assert again != approval
    approve(config, run_in_hint(second.stderr_text(), again), again)
    expect_result(second.call(PAY, RENT), "paid 950.00 to landlord")
    assert count(bankdir) == 1
    assert [a["status"] for a in approvals(bankdir)] == ["approved", "approved"]
