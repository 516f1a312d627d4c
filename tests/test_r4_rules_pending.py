"""`max_pending` bounds the waits a limit causes (issue 28 item 13): the policy is decided once
per call, in the write transaction, with the limits counted there, and whether the call needs an
operator is taken from that one decision.

A real SDK host on the gate, in front of the fake payment server.
"""

from __future__ import annotations

from kit import (
    PAY,
    allow,
    approvals,
    bank,
    bankdir,  # noqa: F401 (fixture)
    count,
    expect,
    expect_result,
    host,
)


def test_a_limit_that_asks_an_operator_is_bounded_by_max_pending(bankdir):
    limit = {"calls": 1, "per": "1h", "then": "require_approval"}
    config = bank(bankdir, rules={"pay": allow(limits=[limit])}, max_pending=1)
    gate = host(config)

    expect_result(gate.call(PAY, {"to": "ann", "amount": 1}), "paid 1.00 to ann")
    expect(gate.call(PAY, {"to": "bob", "amount": 2}), "PENDING_APPROVAL", is_error=False)
    for to in ("cy", "dee"):
        text = expect(gate.call(PAY, {"to": to, "amount": 3}), "BLOCKED", is_error=True)
        assert "1 request already waits" in text, text

    assert [a["status"] for a in approvals(bankdir)] == ["pending"]
    assert count(bankdir) == 1
