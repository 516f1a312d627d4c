"""The test harness for agentgate scenarios: configs, the fake bank, the scripted server, the
operator commands, the database read only, stored times, processes, raw stdio, the approval
scenarios (Bank) and the recorded session the re-check and audit tests start from.

Built on conftest (Host, RawStdio, wait_for and the autouse fixtures); kept out of it so other
test writers' fixtures do not clash with these. Test modules import the fixtures below by name
(bankdir, recorded, clean_banks). Everything here is synchronous and waits on conditions with
generous deadlines; nothing sleeps a fixed time (a stored time is waited out by polling the clock).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import http.server
import json
import os
import queue
import re
import shutil
import signal
import gzip
import sqlite3
import subprocess
import sys
import termios
import threading
import time
from contextlib import closing, suppress
from pathlib import Path

import pytest

import conftest
from conftest import AGENTGATE, Host, RawStdio, agentgate_argv, children, fake_argv, pid_alive, wait_for

SCRIPTED = Path(__file__).resolve().parent / "scripted_server.py"
CONFIG = "agentgate.json"
DB = "runs.db"
SESSION = "test"
OTHER_SESSION = "other"
DEADLINE = 60.0  # seconds; generous for a loaded 2-core machine
PAY = "bank_pay"
BALANCE = "bank_balance"

# Any approval id a text names, and the "(approval <id>)" an answer's prose names.
APPROVAL_RE = re.compile(r"approval ([0-9a-f]{32})")
APPROVAL_ID_RE = re.compile(r"\(approval ([0-9a-f]{32})\)")
# The operator hint agentgate writes to stderr when an approval opens: (run id, approval id).
HINT_RE = re.compile(r"decide with: .*\bapprove (\S+) -approval ([0-9a-f]{32})\b.*\(or reject\)\s*$", re.M)
POLICY_ID_RE = re.compile(r"agentgate/sha256:[0-9a-f]{64}")
HEX64 = re.compile(r"[0-9a-f]{64}")
STORED_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


# ---------------------------------------------------------------- servers that listen


class Listening:
    """A child in its own process group that prints `port N` once it listens on 127.0.0.1;
    `url` is its MCP endpoint there. Its stderr goes to the file `stderr`, shown if it fails."""

    def __init__(self, argv: list, stderr: Path, env: dict | None = None):
        self.stderr = stderr
        with open(stderr, "wb") as errors:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=errors, start_new_session=True,
                                         env=None if env is None else {**os.environ, **env})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=DEADLINE).decode()
        except queue.Empty:
            line = ""
        if not line.startswith("port "):
            self.stop()
            raise AssertionError(f"{argv[1]} did not listen: {line!r}\n{stderr.read_text()}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}/mcp"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=DEADLINE)

    def stop(self) -> None:
        self.kill()
        self.proc.stdout.close()


def loopback_http(handler) -> tuple:
    """An HTTP server of `handler` (a BaseHTTPRequestHandler class) on 127.0.0.1, serving on a
    daemon thread: (the server, its MCP url). The caller shuts it down."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/mcp"


# ---------------------------------------------------------------- files and configs


def write_private(path, text: str) -> Path:
    """Write `text` to `path` with mode 0600 (config and manifests must not be writable by others)."""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return path


def write_config(dir, servers, name: str = CONFIG, **top) -> Path:
    """Write a 0600 config in `dir`: database runs.db, session "test", hold 0s, then `top`."""
    config = {"database": DB, "session": SESSION, "hold": "0s", **top, "servers": list(servers)}
    return write_private(Path(dir) / name, json.dumps(config, indent=2, ensure_ascii=False))


def rule(side_effect: str, timeout: str | None = "10s", **extra) -> dict:
    """One rule; timeout None leaves it out."""
    entry = {"side_effect": side_effect, **extra}
    if timeout is not None:
        entry["timeout"] = timeout
    return entry


def allow(timeout: str = "10s", **extra) -> dict:
    """The pay rule with outcome allow (the gate executes without asking)."""
    return {"outcome": "allow", "timeout": timeout, **extra}


def merge_rules(base: dict, change: dict | None) -> dict:
    """`base` with `change` merged in per tool (a tool mapped to None loses its rule)."""
    rules = {tool: dict(entry) for tool, entry in base.items()}
    for tool, extra in (change or {}).items():
        if extra is None:
            rules.pop(tool, None)
        else:
            rules[tool] = {**rules.get(tool, {}), **extra}
    return rules


