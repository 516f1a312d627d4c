"""Three small edges (issue 28, item 18): `verify -json` prints JSON only; a migrated
version-1 database's executions count toward the limits; example.json's payment completes
without FAKE_PAYMENTS_LEDGER set.

Specification: README (operator commands take -json; limits count a tool's executions, those
recorded by an older agentgate too; example.json works as shipped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import Host
from test_example import installed_example
from kit import (Bank, bank, database_from_dump, gate_host, result_text, run_to_end, tamper,
                 verify)
from kit import bankdir, clean_banks  # noqa: F401 (fixtures)

DUMP = Path(__file__).resolve().parent / "v1_database.sql.gz"
FOREVER = "876000h"  # a window reaching back past the dump's calls, whenever this runs


def verified(config, *args) -> tuple[int, dict]:
    done = verify(config, "-json", *args)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"verify -json printed more than JSON:\n{done.stdout}\n{done.stderr}")


def test_verify_json_prints_json_only(clean_banks):
    workdir = clean_banks
    config = bank(workdir)
    with gate_host(config) as host:
        assert result_text(host.call("bank_balance", {"account": "a"})).startswith("account a")
    code, report = verified(config)
    head = report["head"]
    assert code == 0 and report["intact"] and report["break"] is None, report
    assert report["checked"] == head["seq"] == report["to"] and report["last_hash"] == head["hash"]
    code, kept = verified(config, "-head", f"{head['seq']}:{head['hash']}")
    assert code == 0 and kept["kept_head"] == {"seq": head["seq"], "is": "matches"}, kept
    code, short = verified(config, "-to", str(head["seq"] + 5))
    assert code == 1 and short["ends_before_to"] is True, short
    tamper(workdir / "runs.db", ("UPDATE events SET payload_json=? WHERE seq=?",
                                 ('{"forged":"\\u001b[31m"}', head["seq"])))
    code, broken = verified(config, "-head", f"{head['seq']}:{head['hash']}")
    assert code == 1 and not broken["intact"], broken
    assert broken["break"]["seq"] == head["seq"] and broken["break"]["found"] == head["hash"]
    assert broken["kept_head"]["is"] == "changed"


def test_a_migrated_databases_executions_count_toward_the_limits(bankdir):
    workdir = bankdir
    path = database_from_dump(workdir, DUMP)
    limits = {"balance": {"limits": [{"calls": 1, "per": FOREVER, "then": "deny"}]}}
    old = Bank(workdir, rules=limits, session="old", hold="0s")
    host = old.start()
    host.list_tools()
    # The dump made one read and two payments (one of them of unknown outcome).
    rows = old.query("SELECT tool FROM executions ORDER BY id")
    assert [tool for (tool,) in rows] == ["bank/balance", "bank/pay", "bank/pay"], rows
    refused = old.call(host, {"account": "A-1"}, tool="bank_balance")
    assert refused.prefix == "DENIED" and refused.is_error, refused
    assert "a limit is reached: at most 1 call to bank_balance" in refused.text, refused
    # Freed a window after the dump's own read (2026-12-01T04:08:55Z), not after any new one.
    assert "it frees up at 2126-11-07T04:08:5" in refused.text, refused
    assert path == old.db_path


def test_example_json_pays_without_a_ledger_set(workdir):
    home, agentgate = installed_example(workdir)
    environ = {k: v for k, v in os.environ.items() if k != "FAKE_PAYMENTS_LEDGER"}
    pinned = run_to_end([*agentgate, "pin", "-config", "example.json"],
                        {**environ, "HOME": str(home)}, workdir, 120)
    assert pinned.returncode == 0, pinned.stderr
    with Host([*agentgate, "-config", "example.json"], cwd=str(workdir),
              env={"HOME": str(home)}) as host:
        assert host.call_text("bank_pay", {"to": "grocer", "amount": 12.5}) == \
            "paid 12.50 to grocer"
