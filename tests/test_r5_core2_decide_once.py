"""The policy is decided once per write, and a verdict is a value (agentgate section 8).

Specification: issue 30 item 2. A read allowed outright is decided once, before the lock (it
has no write to decide in); every other call is decided in the write transaction that acts on
the decision, once, with every fact (limits, waits, grants); a write that loses a race is the
verdict AGAIN, not an exception crossing the gate's lock.

The fake payment server is a real child process and the database a real file; the gate is
called as a Python object so its decisions can be counted.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import payments  # noqa: E402
from test_gate_inprocess import close_gate, open_gate  # noqa: E402


def count_decisions(monkeypatch):
    """Every policy decision made, each marked whether it was made inside a write."""
    made, writing = [], threading.local()
    decide, commit = agentgate.policy_decision, agentgate.Store._commit

    def counted(*args, **kw):
        made.append(getattr(writing, "on", False))
        return decide(*args, **kw)

    def committing(self, batch):
        writing.on = True
        try:
            return commit(self, batch)
        finally:
            writing.on = False

    monkeypatch.setattr(agentgate, "policy_decision", counted)
    monkeypatch.setattr(agentgate.Store, "_commit", committing)
    return made


def test_an_allowed_read_is_decided_once(workdir, monkeypatch):
    gate, upstreams, store = open_gate(workdir)
    try:
        made = count_decisions(monkeypatch)
        answer = gate.call(gate.tools["bank_balance"], agentgate.parse(b'{"account":"main"}'))
        assert answer.text.startswith("account main holds"), answer.text
        assert made == [False], made
    finally:
        close_gate(gate, upstreams, store)


def test_an_allowed_payment_is_decided_once_in_its_write(workdir, monkeypatch):
    gate, upstreams, store = open_gate(workdir, policy={"remote_mutation": "allow"})
    try:
        made = count_decisions(monkeypatch)
        answer = gate.call(gate.tools["bank_pay"], agentgate.parse(b'{"to":"kim","amount":5}'))
        assert "paid" in answer.text, answer.text
        # Judged before the lock (the conditions' work), decided in the begin's write.
        assert made.count(True) == 1, made
        assert payments(workdir / "ledger") == 1
    finally:
        close_gate(gate, upstreams, store)


def test_a_collected_approval_is_decided_once_in_its_write(workdir, monkeypatch):
    gate, upstreams, store = open_gate(workdir)
    try:
        tool, args = gate.tools["bank_pay"], agentgate.parse(b'{"to":"kim","amount":5}')
        assert gate.call(tool, args).text.startswith("PENDING_APPROVAL:")
        approval = store.read_one("SELECT id, hash FROM approvals WHERE status='pending'")
        assert store.write(lambda tx: tx.decide_approval(
            approval[0], approval[1], "approved", "operator", "ok")) == "decided"
        made = count_decisions(monkeypatch)
        answer = gate.call(tool, args)
        assert "paid" in answer.text, answer.text
        assert made.count(True) == 1, made
        assert payments(workdir / "ledger") == 1
    finally:
        close_gate(gate, upstreams, store)


def test_a_lost_race_is_the_verdict_again_under_the_lock(workdir, monkeypatch):
    gate, upstreams, store = open_gate(workdir, policy={"remote_mutation": "allow"})
    try:
        tool, args = gate.tools["bank_pay"], agentgate.parse(b'{"to":"kim","amount":5}')
        key = agentgate.request_key(tool.target, agentgate.canonical(args))
        judged, early = gate._judge(tool, args)

        def lost(*_args, **_kw):
            raise agentgate.Race()

        monkeypatch.setattr(agentgate.Tx, "begin_run", lost)
        with gate.lock:
            verdict = gate._decide(tool, args, key, judged, early, threading.Event())
        assert verdict is agentgate.AGAIN
        assert not gate.active
        monkeypatch.undo()
        # Decided again, the call runs once.
        assert "paid" in gate.call(tool, args).text
        assert payments(workdir / "ledger") == 1
    finally:
        close_gate(gate, upstreams, store)
