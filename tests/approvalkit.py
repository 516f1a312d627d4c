"""Helpers for the approval round-trip tests: one fake-bank scenario per test, the operator
commands as subprocesses, waiting on stored times, and a record of every text the model saw.

Every tools/call answer that goes through `Bank.call` or `RawGate.call_bytes` is kept in `SEEN`, and
every Bank is kept in `BANKS` with its paths and run ids, so a test can check that nothing the
model was shown names how to approve (test_approval_visibility.py). A test's hosts are closed
by conftest's autouse fixture. Nothing here sleeps a fixed time: waits poll a condition with a
generous deadline.
"""

from __future__ import annotations

import datetime
import json
import re
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from conftest import RawStdio, agentgate_argv, wait_for
from gatekit import agentgate, bank_server, gate_host, open_db, payments, pin, result_text, write_config

# (where, text) of every model-visible answer collected by these helpers, across test files.
SEEN: list[tuple[str, str]] = []
# Every Bank made in this session, so its paths and run ids can be looked for in SEEN.
BANKS: list = []

# The operator hint agentgate writes to stderr when an approval opens.
HINT_RE = re.compile(r"decide with: .*\bapprove (\S+) -approval ([0-9a-f]{32})\b.*\(or reject\)\s*$", re.M)
APPROVAL_ID_RE = re.compile(r"\(approval ([0-9a-f]{32})\)")
DEADLINE = 60.0  # seconds; generous for a loaded 2-core machine


def seen(where: str, text: str) -> str:
    SEEN.append((where, text))
    return text


class Answer:
    """What a tools/call returned, as the model sees it."""

    def __init__(self, text: str, is_error: bool):
        self.text, self.is_error = text, bool(is_error)

    @property
    def prefix(self) -> str:
        return self.text.split(":", 1)[0]

    def approval_id(self) -> str:
        """The approval id the prose names ('' if none)."""
        match = APPROVAL_ID_RE.search(self.text)
        return match.group(1) if match else ""

    def __repr__(self) -> str:
        return f"Answer(is_error={self.is_error}, text={self.text!r})"


