"""Helpers for the re-check and audit tests (issue 5): a recorded session of real calls, clones
of its database into each test's own directory, the `recheck` and `verify` commands as
subprocesses, and an independent recomputation of the event chain.

The recorded session is made once per test module by real gate processes (the SDK host, the
fake bank behind the gate, the operator commands in their own processes); every test then
works on its own copy of the database, under a config it writes in its own directory, so no
test sees another's changes. Nothing here sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
from contextlib import closing, suppress
from pathlib import Path

import pytest

from conftest import wait_for
from crashkit import approval_in, fake_banks, run_in_hint
from gatekit import agentgate, bank_server, gate_host, open_db, pin, result_text, write_config

SESSION = "test"
OTHER_SESSION = "other"
DB = "runs.db"
MANIFESTS = ("bank.manifest.json", "vault.manifest.json")
DEADLINE = 60.0
POLICY_ID_RE = re.compile(r"agentgate/sha256:[0-9a-f]{64}")
HEX64 = re.compile(r"[0-9a-f]{64}")

# The second fake bank: its pay is allowed by its own rule, answers within 1s or is given up
# on (a "block" payment always is: its outcome is then unknown), and carries a fixed value.
VAULT_RULES = {"pay": {"outcome": "allow", "timeout": "1s", "fixed": {"currency": "EUR"}}}

# The recorded session, oldest run first: (label, tool, arguments).
KIM = {"to": "kim", "amount": 5}
REX = {"to": "rex", "amount": 3}
LIV = {"to": "liv", "amount": 7, "mode": "block"}
SESSION_RUNS = (
    ("balance", "bank_balance"),  # allowed (read_only)
    ("kim", "bank_pay"),  # pending -> approved -> collected
    ("refund", "bank_refund"),  # denied (destructive)
    ("rex", "bank_pay"),  # pending -> rejected
    ("liv", "vault_pay"),  # allowed, timed out (unknown) -> re-run approved -> paid
    ("other", "bank_balance"),  # another session on the same database
)


# ---------------------------------------------------------------- configs


def _merge(base: dict, change: dict | None) -> dict:
    rules = {tool: dict(rule) for tool, rule in base.items()}
    for tool, extra in (change or {}).items():
        if extra is None:
            rules.pop(tool, None)
        else:
            rules[tool] = {**rules.get(tool, {}), **extra}
    return rules


def audit_servers(dir, bank: dict | None = None, vault: dict | None = None, bank_fields: dict | None = None,
                  vault_fields: dict | None = None) -> list:
    """The two fake banks: "bank" (balance read_only, pay remote_mutation, refund destructive)
    and "vault" (the same, with VAULT_RULES); `bank`/`vault` merge into their rules per tool."""
    dir = Path(dir)
    return [
        bank_server(dir, dir / "ledger", rules=bank, **(bank_fields or {})),
        bank_server(dir, dir / "vault-ledger", rules=_merge(VAULT_RULES, vault), name="vault",
                    manifest="vault.manifest.json", **(vault_fields or {})),
    ]


def audit_config(dir, name: str = "agentgate.json", bank=None, vault=None, bank_fields=None, vault_fields=None,
                 **top) -> Path:
    """Write (0600) the audit config into `dir` (database runs.db, session "test", hold 0s)."""
    return write_config(dir, audit_servers(dir, bank, vault, bank_fields, vault_fields), name=name, **top)


# ---------------------------------------------------------------- the recorded session


class Recorded:
    """A directory holding a database recorded by real gates, and what the test needs of it."""

    def __init__(self, dir: Path, runs: dict):
        self.dir, self.runs = Path(dir), runs

    def clone(self, workdir, **change) -> Path:
        """Copy the database and the pins into `workdir`; write a config there (the same as
        recorded, changed by `change` as for audit_config) and return its path."""
        workdir = Path(workdir)
        for name in (DB, f"{DB}-wal", *MANIFESTS):
            if (self.dir / name).exists():
                shutil.copy2(self.dir / name, workdir / name)
        return audit_config(workdir, **change)


def _call(gate, tool: str, args: dict) -> str:
    return result_text(gate.call(tool, args))


def _expect(text: str, start: str) -> str:
    assert text.startswith(start), f"expected an answer starting {start!r}, got: {text}"
    return text


def _operator(config, *args: str) -> None:
    done = agentgate(*args, "-config", str(config))
    assert done.returncode == 0, f"agentgate {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def record_session(dir) -> Recorded:
    """Make the session of real calls the re-check and audit tests start from."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    dir.chmod(0o700)
    config = audit_config(dir)
    pin(config)
    gates = []
    try:
        gate = gate_host(config)
        gates.append(gate)
        gate.list_tools()
        _expect(_call(gate, "bank_balance", {"account": "main"}), "account main holds 120.00 EUR")

        waiting = _expect(_call(gate, "bank_pay", KIM), "PENDING_APPROVAL:")
        approval = approval_in(waiting)
        _operator(config, "approve", run_in_hint(gate.stderr_text(), approval), "-approval", approval,
                  "-note", "fine")
        _expect(_call(gate, "bank_pay", KIM), "paid 5.00 to kim")

        _expect(_call(gate, "bank_refund", {"payment": "p1"}), "DENIED:")

        waiting = _expect(_call(gate, "bank_pay", REX), "PENDING_APPROVAL:")
        approval = approval_in(waiting)
        _operator(config, "reject", run_in_hint(gate.stderr_text(), approval), "-approval", approval, "-yes",
                  "-note", "not this one")

        unknown = _expect(_call(gate, "vault_pay", LIV), "UNKNOWN_OUTCOME:")
        approval = approval_in(unknown)
        (dir / "vault-ledger.release").touch()
        _operator(config, "approve", run_in_hint(gate.stderr_text(), approval), "-approval", approval,
                  "-note", "it did not go through")
        _expect(_call(gate, "vault_pay", LIV), "paid 7.00 to liv")
        gate.close()

        other = gate_host(audit_config(dir, name="other.json", session=OTHER_SESSION))
        gates.append(other)
        _expect(_call(other, "bank_balance", {"account": "other"}), "account other holds 120.00 EUR")
        other.close()
    finally:
        (dir / "vault-ledger.release").touch()
        for gate in gates:
            gate.close()
        reap_banks(dir)
    rows = query(dir / DB, "SELECT id, tool FROM runs ORDER BY rowid")
    assert [tool for _, tool in rows] == [tool for _, tool in SESSION_RUNS], rows
    return Recorded(dir, {label: run_id for (label, _), (run_id, _) in zip(SESSION_RUNS, rows)})