def bank_server(dir, ledger=None, rules: dict | None = None, **fields) -> dict:
    """The fake payment server as a config entry: balance read_only, pay remote_mutation,
    refund destructive (each 10s). `rules` maps a tool to extra rule fields, or to None to drop
    its rule; `fields` replace server fields."""
    ledger = Path(ledger) if ledger else Path(dir) / "ledger"
    defaults = {"balance": rule("read_only"), "pay": rule("remote_mutation"), "refund": rule("destructive")}
    server = {
        "name": "bank",
        "command": fake_argv(),
        "env": [f"FAKE_PAYMENTS_LEDGER={ledger}"],
        "manifest": "bank.manifest.json",
        "rules": merge_rules(defaults, rules),
    }
    server.update(fields)
    return server


def bank(dir, rules: dict | None = None, server: dict | None = None, **top) -> Path:
    """Write a config with only the fake bank, pin it, return the config path."""
    config = write_config(dir, [bank_server(dir, rules=rules, **(server or {}))], **top)
    pin(config)
    return config


def write_spec(path, spec: dict) -> Path:
    """(Re)write a scripted server's spec; the next process started reads it."""
    return write_private(path, json.dumps(spec))


def scripted_server(dir, spec: dict, name: str = "fs", rules: dict | None = None, **fields) -> dict:
    """A config entry for tests/scripted_server.py with `spec` (written to <dir>/<name>.spec.json)."""
    spec_path = write_spec(Path(dir) / f"{name}.spec.json", spec)
    server = {
        "name": name,
        "command": [sys.executable, str(SCRIPTED), str(spec_path)],
        "manifest": f"{name}.manifest.json",
        "rules": rules or {},
    }
    server.update(fields)
    return server


def tool(name: str, schema: dict | None = None, description: str | None = None,
         annotations: dict | None = None) -> dict:
    """A tool as a server lists it."""
    entry = {"name": name, "description": f"The {name} tool." if description is None else description,
             "inputSchema": schema if schema is not None else {"type": "object"}}
    if annotations is not None:
        entry["annotations"] = annotations
    return entry


READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
WRITE_SCHEMA = {"type": "object", "required": ["path", "text"],
                "properties": {"path": {"type": "string"}, "text": {"type": "string"},
                               "force": {"type": "boolean"}}}
ROOT_SCHEMA = {"type": "object", "required": ["path", "root"],
               "properties": {"path": {"type": "string"}, "root": {"type": "string"}}}


def fs_tools(read: dict | None = None, write: dict | None = None) -> list:
    """read_file (readOnlyHint) and write_file (no annotations), as the reference's fixture."""
    return [
        {**tool("read_file", READ_SCHEMA, "Read a file.", {"readOnlyHint": True}), **(read or {})},
        {**tool("write_file", WRITE_SCHEMA, "Write a file."), **(write or {})},
    ]


def read_manifest(path) -> dict:
    """A pinned manifest, parsed."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def records(path) -> list:
    """A JSON-lines file (the scripted server's record, the fake bank's ledger) as a list ([] when absent)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------- running agentgate and the operator commands


