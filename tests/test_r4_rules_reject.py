"""The operator's no sticks on a tool whose `repeat_window` is "0s" (issue 29 item 1, SPEC
"Rules across calls span the database"): a rejection or cancellation refuses the identical
request for the config's `repeat_window`; the tool's "0s" turns off the duplicate rule only.

A real SDK host on the gate (a hold of a minute), in front of the fake payment server; the
operator's commands run in their own processes.
"""

from __future__ import annotations

from conftest import wait_for
from kit import (
    DEADLINE,
    PAY,
    approvals,
    bank,
    bankdir,  # noqa: F401 (fixture)
    count,
    expect,
    expect_result,
    host,
    operator,
    reject,
    run_in_hint,
)


def waiting_approval(gate, bankdir):
    """The id of the one approval that waits, and its run, once the gate asks."""
    pending = wait_for(lambda: approvals(bankdir, "pending"), DEADLINE,
                       message="the held call's approval")
    (approval,) = [a["id"] for a in pending]
    return approval, wait_for(lambda: run_in_hint(gate.stderr_text(), approval), DEADLINE)


def test_a_no_sticks_where_the_tools_repeat_window_is_0s(bankdir):
    config = bank(bankdir, rules={"pay": {"repeat_window": "0s", "timeout": "10s"}},
                  hold="60s")
    gate = host(config)
    rent = {"to": "landlord", "amount": 950}

    held = gate.submit(PAY, rent)
    approval, run_id = waiting_approval(gate, bankdir)
    reject(config, run_id, approval, note="not this month")
    assert "not this month" in expect(held.result(), "REJECTED", is_error=True)

    # The model's identical retry is refused with the note; nothing new is asked.
    retry = expect(gate.call(PAY, rent), "REJECTED", is_error=True)
    assert "not this month" in retry and approval in retry
    assert [a["status"] for a in approvals(bankdir)] == ["rejected"]

    # An operator's cancellation sticks the same way.
    gift = {"to": "cousin", "amount": 20}
    held = gate.submit(PAY, gift)
    approval, run_id = waiting_approval(gate, bankdir)
    operator(config, "cancel", run_id, "-note", "asked twice")
    assert "asked twice" in expect(held.result(), "REJECTED", is_error=True)
    assert "asked twice" in expect(gate.call(PAY, gift), "REJECTED", is_error=True)
    assert approvals(bankdir, "pending") == []
    assert count(bankdir) == 0

    # The duplicate rule is off: an executed request may run again.
    config = bank(bankdir, rules={"pay": {"repeat_window": "0s", "outcome": "allow"}})
    gate.close()
    gate = host(config)
    for _ in range(2):
        expect_result(gate.call(PAY, {"to": "kim", "amount": 1}), "paid 1.00 to kim")
    assert count(bankdir) == 2
