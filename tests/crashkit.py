"""Helpers for the rules-across-calls and crash-safety tests (issue 4).

Built on conftest (Host, RawStdio, wait_for) and gatekit (configs, pin, the database read
only). Everything here waits on conditions with generous deadlines; a lease is waited out by
polling until the stored `lease_expires_at` has passed, never by sleeping a guessed time.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import signal
import sqlite3
import termios
import time
from contextlib import suppress
from pathlib import Path

import pytest

import conftest
from conftest import RawStdio, agentgate_argv, pid_alive, wait_for
from gatekit import (
    agentgate,
    bank,
    cmdline,
    gate_host,
    open_db,
    payments,
    result_text,
    upstream_pids,
)

PAY = "bank_pay"
BALANCE = "bank_balance"
APPROVAL_RE = re.compile(r"approval ([0-9a-f]{32})")
HINT_RE = re.compile(r"approve (\S+) -approval ([0-9a-f]{32})\s+\(or reject\)")
# The interruption approval's capability names what became of the attempt it re-runs.
UNKNOWN_ENDINGS = ("timed_out", "no_answer", "cut_off")


# ---------------------------------------------------------------- configs and files


def allow(timeout: str = "10s", **extra) -> dict:
    """The pay rule with outcome allow (the gate executes without asking)."""
    return {"outcome": "allow", "timeout": timeout, **extra}


def make_bank(dir, pay: dict | None = None, balance: dict | None = None, **top) -> Path:
    """A pinned config with only the fake bank; `pay`/`balance` are merged into those rules."""
    rules = {}
    if pay is not None:
        rules["pay"] = pay
    if balance is not None:
        rules["balance"] = balance
    return bank(dir, rules=rules or None, **top)


def ledger(dir) -> Path:
    return Path(dir) / "ledger"


def count(dir) -> int:
    """Payments the fake bank made for this test (lines of its ledger)."""
    return payments(ledger(dir))


def release(dir) -> None:
    """Let every `block`-mode payment of this test's fake bank answer."""
    Path(f"{ledger(dir)}.release").touch()


def wait_payments(dir, n: int, timeout: float = 60) -> None:
    wait_for(lambda: count(dir) >= n, timeout, message=f"{n} payment(s) in the ledger")
    assert count(dir) == n, f"the ledger shows {count(dir)} payments, expected {n}"


# ---------------------------------------------------------------- answers


def said(result) -> tuple[str, bool]:
    """(text, isError) of an SDK CallToolResult."""
    return result_text(result), bool(result.is_error)


def expect(result, prefix: str, is_error: bool | None = None) -> str:
    """Assert the answer starts with `<prefix>:` (and its isError); return its text."""
    text, error = said(result)
    assert text.startswith(f"{prefix}:"), f"expected {prefix}, got (isError={error}): {text}"
    if is_error is not None:
        assert error is is_error, f"{prefix} should have isError={is_error}: {text}"
    return text


def expect_result(result, text: str) -> None:
    """A successful tool result with exactly this text."""
    got, error = said(result)
    assert not error and got == text, f"expected the result {text!r}, got (isError={error}): {got}"


def approval_in(text: str) -> str:
    """The approval id an answer names."""
    found = APPROVAL_RE.search(text)
    assert found, f"no approval id in: {text}"
    return found.group(1)


def run_in_hint(stderr: str, approval: str) -> str:
    """The run id of the operator hint `approve <run> -approval <approval>   (or reject)`."""
    for run, named in HINT_RE.findall(stderr):
        if named == approval:
            return run
    raise AssertionError(f"no operator hint for approval {approval} in stderr:\n{stderr}")


# ---------------------------------------------------------------- operator commands


def operator(config, *args: str):
    done = agentgate(*args, "-config", str(config))
    assert done.returncode == 0, f"agentgate {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def approve(config, run_id: str, approval: str, note: str = ""):
    extra = ("-note", note) if note else ()
    return operator(config, "approve", run_id, "-approval", approval, *extra)


