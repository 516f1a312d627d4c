"""A database written by agentgate before the policy engine (schema version 1) is migrated in
place the first time the gate starts on it: its chain still verifies and goes on from the same
head, its runs still show and re-check, and what it left open still holds (an unknown outcome
still blocks its tool and is still decided by an operator).

tests/v1_database.sql.gz is the dump of such a database, made by the agentgate of commit
6348037 in front of the fake bank: a read, a payment approved and executed, one rejected, and
one approved whose re-run timed out (its outcome unknown, a question pending). It is kept as
the dump's bytes, compressed: a record of what that version wrote, never edited, and not source
that repeats the version-1 schema agentgate.py carries.
"""

import json
from pathlib import Path

from kit import Bank, database_from_dump, operator, schema_versions, settle_old_unknown
from kit import bankdir  # noqa: F401 (fixture)

DUMP = Path(__file__).resolve().parent / "v1_database.sql.gz"


def old_database(workdir: Path) -> Path:
    return database_from_dump(workdir, DUMP)


def test_a_version_1_database_is_migrated_in_place_and_keeps_its_meaning(bankdir):
    workdir = bankdir
    path = old_database(workdir)
    bank = Bank(workdir, rules={"pay": {"timeout": "2s"}}, session="old", hold="0s")
    assert bank.db_path == path and schema_versions(path) == [1]
    old_runs = [row[0] for row in bank.query("SELECT id FROM runs ORDER BY rowid")]
    head = bank.query("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")[0]

    # Operator commands read; they do not migrate behind the gate's back.
    refused = operator(bank.config, "verify", ok=False)
    assert refused.returncode == 1 and "start the gate once to migrate it" in refused.stderr

    host = bank.start()
    host.list_tools()
    assert schema_versions(path) == [1, 2, 3, 4, 5, 6, 7]
    verified = operator(bank.config, "verify")
    assert f"intact: {head[0]} event(s), seq 1 to {head[0]}" in verified.stdout
    assert f"head: seq {head[0]} {head[1]}" in verified.stdout

    listed = {r["run"]: r for r in json.loads(operator(bank.config, "runs", "-json").stdout)}
    assert set(old_runs) <= set(listed)
    statuses = sorted(listed[run]["status"] for run in old_runs)
    assert statuses == ["CANCELLED", "COMPLETED", "COMPLETED", "WAITING_FOR_APPROVAL"], statuses
    for run in old_runs:
        shown = operator(bank.config, "show", run)
        assert f"run       {run}" in shown.stdout and "events" not in shown.stderr
    rechecked = operator(bank.config, "recheck", "-json", ok=False)
    assert rechecked.returncode == 0, rechecked.stdout + rechecked.stderr
    assert all(r["same"] for r in json.loads(rechecked.stdout))

    # The unknown outcome it left still blocks every other payment, and still waits.
    settle_old_unknown(bank, host, workdir, {run: listed[run] for run in old_runs})
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text == \
        "account A-1 holds 120.00 EUR"

    # New events chain on the old head; the whole chain verifies.
    again = operator(bank.config, "verify")
    assert "intact:" in again.stdout and f"seq 1 to {head[0]}" not in again.stdout
    assert bank.query("SELECT count(*) FROM executions")[0][0] >= 1
