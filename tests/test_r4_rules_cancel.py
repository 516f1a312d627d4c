"""A call the host cancelled before it ran is never executed (issue 28 item 3): the cancellation
is read before the run begins (the call may have been judged or waited for the lock meanwhile)
and again right before the request is sent.

The hold is deterministic: the test takes the database's write lock, so the calls cannot
begin their runs; the host sends them and cancels them; a ping answered after the cancellations
shows the gate has read them; then the lock is let go. Closing the gate's input makes it finish
every call it read before it exits, so what it did is then all in the record and the ledger.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import (  # noqa: E402
    DEADLINE,
    PAY,
    all_runs,
    allow,
    approvals,
    bank,
    bankdir,  # noqa: F401 (fixture)
    count,
    db_path,
    expect_result,
    host,
    query,
    raw_gate,
    send_call,
)

KIM = {"to": "kim", "amount": 7}
REFUND = "bank_refund"


def args_of(value: dict):
    """Arguments as the gate reads them off the wire."""
    return agentgate.parse(json.dumps(value).encode())


def test_calls_cancelled_while_they_wait_never_run_and_leave_nothing_waiting(bankdir):
    config = bank(bankdir, rules={"pay": allow(), "refund": {"outcome": "require_approval"}},
                  hold="30s")
    raw = raw_gate(config)
    writer = sqlite3.connect(db_path(bankdir), timeout=DEADLINE, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        send_call(raw, 7, PAY, KIM)
        send_call(raw, 8, REFUND, {"payment": "p-1"})
        for ident in (7, 8):
            raw.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                      "params": {"requestId": ident, "reason": "the user stopped it"}})
        assert "result" in raw.request("ping", {}, timeout=DEADLINE)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    raw.proc.stdin.close()
    raw.wait(timeout=DEADLINE)
    raw.close()
    assert "could not be written" not in raw.stderr_text(), raw.stderr_text()

    assert count(bankdir) == 0
    assert approvals(bankdir) == []
    assert all_runs(bankdir, PAY) == [] and all_runs(bankdir, REFUND) == []

    # Nothing ran, so the model's retry runs as a first call would.
    gate = host(config)
    expect_result(gate.call(PAY, KIM), "paid 7.00 to kim")
    assert count(bankdir) == 1


def test_a_call_cancelled_after_its_run_began_is_not_sent_and_counts_for_nothing(bankdir):
    config_path = bank(bankdir, rules={"pay": allow(limits=[{"calls": 1, "per": "1h"}])})
    config = agentgate.load_config(str(config_path))
    upstreams, tools, _ = agentgate.load_all(config)
    gate = agentgate.Gate(config, agentgate.Store(config.database), tools)
    try:
        cancelled = threading.Event()
        write = gate.store.write

        def begin_then_cancel(fn):  # the host's cancellation arrives as the run begins
            result = write(fn)
            cancelled.set()
            return result
        gate.store.write = begin_then_cancel
        gate.call(gate.tools[PAY], args_of(KIM), cancelled=cancelled)
        gate.store.write = write
        assert count(bankdir) == 0

        (run,) = all_runs(bankdir, PAY)
        assert run["status"] == "FAILED"
        (ending,) = query(db_path(bankdir), "SELECT json_extract(observation_json, "
                          "'$.content.ending') FROM steps WHERE run_id=? AND "
                          "json_extract(decision_json, '$.kind')='tool_call'", (run["id"],))
        assert ending == ("unsent",)
        assert query(db_path(bankdir), "SELECT count(*) FROM executions") == [(0,)]

        # Neither a duplicate nor a use of the limit: the retry pays, once.
        assert gate.call(gate.tools[PAY], args_of(KIM)).text == "paid 7.00 to kim"
        assert count(bankdir) == 1
    finally:
        gate.stopping.set()
        for upstream in upstreams:
            upstream.close()
        gate.store.close()
