"""The gate's own threads, driven in-process where a race needs a window held open.

These are white-box tests of one property each, beside the end-to-end suites: the fake
payment server is a real child process and the database a real file; only the gate is
called as a Python object, so a delay can be put exactly where a race would be.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import bank_server, payments, pin, write_config  # noqa: E402


def open_gate(workdir, **top):
    config_path = write_config(workdir, [bank_server(workdir)], **top)
    pin(config_path)
    config = agentgate.load_config(str(config_path))
    upstreams, tools, _ = agentgate.load_all(config)
    store = agentgate.Store(config.database)
    return agentgate.Gate(config, store, tools), upstreams, store


def close_gate(gate, upstreams, store):
    gate.stopping.set()
    for upstream in upstreams:
        upstream.close()
    store.close()


def test_a_collected_run_is_never_taken_over_by_its_own_process(workdir, monkeypatch):
    """Between collecting an approval and sending the call, an identical call must be told
    IN_PROGRESS: were the run taken over in that window, an operator would be asked to run
    again a payment that was about to be made (and then would be made twice)."""
    gate, upstreams, store = open_gate(workdir)
    try:
        tool = gate.tools["bank_pay"]
        args = agentgate.parse(b'{"to":"kim","amount":5}')
        pending = gate.call(tool, args)
        assert pending.text.startswith("PENDING_APPROVAL:")
        approval = store.read_one(
            "SELECT id, hash FROM approvals WHERE status='pending'")
        assert store.write(lambda tx: tx.decide_approval(approval[0], approval[1], "approved",
                                                         "operator", "ok")) == "decided"

        in_window = threading.Event()
        original = agentgate.Gate._execute

        def slow_execute(self, tool, verdict, progress=None, cancelled=None):
            in_window.set()
            time.sleep(0.5)  # the window between the collecting write and the upstream call
            return original(self, tool, verdict, progress, cancelled)
        monkeypatch.setattr(agentgate.Gate, "_execute", slow_execute)

        answers = {}
        collector = threading.Thread(target=lambda: answers.update(first=gate.call(tool, args)))
        collector.start()
        assert in_window.wait(30)
        second = gate.call(tool, args)
        collector.join(30)
        assert second.text.startswith("IN_PROGRESS:"), second.text
        assert answers["first"].text == "paid 5.00 to kim"
        assert payments(Path(workdir) / "ledger") == 1
        assert store.read("SELECT count(*) FROM approvals")[0][0] == 1
    finally:
        close_gate(gate, upstreams, store)


def test_a_call_is_decided_once_in_the_write_that_acts_on_it(workdir, monkeypatch):
    """The policy decides a pass once: a mutation in the transaction that records it (no
    early decision beside it, with other facts), a read with no limit before the lock,
    where rule 8 acts on it without a transaction."""
    gate, upstreams, store = open_gate(workdir)
    decided = []
    original = agentgate.evaluate

    def counted(config, tool, *rest, **kw):
        decided.append(tool.name)
        return original(config, tool, *rest, **kw)
    monkeypatch.setattr(agentgate, "evaluate", counted)
    try:
        pending = gate.call(gate.tools["bank_pay"], agentgate.parse(b'{"to":"kim","amount":5}'))
        assert pending.text.startswith("PENDING_APPROVAL:"), pending.text
        assert decided == ["bank_pay"]
        read = gate.call(gate.tools["bank_balance"], agentgate.parse(b'{"account":"A-1"}'))
        assert not read.is_error, read.text
        assert decided == ["bank_pay", "bank_balance"]
    finally:
        close_gate(gate, upstreams, store)
