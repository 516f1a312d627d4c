"""example.json, the configuration that ships beside agentgate.py, works as it is: copied with
agentgate.py into an empty directory, it pins, checks and serves the bundled fake payment
server, with the default policy (a read runs, a payment waits for an operator, a refund is
denied) and the pay rule's own entries (a small payment to a known payee runs, one of 1000 or
more is refused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO, Host


def installed_example(workdir):
    """As the quickstart has it: agentgate.py in ~/bin, the config in a directory of its
    own; (home, the agentgate argv)."""
    home = workdir / "home"
    (home / "bin").mkdir(parents=True)
    shutil.copy(REPO / "agentgate.py", home / "bin" / "agentgate.py")
    shutil.copy(REPO / "example.json", workdir / "example.json")
    (workdir / "example.json").chmod(0o600)
    return home, [sys.executable, str(home / "bin" / "agentgate.py")]


def test_the_bundled_example_pins_checks_and_serves(workdir):
    home, agentgate = installed_example(workdir)
    environ = {**os.environ, "HOME": str(home)}

    pinned = subprocess.run([*agentgate, "pin", "-config", "example.json"], cwd=workdir,
                            capture_output=True, text=True, timeout=120, env=environ)
    assert pinned.returncode == 0, pinned.stderr
    assert "3 tools pinned" in pinned.stdout
    checked = subprocess.run([*agentgate, "check", "-config", "example.json"], cwd=workdir,
                             capture_output=True, text=True, timeout=120, env=environ)
    assert checked.returncode == 0, checked.stderr
    for line in ("registered balance as bank_balance (read_only)",
                 "registered pay as bank_pay (remote_mutation)",
                 "registered refund as bank_refund (destructive)",
                 "when[0]: if /amount is at least 0.01 and is at most 50.00 and /to is one of [\"landlord\",\"grocer\"]"
                 " -> allow (a small payment to a known payee)",
                 "limits[0]: a sum of /amount of at most 100.00 for bank_pay per 24h0m0s, then "
                 "require_approval",
                 "limits[1]: at most 5 calls to bank_pay per 1h0m0s, then deny"):
        assert line in checked.stdout, checked.stdout

    ledger = workdir / "ledger"
    with Host([*agentgate, "-config", "example.json"], cwd=str(workdir),
              env={"FAKE_PAYMENTS_LEDGER": str(ledger), "HOME": str(home)}) as host:
        names = [tool.name for tool in host.list_tools()]
        assert names == ["bank_balance", "bank_pay", "bank_refund", "gate_status"]
        assert host.call_text("bank_balance", {"account": "A-1"}) == \
            "account A-1 holds 120.00 EUR"
        assert host.call_text("bank_pay", {"to": "bob", "amount": 5}).startswith(
            "PENDING_APPROVAL:")
        assert host.call_text("bank_refund", {"payment": "p"}).startswith("DENIED:")
        assert not ledger.exists() or ledger.read_text() == ""
        assert host.call_text("bank_pay", {"to": "landlord", "amount": 20}) == \
            "paid 20.00 to landlord"
        assert host.call_text("bank_pay", {"to": "landlord", "amount": 1000}) == (
            "DENIED: The policy does not allow this request: payments of 1000 or more are made "
            "by hand. Nothing was executed.")
    assert len(ledger.read_text().splitlines()) == 1
