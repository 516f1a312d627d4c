"""The rules across calls span the database (issue 28 item 2, SPEC "Rules across calls span
the database"): init gates each host with a config and session of its own on one database.
A call in progress, an unknown outcome, the tool it blocks and a duplicate in one host's gate
are seen by the other's, for the same server and request.

Two real gates (sessions "claude-desktop" and "claude-code", one agentgate.db), each behind
the official SDK host and in front of its own fake payment server; both servers write one
ledger, the ground truth of what was paid.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from conftest import pid_alive, wait_for
from kit import (
    DEADLINE,
    PAY,
    approval_in,
    approve,
    bank_server,
    bankdir,  # noqa: F401 (fixture)
    count,
    expect,
    expect_result,
    fake_bank_of,
    host,
    query,
    pin,
    release,
    run_in_hint,
    wait_payments,
    write_config,
)

KIM = {"to": "kim", "amount": 7, "mode": "block"}
LOU = {"to": "lou", "amount": 1}


def host_config(dir, session: str):
    """A host's config as init writes it: its own session, the one database."""
    server = bank_server(dir, rules={"pay": {"outcome": "allow", "timeout": "60s"}},
                         manifest=f"{session}.manifest.json")
    config = write_config(dir, [server], name=f"{session}.json", database="agentgate.db",
                          session=session)
    pin(config)
    return config


def test_one_hosts_unknown_outcome_is_not_paid_again_from_another_host(bankdir):
    desktop_config = host_config(bankdir, "claude-desktop")
    code_config = host_config(bankdir, "claude-code")
    desktop, code = host(desktop_config), host(code_config)

    # In progress in Claude Desktop's gate: Claude Code's identical call starts nothing.
    paying = desktop.submit(PAY, KIM)
    wait_payments(bankdir, 1)
    expect(code.call(PAY, KIM), "IN_PROGRESS", is_error=False)
    assert count(bankdir) == 1

    # The server dies under it: the outcome is unknown, and an operator must decide.
    bank_pid = fake_bank_of(desktop.pid)
    os.kill(bank_pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(bank_pid), DEADLINE, message="the fake bank to die")
    approval = approval_in(expect(paying.result(), "UNKNOWN_OUTCOME", is_error=False))
    pending = query(Path(bankdir) / "agentgate.db",
                    "SELECT id, kind FROM approvals WHERE status='pending'")
    assert pending == [(approval, "interrupted_side_effect")]

    # Claude Code's identical call is not paid again: it waits for that operator's decision,
    # and every other payment of the tool is blocked there too.
    again = expect(code.call(PAY, KIM), "UNKNOWN_OUTCOME", is_error=False)
    assert approval_in(again) == approval
    assert approval in expect(code.call(PAY, LOU), "BLOCKED", is_error=True)
    assert count(bankdir) == 1

    # The operator approves the re-run; Claude Code's call collects it, once.
    release(bankdir)
    approve(desktop_config, run_in_hint(desktop.stderr_text(), approval), approval,
            note="checked: it did not go through")
    expect_result(code.call(PAY, KIM), "paid 7.00 to kim")
    assert count(bankdir) == 2

    # A duplicate within the window in one gate is refused in the other, both ways.
    assert "paid 7.00 to kim" in expect(desktop.call(PAY, KIM), "DUPLICATE", is_error=True)
    expect_result(code.call(PAY, LOU), "paid 1.00 to lou")
    assert "paid 1.00 to lou" in expect(desktop.call(PAY, LOU), "DUPLICATE", is_error=True)
    assert count(bankdir) == 3