def reject(config, run_id: str, approval: str, note: str = "rejected by the test's operator"):
    # SPEC.md makes -note required for reject (the model is shown it), where the reference's
    # operator may reject without one: the reference tests that reject "with no note" pass one.
    return operator(config, "reject", run_id, "-approval", approval, "-yes", "-note", note)


# ---------------------------------------------------------------- the database, read only


def db_path(dir) -> Path:
    return Path(dir) / "runs.db"


def query(dir, sql: str, args=()) -> list:
    db = open_db(db_path(dir))
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


APPROVAL_FIELDS = ("id", "run_id", "step_id", "kind", "status", "capability_json", "expires_at", "note")


def approvals(dir, status: str | None = None) -> list[dict]:
    """Approvals, oldest first (all, or those with `status`); capability parsed."""
    rows = query(dir, f"SELECT {', '.join(APPROVAL_FIELDS)} FROM approvals ORDER BY rowid")
    found = []
    for row in rows:
        entry = dict(zip(APPROVAL_FIELDS, row))
        entry["capability"] = json.loads(entry.pop("capability_json"))
        if status is None or entry["status"] == status:
            found.append(entry)
    return found


def only_pending(dir) -> dict:
    waiting = approvals(dir, "pending")
    assert len(waiting) == 1, f"expected exactly one pending approval, found {waiting}"
    return waiting[0]


RUN_FIELDS = ("id", "tool", "status", "reason", "detail", "finished_at", "lease_owner", "lease_expires_at")


def all_runs(dir, tool: str | None = None) -> list[dict]:
    rows = query(dir, f"SELECT {', '.join(RUN_FIELDS)} FROM runs ORDER BY created_at, rowid")
    return [r for r in (dict(zip(RUN_FIELDS, row)) for row in rows) if tool is None or r["tool"] == tool]


def run(dir, run_id: str) -> dict:
    rows = query(dir, f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE id=?", (run_id,))
    assert rows, f"no run {run_id}"
    return dict(zip(RUN_FIELDS, rows[0]))


def events(dir, run_id: str) -> list[str]:
    return [t for (t,) in query(dir, "SELECT type FROM events WHERE run_id=? ORDER BY seq", (run_id,))]


def step_rows(dir, run_id: str) -> list[tuple]:
    """(idx, status, decision, observation) of a run's steps, JSON parsed."""
    rows = query(dir, "SELECT idx, status, decision_json, observation_json FROM steps WHERE run_id=? ORDER BY idx",
                 (run_id,))
    return [(i, s, json.loads(d), json.loads(o) if o else None) for i, s, d, o in rows]


def stored_now() -> str:
    """Now, in the store's one time format (fixed-width UTC), so it compares as text."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def stored_later(text: str, seconds: float) -> str:
    moment = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ") + datetime.timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def epoch(text: str) -> float:
    moment = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.replace(tzinfo=datetime.timezone.utc).timestamp()


def wait_until_stored(moment: str, what: str, timeout: float = 60) -> None:
    """Poll the clock until the stored time `moment` has passed."""
    wait_for(lambda: stored_now() > moment, timeout, interval=0.05, message=what)


def wait_lease_expired(dir, run_id: str, timeout: float = 60) -> None:
    """Wait until the run's stored lease has passed (a dead owner cannot renew it)."""
    def expired():
        row = run(dir, run_id)
        return row["lease_expires_at"] == "" or row["lease_expires_at"] < stored_now()
    wait_for(expired, timeout, interval=0.05, message=f"the lease of run {run_id} to expire")


class WriteLock:
    """Hold SQLite's write lock on the gate's database (BEGIN IMMEDIATE) until closed: every
    write of the gate waits, then fails with "database is locked" after its busy timeout,
    while its reads (WAL) go on. Leaving rolls back: this connection writes nothing."""

    def __init__(self, dir):
        self.db = sqlite3.connect(str(db_path(dir)), timeout=60, isolation_level=None)

    def __enter__(self) -> "WriteLock":
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, *exc) -> None:
        with suppress(sqlite3.Error):
            self.db.execute("ROLLBACK")
        self.db.close()