def agentgate(*args: str, env: dict | None = None, cwd=None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    """Run an agentgate command to completion; `env` is merged over ours (None deletes a name)."""
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return run_to_end(agentgate_argv(*args), environ, cwd, timeout)


def run_to_end(argv, env, cwd, timeout: float) -> subprocess.CompletedProcess:
    """Run a command in its own process group to completion; on timeout kill the group and
    fail the test with what it wrote to stderr."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, argv))} did not finish in {timeout}s; stderr:\n"
                             f"{err.decode(errors='replace')}")
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode("utf-8", "replace"),
                                       err.decode("utf-8", "replace"))


def pin(config, **kw) -> subprocess.CompletedProcess:
    """`agentgate.py pin -config <config>`, which must exit 0."""
    done = agentgate("pin", "-config", str(config), **kw)
    assert done.returncode == 0, f"pin exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def check(config, **kw) -> subprocess.CompletedProcess:
    """`agentgate.py check -config <config>` (exit status not asserted)."""
    return agentgate("check", "-config", str(config), **kw)


def operator(config, *args: str, ok: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`agentgate.py <args> -config <config>`; with `ok`, it must exit 0."""
    done = agentgate(*args, "-config", str(config), env=env)
    if ok:
        assert done.returncode == 0, \
            f"agentgate {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def approve(config, run_id: str, approval: str, note: str = "") -> subprocess.CompletedProcess:
    """`approve <run> -approval <approval>` (with -note if given), which must exit 0."""
    extra = ("-note", note) if note else ()
    return operator(config, "approve", run_id, "-approval", approval, *extra)


def reject(config, run_id: str, approval: str, note: str = "rejected by the test's operator"):
    """`reject <run> -approval <approval> -yes -note <note>`, which must exit 0."""
    # SPEC.md makes -note required for reject (the model is shown it), where the reference's
    # operator may reject without one: the reference tests that reject "with no note" pass one.
    return operator(config, "reject", run_id, "-approval", approval, "-yes", "-note", note)


def recheck(config, *args: str) -> subprocess.CompletedProcess:
    """`agentgate.py recheck -config <config> <args>` (exit status not asserted)."""
    return agentgate("recheck", "-config", str(config), *args)


def verify(config, *args: str) -> subprocess.CompletedProcess:
    """`agentgate.py verify -config <config> <args>` (exit status not asserted)."""
    return agentgate("verify", "-config", str(config), *args)


def recheck_json(config, *args: str) -> tuple[int, list]:
    """(exit status, parsed reports) of `recheck -json`."""
    done = recheck(config, "-json", *args)
    try:
        reports = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"recheck -json printed no JSON (exit {done.returncode}):\n"
                             f"{done.stdout}\n{done.stderr}")
    return done.returncode, reports


# ---------------------------------------------------------------- hosts and what they were answered


def gate_host(config, env: dict | None = None, mode: str = "auto", **kw) -> Host:
    """A started Host (the SDK client) for `agentgate.py -config <config>`."""
    return Host(agentgate_argv("-config", str(config)), env=env, mode=mode, **kw).start()


def host(config) -> Host:
    """A started SDK host on agentgate with this config, once the gate serves its tools (its
    upstreams loaded and its database open)."""
    gate = gate_host(config)
    gate.list_tools()
    return gate


def result_text(result) -> str:
    """Newline-joined text blocks of an SDK CallToolResult."""
    return "\n".join(block.text for block in result.content if block.type == "text")


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


def expect_start(result, start: str) -> str:
    """Assert the answer's text starts with `start` (whatever its isError); return the text."""
    text = result_text(result)
    assert text.startswith(start), f"expected an answer starting {start!r}, got: {text}"
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
    for run_id, named in HINT_RE.findall(stderr):
        if named == approval:
            return run_id
    raise AssertionError(f"no operator hint for approval {approval} in stderr:\n{stderr}")


def has_raw_controls(text: str) -> str:
    """The first character a terminal would act on (C0/C1 controls except LF/TAB, DEL, bidi and
    zero-width format characters), or ''."""
    for ch in text:
        code = ord(ch)
        if (code < 0x20 and ch not in "\n\t") or 0x7F <= code <= 0x9F or 0x200B <= code <= 0x200F \
                or 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069 or code == 0xFEFF:
            return ch
    return ""


# ---------------------------------------------------------------- raw stdio


def raw_gate(config) -> RawStdio:
    """agentgate over raw pipes (for SIGKILL and signals), initialized and serving its tools."""
    raw = RawStdio(agentgate_argv("-config", str(config)))
    raw.initialize()
    listed = raw.request("tools/list", {}, timeout=120)
    assert "result" in listed, f"tools/list failed: {listed}\n{raw.stderr_text()}"
    return raw


def send_call(raw: RawStdio, ident: int, name: str, args: dict) -> None:
    """A tools/call that this test will not wait for (its gate may be killed under it)."""
    raw.send({"jsonrpc": "2.0", "id": ident, "method": "tools/call",
              "params": {"name": name, "arguments": args}})


def response(raw: RawStdio, ident: int, timeout: float = 60) -> dict:
    """The response with this id (also one skipped earlier; other messages are skipped)."""
    return raw.response(ident, timeout)


def response_text(message: dict) -> str:
    """Newline-joined text blocks of a tools/call response (which must be a result)."""
    assert "result" in message, f"not a result: {message}"
    blocks = message["result"].get("content", [])
    return "\n".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def pipe_drained(raw: RawStdio) -> bool:
    """True once the gate has read everything written to its stdin (FIONREAD on the pipe)."""
    buf = bytearray(4)
    fcntl.ioctl(raw.proc.stdin.fileno(), termios.FIONREAD, buf)
    return int.from_bytes(buf, "little") == 0