def reap_banks(dir) -> None:
    """Wait for every fake bank of `dir` to exit (SIGKILL what is left after the deadline)."""
    try:
        wait_for(lambda: not fake_banks(dir), 20, message=f"the fake banks of {dir} to exit")
    finally:
        for pid in fake_banks(dir):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- operator commands


def recheck(config, *args: str):
    return agentgate("recheck", "-config", str(config), *args)


def verify(config, *args: str):
    return agentgate("verify", "-config", str(config), *args)


def recheck_json(config, *args: str) -> tuple[int, list]:
    done = recheck(config, "-json", *args)
    try:
        reports = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"recheck -json printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.returncode, reports


# ---------------------------------------------------------------- the database


def query(db_path, sql: str, args=()) -> list:
    with closing(open_db(db_path)) as db:
        return db.execute(sql, args).fetchall()


def tamper(db_path, *statements) -> None:
    """Change the database as anyone with the file could: each statement is (sql, args) and
    must change exactly one row."""
    with closing(sqlite3.connect(str(db_path), timeout=30)) as db:
        db.execute("PRAGMA busy_timeout=30000")
        for sql, args in statements:
            changed = db.execute(sql, args).rowcount
            assert changed == 1, f"{sql} changed {changed} rows"
        db.commit()


EVENT_COLUMNS = "seq, run_id, step_id, at, type, payload_json, hash"


def events(db_path) -> list[tuple]:
    """(seq, run_id, step_id, at, type, payload_json, hash) of every event, in seq order."""
    return query(db_path, f"SELECT {EVENT_COLUMNS} FROM events ORDER BY seq")


def _netstring(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"%d:%s," % (len(data), data)


def chain_hash(prev: str, seq: int, run_id: str, step_id: str, at: str, type_: str, payload: str) -> str:
    """Reference section 16, written out here independently of agentgate's code."""
    fields = (prev, str(seq), run_id, step_id, at, type_, payload)
    return hashlib.sha256(b"".join(_netstring(f) for f in fields)).hexdigest()


def assert_chained(rows) -> None:
    """Seqs are 1..n without a gap and every hash follows from the one before it."""
    prev = ""
    for want, (seq, run_id, step_id, at, type_, payload, digest) in enumerate(rows, 1):
        assert seq == want, f"seq {seq} where {want} was due"
        assert digest == chain_hash(prev, seq, run_id, step_id, at, type_, payload), f"seq {seq} does not chain"
        prev = digest


def policy_evaluations(db_path) -> list[dict]:
    """Every step.policy event with what the re-check report says of it, in seq order."""
    found, seen_steps = [], set()
    for seq, run_id, step_id, payload, idx, tool in query(
            db_path, "SELECT e.seq, e.run_id, e.step_id, e.payload_json, s.idx, r.tool FROM events e "
                     "JOIN steps s ON s.id = e.step_id JOIN runs r ON r.id = e.run_id "
                     "WHERE e.type='step.policy' ORDER BY e.seq"):
        recorded = json.loads(payload)
        found.append({"seq": seq, "run_id": run_id, "step_id": step_id, "step_index": idx, "tool": tool,
                      "on_resume": step_id in seen_steps, "outcome": recorded["outcome"],
                      "policy_id": recorded.get("policy_id", "")})
        seen_steps.add(step_id)
    return found


def report_line(mark: str, evaluation: dict, body: str) -> str:
    """One evaluation line of the text report (reference section 15)."""
    resume = " (on resume)" if evaluation["on_resume"] else ""
    return f"{mark:<9} step {evaluation['step_index']} seq {evaluation['seq']} {evaluation['tool']}{resume}: {body}"


def file_state(db_path) -> tuple[bytes, bytes]:
    """The database file's bytes and its -wal's (b"" when there is none)."""
    db_path = Path(db_path)
    wal = Path(f"{db_path}-wal")
    return db_path.read_bytes(), wal.read_bytes() if wal.exists() else b""


# ---------------------------------------------------------------- fixtures shared by recheck and verify


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One recorded session per test module; each test clones it into its own directory."""
    return record_session(tmp_path_factory.mktemp("recorded") / "session")


@pytest.fixture
def clean_banks(workdir):
    """No fake bank started in this test's directory may outlive the test."""
    yield workdir
    reap_banks(workdir)