# ---------------------------------------------------------------- processes


def raw_gate(config) -> RawStdio:
    """agentgate over raw pipes (for SIGKILL and signals), initialized and serving its tools."""
    raw = RawStdio(agentgate_argv("-config", str(config)))
    raw.initialize()
    listed = raw.request("tools/list", {}, timeout=120)
    assert "result" in listed, f"tools/list failed: {listed}\n{raw.stderr_text()}"
    return raw


def send_call(raw: RawStdio, ident: int, name: str, args: dict) -> None:
    """A tools/call that this test will not wait for (its gate may be killed under it)."""
    raw.send({"jsonrpc": "2.0", "id": ident, "method": "tools/call", "params": {"name": name, "arguments": args}})


def response(raw: RawStdio, ident: int, timeout: float = 60) -> dict:
    """The response with this id (also one skipped earlier; other messages are skipped)."""
    for i, message in enumerate(raw.skipped):
        if message.get("id") == ident and "method" not in message:
            return raw.skipped.pop(i)
    deadline = time.monotonic() + timeout
    while True:
        message = raw.recv(deadline - time.monotonic())
        if message.get("id") == ident and "method" not in message:
            return message
        raw.skipped.append(message)


def response_text(message: dict) -> str:
    assert "result" in message, f"not a result: {message}"
    return "\n".join(b.get("text", "") for b in message["result"].get("content", []) if b.get("type") == "text")


def fake_bank_of(gate_pid: int) -> int:
    """The pid of the fake bank a gate process started."""
    return upstream_pids(gate_pid, "fake-payments")[0]


def pipe_drained(raw: RawStdio) -> bool:
    """True once the gate has read everything written to its stdin (FIONREAD on the pipe)."""
    buf = bytearray(4)
    fcntl.ioctl(raw.proc.stdin.fileno(), termios.FIONREAD, buf)
    return int.from_bytes(buf, "little") == 0


def unread_input(pid: int) -> int:
    """Bytes waiting unread in the stdin pipe of process `pid` (a stopped server's requests)."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, buf)
        return int.from_bytes(buf, "little")
    finally:
        os.close(fd)


def bytes_written(pid: int) -> int:
    """wchar of /proc/PID/io: bytes the process has written so far (files and pipes)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar for pid {pid}")


def kill_and_reap(raw: RawStdio, sig: int = signal.SIGKILL) -> int:
    """Signal the gate and wait for it (and so for its fake bank, which dies with it)."""
    bank_pids = [p for p in conftest.children(raw.pid)]
    raw.kill(sig)
    code = raw.wait(60)
    wait_for(lambda: not any(pid_alive(p) for p in bank_pids), 30, message="the killed gate's upstreams to die")
    return code


def fake_banks(dir) -> list[int]:
    """Live fake-payments processes whose ledger is inside `dir`."""
    mark = f"FAKE_PAYMENTS_LEDGER={dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if "fake-payments" not in cmdline(pid) or not pid_alive(pid):
            continue
        with suppress(OSError):
            if any(var.startswith(mark) for var in (entry / "environ").read_bytes().split(b"\0")):
                found.append(pid)
    return found


@pytest.fixture
def bankdir(workdir):
    """The test's private directory; afterwards every blocked payment is released, every gate
    this test started is closed, and no fake bank of this test may still be running."""
    yield workdir
    release(workdir)
    for peer in list(conftest._LIVE):
        peer.close()
    try:
        wait_for(lambda: not fake_banks(workdir), 20, message="this test's fake banks to exit")
    finally:
        left = fake_banks(workdir)
        for pid in left:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"fake bank processes outlived the test: {left}"


def host(config):
    """A started SDK host on agentgate with this config, once the gate serves its tools (its
    upstreams loaded and its database open)."""
    gate = gate_host(config)
    gate.list_tools()
    return gate