# ---------------------------------------------------------------- the fake bank's ledger


def ledger(dir) -> Path:
    """The fake bank's ledger in `dir` (one line a payment)."""
    return Path(dir) / "ledger"


def payments(ledger) -> int:
    """How many payments the fake server made (one ledger line each)."""
    path = Path(ledger)
    return len(path.read_text().splitlines()) if path.exists() else 0


def count(dir) -> int:
    """Payments the fake bank made for this test (lines of its ledger in `dir`)."""
    return payments(ledger(dir))


def release(dir) -> None:
    """Let every `block`-mode payment of this test's fake bank answer."""
    Path(f"{ledger(dir)}.release").touch()


def wait_payments(dir, n: int, timeout: float = 60) -> None:
    """Wait until the ledger in `dir` shows `n` payments, and no more."""
    wait_for(lambda: count(dir) >= n, timeout, message=f"{n} payment(s) in the ledger")
    assert count(dir) == n, f"the ledger shows {count(dir)} payments, expected {n}"


# ---------------------------------------------------------------- the database


def db_path(dir) -> Path:
    """The database file of a config written in `dir`."""
    return Path(dir) / DB


def open_db(path) -> sqlite3.Connection:
    """A read-only connection to agentgate's database."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    db.execute("PRAGMA busy_timeout=30000")
    return db


def query(db, sql: str, args=()) -> list:
    """The rows of `sql` on `db`: an open connection, or a database file (read through its own)."""
    if isinstance(db, sqlite3.Connection):
        return db.execute(sql, args).fetchall()
    with closing(open_db(db)) as conn:
        return conn.execute(sql, args).fetchall()


def run_rows(db) -> list:
    """(id, tool, status, reason, detail) of every run, oldest first."""
    return query(db, "SELECT id, tool, status, reason, detail FROM runs ORDER BY created_at, rowid")


def database_from_dump(workdir: Path, dump: Path) -> Path:
    """runs.db in `workdir`, made from a gzipped SQL dump of a database an earlier agentgate
    wrote (kept compressed: a record of what that version wrote, not source that repeats its
    schema)."""
    path = workdir / "runs.db"
    db = sqlite3.connect(path)
    db.executescript(gzip.decompress(dump.read_bytes()).decode("utf-8"))
    # A dump's waiting approvals expire a day after it was made; keep them
    # waiting, or a test of it would pass or fail by the day it runs.
    # (The expiry is no part of an approval's hash.)
    with db:
        db.execute("UPDATE approvals SET expires_at = ? WHERE status = 'pending'",
                   ("2999-01-01T00:00:00.000000Z",))
    db.close()
    path.chmod(0o600)
    return path


def schema_versions(path) -> list[int]:
    """The migrations a database records, in order."""
    db = sqlite3.connect(path)
    try:
        return [row[0] for row in db.execute("SELECT version FROM schema_migrations ORDER BY 1")]
    finally:
        db.close()


def settle_old_unknown(bank, host, workdir, runs: dict) -> str:
    """An old database's payment with an unknown outcome, still waiting: it blocks another
    payment, its own request is told UNKNOWN_OUTCOME, and once the bank is released and an
    operator approves, it pays. `runs` maps the old runs to their `runs -json` rows; the
    run's id is returned."""
    blocked = bank.call(host, {"to": "lou", "amount": 1})
    assert blocked.prefix == "BLOCKED", blocked
    kim = {"to": "kim", "amount": 1, "mode": "block"}
    waiting = bank.call(host, kim)
    assert waiting.prefix == "UNKNOWN_OUTCOME", waiting
    (unknown,) = [run for run, row in runs.items() if row["status"] == "WAITING_FOR_APPROVAL"]
    release(workdir)
    bank.approve(unknown, waiting.approval_id())
    assert bank.call(host, kim).text == "paid 1.00 to kim"
    return unknown


def event_types(db, run_id: str) -> list:
    """The event types of one run, in order, each part of a combined event (a call's begin or
    end, chained as one event) by its own type."""
    return [part[0] for t, s, p in query(db, "SELECT type, step_id, payload_json FROM events WHERE run_id=? "
                                             "ORDER BY seq", (run_id,)) for part in event_parts(t, s, p)]


COMBINED_EVENTS = ("call.began", "call.changed", "call.ended")


def event_parts(type_: str, step_id: str, payload_json: str) -> list:
    """A stored event as the [type, step_id, payload] parts it records: a combined event's parts, any
    other event as itself."""
    payload = json.loads(payload_json)
    return payload["parts"] if type_ in COMBINED_EVENTS else [[type_, step_id, payload]]