class Bank:
    """A config with only the fake bank in a private work dir, pinned, plus what a test needs
    to drive it: hosts, the operator commands, the ledger and the database."""

    def __init__(self, workdir: Path, rules: dict | None = None, **top):
        self.dir = Path(workdir)
        self.ledger = self.dir / "ledger"
        self.db_path = self.dir / "runs.db"
        self.hosts: list = []
        self.config = self.write(rules, **top)
        pin(self.config)
        BANKS.append(self)

    # -- the config --------------------------------------------------------------------------

    def write(self, rules: dict | None = None, **top) -> Path:
        """(Re)write the config; a running gate keeps the one it read at start."""
        return write_config(self.dir, [bank_server(self.dir, self.ledger, rules=rules)], **top)

    # -- the host side -----------------------------------------------------------------------

    def start(self):
        host = gate_host(self.config)
        self.hosts.append(host)
        return host

    def raw(self) -> "RawGate":
        gate = RawGate(self.config)
        self.hosts.append(gate)
        return gate

    def call(self, host, args: dict | None, tool: str = "bank_pay", **kw) -> Answer:
        result = host.call(tool, args, **kw)
        text = seen(f"{tool} {args}", result_text(result))
        return Answer(text, result.is_error)

    def stderr(self) -> str:
        return "".join(host.stderr_text() for host in self.hosts)

    def hints(self) -> list[tuple[str, str]]:
        """(run id, approval id) of every operator hint the gates wrote, oldest first."""
        found = []
        for host in self.hosts:
            found += HINT_RE.findall(host.stderr_text())
        return found

    def hint_for(self, approval_id: str) -> str:
        """The run id the operator hint names for `approval_id` (waits for the line)."""
        def find():
            return next((run for run, approval in self.hints() if approval == approval_id), None)
        return wait_for(find, DEADLINE, message=f"operator hint for approval {approval_id}")

    def pending(self, answer: Answer) -> tuple[str, str]:
        """(run id, approval id) of a PENDING_APPROVAL answer, the run id from the hint only."""
        assert answer.prefix == "PENDING_APPROVAL" and not answer.is_error, answer
        approval = answer.approval_id()
        assert approval, answer
        return self.hint_for(approval), approval

    # -- the operator side -------------------------------------------------------------------

    def operator(self, command: str, *args: str, env: dict | None = None):
        return agentgate(command, *args, "-config", str(self.config), env=env)

    def approve(self, run: str, approval: str | None = None, *extra: str, ok: bool = True, env=None):
        args = [run] + (["-approval", approval] if approval else []) + list(extra)
        done = self.operator("approve", *args, env=env)
        if ok:
            assert done.returncode == 0, f"approve exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def reject(self, run: str, note: str, *extra: str, ok: bool = True):
        done = self.operator("reject", run, "-yes", "-note", note, *extra)
        if ok:
            assert done.returncode == 0, f"reject exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def cancel(self, run: str, note: str, ok: bool = True):
        done = self.operator("cancel", run, "-note", note)
        if ok:
            assert done.returncode == 0, f"cancel exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def show(self, run: str) -> dict:
        done = self.operator("show", run, "-json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def runs_json(self) -> list:
        done = self.operator("runs", "-json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    # -- what happened -----------------------------------------------------------------------

    def payments(self) -> int:
        return payments(self.ledger)

    def ledger_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.ledger.read_text().splitlines()] if self.ledger.exists() else []

    def query(self, sql: str, args=()) -> list:
        with closing(open_db(self.db_path)) as db:
            return db.execute(sql, args).fetchall()

    def approvals(self, status: str | None = None) -> list[dict]:
        names = ("id", "run_id", "step_id", "kind", "status", "created_at", "expires_at", "decided_at",
                 "decided_by", "note")
        rows = self.query(f"SELECT {', '.join(names)} FROM approvals ORDER BY rowid")
        found = [dict(zip(names, row)) for row in rows]
        return [a for a in found if status is None or a["status"] == status]

    def approval(self, approval_id: str) -> dict:
        return next(a for a in self.approvals() if a["id"] == approval_id)

    def run(self, run_id: str) -> dict:
        names = ("id", "tool", "status", "reason", "detail", "finished_at")
        row = self.query(f"SELECT {', '.join(names)} FROM runs WHERE id=?", (run_id,))
        return dict(zip(names, row[0]))

    def run_ids(self) -> list[str]:
        if not self.db_path.exists():
            return []
        return [row[0] for row in self.query("SELECT id FROM runs ORDER BY rowid")]

    def tamper(self, sql: str, args=()) -> None:
        """Change the database behind agentgate's back, as anyone with the file could."""
        with closing(sqlite3.connect(self.db_path, timeout=30)) as db:
            db.execute("PRAGMA busy_timeout=30000")
            changed = db.execute(sql, args).rowcount
            db.commit()
        assert changed == 1, f"the tampering changed {changed} rows"

    def forbidden(self) -> set[str]:
        """What no model-visible text may name: this scenario's paths and run ids."""
        return {str(self.dir), str(self.config), str(self.db_path), *self.run_ids(),
                *(run for run, _ in self.hints())}


# ---------------------------------------------------------------- times


def stored_seconds(text: str) -> float:
    """A time as agentgate stores it (UTC, microseconds, Z) as epoch seconds."""
    moment = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.replace(tzinfo=datetime.timezone.utc).timestamp()


def wait_until_past(stored: str, seconds: float = 0.0, what: str = "a stored time") -> None:
    """Poll the system clock until it is past `stored` + `seconds` (with a small margin)."""
    target = stored_seconds(stored) + seconds + 0.05
    wait_for(lambda: time.time() > target, DEADLINE + seconds, interval=0.02, message=f"the clock to pass {what}")


# ---------------------------------------------------------------- raw frames


class RawGate(RawStdio):
    """agentgate on raw stdio, for arguments the SDK cannot write (literal numbers, escapes,
    repeated keys)."""

    def __init__(self, config: Path):
        super().__init__(agentgate_argv("-config", str(config)))
        self._next = 1000
        self.initialize()

    def call_bytes(self, name: str, arguments: bytes, timeout: float = DEADLINE) -> Answer:
        """tools/call whose `arguments` are written exactly as given."""
        self._next += 1
        ident = self._next
        frame = (b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":%s,"arguments":%s}}'
                 % (ident, json.dumps(name).encode(), arguments))
        self.send(frame)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(deadline - time.monotonic())
            if reply.get("id") == ident and "method" not in reply:
                break
            self.skipped.append(reply)
        assert "result" in reply, f"JSON-RPC error for {arguments!r}: {reply}"
        result = reply["result"]
        text = "\n".join(b["text"] for b in result["content"] if b.get("type") == "text")
        return Answer(seen(f"raw {name} {arguments!r}", text), result.get("isError", False))

