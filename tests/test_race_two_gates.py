"""Two gates on one database, with another gate's whole call injected between the reads a
decision makes (audit item 1).

A decision reads what it knows of a request, then begins a run. If another process begins,
executes and finishes the identical request in between, the begin must refuse and the call
be decided again: otherwise the same payment is made twice inside the repeat window. The
injection is deterministic: a store method of the first gate is wrapped so that, right after
it returns, the second gate (its own Store, its own lock, as another process would have) does
its whole part. The fake payment server is a real child process; its ledger counts payments.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import wait_for  # noqa: E402
from kit import bank_server, payments, pin, write_config  # noqa: E402


def open_gates(workdir, pay_rule, **top):
    config_path = write_config(workdir, [bank_server(workdir, rules={"pay": pay_rule})], **top)
    pin(config_path)
    config = agentgate.load_config(str(config_path))
    gates = []
    for _ in range(2):
        upstreams, tools, _ = agentgate.load_all(config)
        gates.append((agentgate.Gate(config, agentgate.Store(config.database), tools), upstreams))
    return gates


def close_gates(gates):
    for gate, upstreams in gates:
        gate.stopping.set()
        for upstream in upstreams:
            upstream.close()
        gate.store.close()


def inject_after(monkeypatch, store, method, action, when=lambda *args: True):
    """Wrap `store.method` so that `action` runs once, right after a call for which `when`
    holds has read its rows."""
    original = getattr(store, method)
    done = threading.Event()

    def wrapped(*args, **kwargs):
        rows = original(*args, **kwargs)
        if not done.is_set() and when(*args):
            done.set()
            action()
        return rows
    monkeypatch.setattr(store, method, wrapped)
    return done


def args_of(text):
    return agentgate.parse(text.encode())


@pytest.mark.parametrize("method", ["key_runs", "attempt_runs", "unsettled_runs", "unknown_for_tool"])
def test_a_payment_made_by_another_gate_between_two_reads_is_not_made_again(workdir, monkeypatch, method):
    gates = open_gates(workdir, {"side_effect": "remote_mutation", "outcome": "allow"})
    (first, _), (second, _) = gates
    try:
        rent = args_of('{"to":"landlord","amount":950}')
        answers = {}
        injected = inject_after(monkeypatch, first.store, method, lambda: answers.update(
            second=second.call(second.tools["bank_pay"], rent)))
        answers["first"] = first.call(first.tools["bank_pay"], rent)
        assert injected.is_set(), f"{method} was never read by the decision"
        assert answers["second"].text == "paid 950.00 to landlord"
        assert answers["first"].text.startswith("DUPLICATE:"), answers["first"].text
        assert payments(Path(workdir) / "ledger") == 1
    finally:
        close_gates(gates)


def interrupted_pending(store, key=None):
    return store.read("SELECT a.id FROM approvals a JOIN calls c ON c.run_id = a.run_id WHERE "
                      "a.kind='interrupted_side_effect' AND a.status='pending'" +
                      (" AND c.request_key=?" if key else ""), (key,) if key else ())


@pytest.mark.parametrize("method", ["unknown_for_tool", "open_run", "attempt_runs"])
def test_a_question_settled_by_another_gate_meanwhile_is_not_asked_again(workdir, monkeypatch, method):
    """A payment timed out (outcome unknown) and its question expired unanswered. A call of
    another payment asks the question again in a fresh run; if, between its reads, another
    gate asks it, the operator approves, and the re-run is made and succeeds, the question is
    settled: asking it again would invite a second approval of a payment already made twice."""
    gates = open_gates(workdir, {"side_effect": "remote_mutation", "outcome": "allow", "timeout": "1s"},
                       approval_ttl="2s")
    (first, _), (second, _) = gates
    ledger = Path(workdir) / "ledger"
    try:
        stuck = args_of('{"to":"plumber","amount":180,"mode":"block"}')
        pay = first.tools["bank_pay"]
        stuck_key = agentgate.request_key(getattr(pay, "target", pay.name), stuck)
        answer = first.call(first.tools["bank_pay"], stuck)
        assert answer.text.startswith("UNKNOWN_OUTCOME:"), answer.text
        Path(str(ledger) + ".release").write_text("")  # the server's own call ends; re-runs return at once
        expires = first.store.read_one("SELECT expires_at FROM approvals WHERE status='pending'")[0]
        wait_for(lambda: agentgate.now() > expires, 30, message="the question to expire")

        def settle_elsewhere():
            asked = second.call(second.tools["bank_pay"], stuck)
            assert asked.text.startswith("UNKNOWN_OUTCOME:"), asked.text
            approval_id = interrupted_pending(second.store, stuck_key)[0][0]
            shown = second.store.read_one("SELECT hash FROM approvals WHERE id=?", (approval_id,))[0]
            assert second.store.write(lambda tx: tx.decide_approval(
                approval_id, shown, "approved", "operator", "it did not go through")) == "decided"
            rerun = second.call(second.tools["bank_pay"], stuck)
            assert rerun.text == "paid 180.00 to plumber", rerun.text

        # unknown_for_tool is asked once, for the groceries; the others are watched for the
        # settled request's key.
        when = (lambda *args: True) if method == "unknown_for_tool" else \
            (lambda key: key == stuck_key)
        injected = inject_after(monkeypatch, first.store, method, settle_elsewhere, when)
        other = first.call(first.tools["bank_pay"], args_of('{"to":"grocer","amount":42}'))
        assert injected.is_set(), f"{method} was never read for the settled request"
        assert not interrupted_pending(first.store), "a settled question was asked again"
        assert not other.text.startswith("BLOCKED:"), other.text
        assert other.text == "paid 42.00 to grocer"
        assert payments(ledger) == 3  # the timed-out attempt, its approved re-run, the groceries
    finally:
        close_gates(gates)