def steps(db, run_id: str) -> list:
    """(idx, status, decision, observation) of a run's steps, decisions and observations parsed."""
    rows = query(db, "SELECT idx, status, decision_json, observation_json FROM steps WHERE run_id=? "
                     "ORDER BY idx", (run_id,))
    return [(i, s, json.loads(d), json.loads(o) if o else None) for i, s, d, o in rows]


EVENT_COLUMNS = "seq, run_id, step_id, at, type, payload_json, hash"


def event_rows(db) -> list[tuple]:
    """(seq, run_id, step_id, at, type, payload_json, hash) of every event, in seq order."""
    return query(db, f"SELECT {EVENT_COLUMNS} FROM events ORDER BY seq")


APPROVAL_FIELDS = ("id", "run_id", "step_id", "kind", "status", "capability_json", "created_at", "expires_at",
                   "decided_at", "decided_by", "note")


def approvals(dir, status: str | None = None) -> list[dict]:
    """Approvals in `dir`'s database, oldest first (all, or those with `status`); capability parsed."""
    rows = query(db_path(dir), f"SELECT {', '.join(APPROVAL_FIELDS)} FROM approvals ORDER BY rowid")
    found = []
    for row in rows:
        entry = dict(zip(APPROVAL_FIELDS, row))
        capability = entry.pop("capability_json")
        entry["capability"] = json.loads(capability) if capability else None
        if status is None or entry["status"] == status:
            found.append(entry)
    return found


def only_pending(dir) -> dict:
    """The one pending approval in `dir`'s database."""
    waiting = approvals(dir, "pending")
    assert len(waiting) == 1, f"expected exactly one pending approval, found {waiting}"
    return waiting[0]


RUN_FIELDS = ("id", "tool", "status", "reason", "detail", "finished_at", "lease_owner", "lease_expires_at")


def all_runs(dir, tool: str | None = None) -> list[dict]:
    """Runs in `dir`'s database as dicts, oldest first (all, or those of `tool`)."""
    rows = query(db_path(dir), f"SELECT {', '.join(RUN_FIELDS)} FROM runs ORDER BY created_at, rowid")
    return [r for r in (dict(zip(RUN_FIELDS, row)) for row in rows) if tool is None or r["tool"] == tool]


