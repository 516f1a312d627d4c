"""example.json, the configuration that ships beside agentgate.py, works as it is: copied with
agentgate.py into an empty directory, it pins, checks and serves the bundled fake payment
server, with the default policy (a read runs, a payment waits for an operator, a refund is
denied)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO, Host


def test_the_bundled_example_pins_checks_and_serves(workdir):
    # As the quickstart has it: agentgate.py in ~/bin, the config in a directory of its own.
    home = workdir / "home"
    (home / "bin").mkdir(parents=True)
    shutil.copy(REPO / "agentgate.py", home / "bin" / "agentgate.py")
    shutil.copy(REPO / "example.json", workdir / "example.json")
    (workdir / "example.json").chmod(0o600)
    agentgate = [sys.executable, str(home / "bin" / "agentgate.py")]
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
                 "registered refund as bank_refund (destructive)"):
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