def run(dir, run_id: str) -> dict:
    """One run in `dir`'s database, as a dict."""
    rows = query(db_path(dir), f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE id=?", (run_id,))
    assert rows, f"no run {run_id}"
    return dict(zip(RUN_FIELDS, rows[0]))


def tamper(db, *statements) -> None:
    """Change the database file as anyone with it could: each statement is (sql, args) and
    must change exactly one row."""
    with closing(sqlite3.connect(str(db), timeout=30)) as conn:
        conn.execute("PRAGMA busy_timeout=30000")
        for sql, args in statements:
            changed = conn.execute(sql, args).rowcount
            assert changed == 1, f"{sql} changed {changed} rows"
        conn.commit()


def file_state(db) -> tuple[bytes, bytes]:
    """The database file's bytes and its -wal's (b"" when there is none)."""
    db = Path(db)
    wal = Path(f"{db}-wal")
    return db.read_bytes(), wal.read_bytes() if wal.exists() else b""


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


# ---------------------------------------------------------------- stored times


def stored_now() -> str:
    """Now, in the store's one time format (fixed-width UTC), so it compares as text."""
    return datetime.datetime.now(datetime.timezone.utc).strftime(STORED_TIME)


def stored_seconds(text: str) -> float:
    """A time as agentgate stores it (UTC, microseconds, Z) as epoch seconds."""
    moment = datetime.datetime.strptime(text, STORED_TIME)
    return moment.replace(tzinfo=datetime.timezone.utc).timestamp()


def wait_until_past(stored: str, seconds: float = 0.0, what: str = "a stored time") -> None:
    """Poll the system clock until it is past `stored` + `seconds` (with a small margin)."""
    target = stored_seconds(stored) + seconds + 0.05
    wait_for(lambda: time.time() > target, DEADLINE + seconds, interval=0.02,
             message=f"the clock to pass {what}")


def wait_lease_expired(dir, run_id: str, timeout: float = 60) -> None:
    """Wait until the run's stored lease has passed (a dead owner cannot renew it)."""
    def expired():
        row = run(dir, run_id)
        return row["lease_expires_at"] == "" or row["lease_expires_at"] < stored_now()
    wait_for(expired, timeout, interval=0.05, message=f"the lease of run {run_id} to expire")


# ---------------------------------------------------------------- processes


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ('' once it is gone)."""
    with suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def live_pids(matches) -> list[int]:
    """Live processes other than this one for which `matches(pid)` is true."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if matches(pid) and pid_alive(pid):
                found.append(pid)
    return found


def _mentions(pid: int, needle: bytes) -> bool:
    for part in ("cmdline", "environ"):
        with suppress(OSError):
            if needle in Path(f"/proc/{pid}/{part}").read_bytes():
                return True
    return False


def no_process_mentions(text: str) -> bool:
    """True when no live process has `text` in its command line or environment."""
    needle = text.encode()
    return not live_pids(lambda pid: _mentions(pid, needle))


def wait_no_process(path) -> None:
    """Wait until no live process names `path` in its command line or environment."""
    wait_for(lambda: no_process_mentions(str(path)), 30, 0.1, f"no process left from {path}")


def upstream_pids(gate_pid: int, marker: str, timeout: float = 60) -> list[int]:
    """Children of agentgate whose command line contains `marker` (waits until there is one
    that has exec'd, so its parent-death signal is already armed)."""
    return wait_for(lambda: [p for p in children(gate_pid) if marker in cmdline(p)], timeout,
                    message=f"an upstream '{marker}' under pid {gate_pid}")


def fake_bank_of(gate_pid: int) -> int:
    """The pid of the fake bank a gate process started."""
    return upstream_pids(gate_pid, "fake-payments")[0]


def fake_banks(dir) -> list[int]:
    """Live fake-payments processes whose ledger is inside `dir`."""
    mark = f"FAKE_PAYMENTS_LEDGER={dir}".encode()

    def is_bank(pid: int) -> bool:
        if "fake-payments" not in cmdline(pid):
            return False
        with suppress(OSError):
            return any(var.startswith(mark) for var in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        return False
    return live_pids(is_bank)


def wait_gone(pids, timeout: float = 30, what: str | None = None) -> None:
    """Wait until none of `pids` is alive."""
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout,
             message=what or f"processes {list(pids)} to exit")


def reap(pids) -> None:
    """SIGKILL whatever of `pids` is still alive (cleanup after a failed assertion)."""
    for pid in pids:
        if pid_alive(pid):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def reap_leftovers(find, what: str, timeout: float) -> list[int]:
    """Wait until `find()` lists no process; SIGKILL and return those it still lists after the deadline."""
    try:
        wait_for(lambda: not find(), timeout, message=f"{what} to exit")
    finally:
        left = find()
        reap(left)
    return left


def reap_banks(dir, timeout: float = 20) -> list[int]:
    """Wait for every fake bank of `dir` to exit; SIGKILL and return those left after the deadline."""
    return reap_leftovers(lambda: fake_banks(dir), f"the fake banks of {dir}", timeout)


def close_peers() -> None:
    """Close every Host and RawStdio this test still has open."""
    for peer in list(conftest._LIVE):
        peer.close()


def kill_and_reap(raw: RawStdio, sig: int = signal.SIGKILL) -> int:
    """Signal the gate and wait for it (and so for its fake bank, which dies with it)."""
    bank_pids = children(raw.pid)
    raw.kill(sig)
    code = raw.wait(60)
    wait_gone(bank_pids, 30, "the killed gate's upstreams to die")
    return code


def read_pid(path, timeout: float = 60) -> int:
    """The pid a process wrote to `path` (waits for the file)."""
    return int(wait_for(lambda: Path(path).exists() and Path(path).read_text().strip(), timeout,
                        message=f"pid file {path}"))


def stop_process(pid: int) -> None:
    """SIGSTOP `pid` and wait until it is stopped. A signal is taken when the process next
    runs: until then, a read it is blocked in can still complete, and the bytes a test expects
    to wait unread in its stdin would be gone into a process that never answers."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: conftest._stat(pid)[0] == "T", 30, message=f"process {pid} to stop")


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


# ---------------------------------------------------------------- the event chain, recomputed


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
        expected = chain_hash(prev, seq, run_id, step_id, at, type_, payload)
        assert digest == expected, f"seq {seq} does not chain"
        prev = digest


def policy_evaluations(db) -> list[dict]:
    """Every decision of the policy with what the re-check report says of it, in seq order: the
    step.policy events, and the policy an allowed read's one run.read event carries (that event
    is the read's one step, index 0: it has no row in the steps table)."""
    found, seen_steps = [], set()
    index = dict(query(db, "SELECT id, idx FROM steps"))
    tools = dict(query(db, "SELECT id, tool FROM runs"))
    parts = [(seq, run_id, *part) for seq, run_id, step_id, type_, payload in query(
        db, "SELECT seq, run_id, step_id, type, payload_json FROM events ORDER BY seq")
        for part in event_parts(type_, step_id, payload)]
    for seq, run_id, type_, step_id, recorded in parts:
        if type_ not in ("step.policy", "run.read"):
            continue
        idx, tool_name = index.get(step_id), tools[run_id]
        assert (idx is None) == (type_ == "run.read"), f"seq {seq}: a {type_} event and its step row"
        idx = 0 if idx is None else idx
        if type_ == "run.read":
            recorded = recorded["policy"]
        found.append({"seq": seq, "run_id": run_id, "step_id": step_id, "step_index": idx, "tool": tool_name,
                      "on_resume": step_id in seen_steps, "outcome": recorded["outcome"],
                      "policy_id": recorded.get("policy_id", ""), "recorded": recorded})
        seen_steps.add(step_id)
    return found


def report_line(mark: str, evaluation: dict, body: str) -> str:
    """One evaluation line of the text report (reference section 15)."""
    resume = " (on resume)" if evaluation["on_resume"] else ""
    where = f"step {evaluation['step_index']} seq {evaluation['seq']} {evaluation['tool']}{resume}"
    return f"{mark:<9} {where}: {body}"


# ---------------------------------------------------------------- approval scenarios (Bank)

# Every tools/call answer that goes through `Bank.call` or `RawGate.call_bytes` is kept in SEEN,
# and every Bank is kept in BANKS with its paths and run ids, so a test can check that nothing
# the model was shown names how to approve (test_approval_visibility.py).

# (where, text) of every model-visible answer collected by these helpers, across test files.
SEEN: list[tuple[str, str]] = []
# Every Bank made in this session, so its paths and run ids can be looked for in SEEN.
BANKS: list = []


def seen(where: str, text: str) -> str:
    """Record `text` as shown to the model (in SEEN) and return it."""
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
        self.ledger = ledger(self.dir)
        self.db_path = db_path(self.dir)
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

    def call(self, host, args: dict | None, tool: str = PAY, **kw) -> Answer:
        text, error = said(host.call(tool, args, **kw))
        return Answer(seen(f"{tool} {args}", text), error)

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
            return next((run_id for run_id, approval in self.hints() if approval == approval_id), None)
        return wait_for(find, DEADLINE, message=f"operator hint for approval {approval_id}")

    def pending(self, answer: Answer) -> tuple[str, str]:
        """(run id, approval id) of a PENDING_APPROVAL answer, the run id from the hint only."""
        assert answer.prefix == "PENDING_APPROVAL" and not answer.is_error, answer
        approval = answer.approval_id()
        assert approval, answer
        return self.hint_for(approval), approval

    # -- the operator side -------------------------------------------------------------------

    def operator(self, command: str, *args: str, env: dict | None = None):
        return operator(self.config, command, *args, ok=False, env=env)

    def approve(self, run: str, approval: str | None = None, *extra: str, ok: bool = True, env=None):
        args = [run] + (["-approval", approval] if approval else []) + list(extra)
        return operator(self.config, "approve", *args, ok=ok, env=env)

    def reject(self, run: str, note: str, *extra: str, ok: bool = True):
        return operator(self.config, "reject", run, "-yes", "-note", note, *extra, ok=ok)

    def cancel(self, run: str, note: str, ok: bool = True):
        return operator(self.config, "cancel", run, "-note", note, ok=ok)

    def show(self, run: str) -> dict:
        return json.loads(operator(self.config, "show", run, "-json").stdout)

    def runs_json(self) -> list:
        return json.loads(operator(self.config, "runs", "-json").stdout)

    # -- what happened -----------------------------------------------------------------------

    def payments(self) -> int:
        return payments(self.ledger)

    def ledger_lines(self) -> list[dict]:
        return records(self.ledger)

    def query(self, sql: str, args=()) -> list:
        return query(self.db_path, sql, args)

    def approvals(self, status: str | None = None) -> list[dict]:
        return approvals(self.dir, status)

    def approval(self, approval_id: str) -> dict:
        return next(a for a in self.approvals() if a["id"] == approval_id)

    def run(self, run_id: str) -> dict:
        return run(self.dir, run_id)

    def run_ids(self) -> list[str]:
        if not self.db_path.exists():
            return []
        return [row[0] for row in self.query("SELECT id FROM runs ORDER BY rowid")]

    def tamper(self, sql: str, args=()) -> None:
        """Change the database behind agentgate's back, as anyone with the file could."""
        tamper(self.db_path, (sql, args))

    def forbidden(self) -> set[str]:
        """What no model-visible text may name: this scenario's paths and run ids."""
        return {str(self.dir), str(self.config), str(self.db_path), *self.run_ids(),
                *(run_id for run_id, _ in self.hints())}


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
        reply = response(self, ident, timeout)
        assert "result" in reply, f"JSON-RPC error for {arguments!r}: {reply}"
        text = response_text(reply)
        return Answer(seen(f"raw {name} {arguments!r}", text), reply["result"].get("isError", False))


# ---------------------------------------------------------------- the recorded session (re-check and verify)

MANIFESTS = ("bank.manifest.json", "vault.manifest.json")
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


def audit_servers(dir, bank: dict | None = None, vault: dict | None = None, bank_fields: dict | None = None,
                  vault_fields: dict | None = None) -> list:
    """The two fake banks: "bank" (balance read_only, pay remote_mutation, refund destructive)
    and "vault" (the same, with VAULT_RULES); `bank`/`vault` merge into their rules per tool."""
    dir = Path(dir)
    return [
        bank_server(dir, dir / "ledger", rules=bank, **(bank_fields or {})),
        bank_server(dir, dir / "vault-ledger", rules=merge_rules(VAULT_RULES, vault), name="vault",
                    manifest="vault.manifest.json", **(vault_fields or {})),
    ]


def audit_config(dir, name: str = CONFIG, bank=None, vault=None, bank_fields=None, vault_fields=None,
                 **top) -> Path:
    """Write (0600) the audit config into `dir` (database runs.db, session "test", hold 0s)."""
    return write_config(dir, audit_servers(dir, bank, vault, bank_fields, vault_fields), name=name, **top)


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
        expect_start(gate.call("bank_balance", {"account": "main"}), "account main holds 120.00 EUR")

        approval = approval_in(expect(gate.call("bank_pay", KIM), "PENDING_APPROVAL"))
        approve(config, run_in_hint(gate.stderr_text(), approval), approval, "fine")
        expect_start(gate.call("bank_pay", KIM), "paid 5.00 to kim")

        expect(gate.call("bank_refund", {"payment": "p1"}), "DENIED")

        approval = approval_in(expect(gate.call("bank_pay", REX), "PENDING_APPROVAL"))
        reject(config, run_in_hint(gate.stderr_text(), approval), approval, "not this one")

        approval = approval_in(expect(gate.call("vault_pay", LIV), "UNKNOWN_OUTCOME"))
        (dir / "vault-ledger.release").touch()
        approve(config, run_in_hint(gate.stderr_text(), approval), approval, "it did not go through")
        expect_start(gate.call("vault_pay", LIV), "paid 7.00 to liv")
        gate.close()

        other = gate_host(audit_config(dir, name="other.json", session=OTHER_SESSION))
        gates.append(other)
        expect_start(other.call("bank_balance", {"account": "other"}), "account other holds 120.00 EUR")
        other.close()
    finally:
        (dir / "vault-ledger.release").touch()
        for gate in gates:
            gate.close()
        reap_banks(dir)
    rows = query(dir / DB, "SELECT id, tool FROM runs ORDER BY rowid")
    assert [tool for _, tool in rows] == [tool for _, tool in SESSION_RUNS], rows
    return Recorded(dir, {label: run_id for (label, _), (run_id, _) in zip(SESSION_RUNS, rows)})


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def bankdir(workdir):
    """The test's private directory; afterwards every blocked payment is released, every gate
    this test started is closed, and no fake bank of this test may still be running."""
    yield workdir
    release(workdir)
    close_peers()
    left = reap_banks(workdir)
    assert not left, f"fake bank processes outlived the test: {left}"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One recorded session per test module; each test clones it into its own directory."""
    return record_session(tmp_path_factory.mktemp("recorded") / "session")


@pytest.fixture
def clean_banks(workdir):
    """No fake bank started in this test's directory may outlive the test."""
    yield workdir
    reap_banks(workdir)
