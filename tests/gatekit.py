"""Helpers for agentgate scenarios: configs, the fake bank, the scripted server, the database.

Kept out of conftest.py so other test writers' fixtures do not clash with these. Everything
here is synchronous and waits with generous deadlines; nothing sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

from conftest import AGENTGATE, Host, agentgate_argv, children, pid_alive, wait_for

SCRIPTED = Path(__file__).resolve().parent / "scripted_server.py"
CONFIG = "agentgate.json"
SESSION = "test"


# ---------------------------------------------------------------- files and configs


def write_private(path, text: str) -> Path:
    """Write `text` to `path` with mode 0600 (config and manifests must not be writable by others)."""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return path


def write_config(dir, servers, name: str = CONFIG, **top) -> Path:
    """Write a 0600 config in `dir`: database runs.db, session "test", hold 0s, then `top`."""
    config = {"database": "runs.db", "session": SESSION, "hold": "0s", **top, "servers": list(servers)}
    return write_private(Path(dir) / name, json.dumps(config, indent=2, ensure_ascii=False))


def rule(side_effect: str, timeout: str | None = "10s", **extra) -> dict:
    """One rule; timeout None leaves it out."""
    entry = {"side_effect": side_effect, **extra}
    if timeout is not None:
        entry["timeout"] = timeout
    return entry


def bank_server(dir, ledger=None, rules: dict | None = None, **fields) -> dict:
    """The fake payment server as a config entry: balance read_only, pay remote_mutation,
    refund destructive (each 10s). `rules` maps a tool to extra rule fields, or to None to drop
    its rule; `fields` replace server fields."""
    ledger = Path(ledger) if ledger else Path(dir) / "ledger"
    merged = {"balance": rule("read_only"), "pay": rule("remote_mutation"), "refund": rule("destructive")}
    for tool, change in (rules or {}).items():
        if change is None:
            merged.pop(tool, None)
        else:
            merged[tool] = {**merged.get(tool, {}), **change}
    server = {
        "name": "bank",
        "command": [sys.executable, str(AGENTGATE), "fake-payments"],
        "env": [f"FAKE_PAYMENTS_LEDGER={ledger}"],
        "manifest": "bank.manifest.json",
        "rules": merged,
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


def tool(name: str, schema: dict | None = None, description: str | None = None, annotations: dict | None = None) -> dict:
    """A tool as a server lists it."""
    entry = {"name": name, "description": f"The {name} tool." if description is None else description,
             "inputSchema": schema if schema is not None else {"type": "object"}}
    if annotations is not None:
        entry["annotations"] = annotations
    return entry


READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
WRITE_SCHEMA = {"type": "object", "required": ["path", "text"],
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}, "force": {"type": "boolean"}}}
ROOT_SCHEMA = {"type": "object", "required": ["path", "root"],
               "properties": {"path": {"type": "string"}, "root": {"type": "string"}}}


def fs_tools(read: dict | None = None, write: dict | None = None) -> list:
    """read_file (readOnlyHint) and write_file (no annotations), as the reference's fixture."""
    return [
        {**tool("read_file", READ_SCHEMA, "Read a file.", {"readOnlyHint": True}), **(read or {})},
        {**tool("write_file", WRITE_SCHEMA, "Write a file."), **(write or {})},
    ]


def read_manifest(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def records(path) -> list:
    """The scripted server's record file as a list of entries ([] when absent)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------- running agentgate


def agentgate(*args: str, env: dict | None = None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
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


def payments(ledger) -> int:
    """How many payments the fake server made (one ledger line each)."""
    path = Path(ledger)
    return len(path.read_text().splitlines()) if path.exists() else 0


def gate_host(config, env: dict | None = None, mode: str = "auto", **kw) -> Host:
    """A started Host (the SDK client) for `agentgate.py -config <config>`."""
    return Host(agentgate_argv("-config", str(config)), env=env, mode=mode, **kw).start()


def result_text(result) -> str:
    """Newline-joined text blocks of an SDK CallToolResult."""
    return "\n".join(block.text for block in result.content if block.type == "text")


# ---------------------------------------------------------------- the database, read only


def open_db(path) -> sqlite3.Connection:
    """A read-only connection to agentgate's database."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    db.execute("PRAGMA busy_timeout=30000")
    return db


def runs(db) -> list:
    """(id, tool, status, reason, detail) of every run, oldest first."""
    return db.execute("SELECT id, tool, status, reason, detail FROM runs ORDER BY created_at, rowid").fetchall()


def event_types(db, run_id: str) -> list:
    """The event types of one run, in order."""
    return [row[0] for row in db.execute("SELECT type FROM events WHERE run_id=? ORDER BY seq", (run_id,))]


def steps(db, run_id: str) -> list:
    """(idx, status, decision, observation) of a run's steps, decisions and observations parsed."""
    rows = db.execute("SELECT idx, status, decision_json, observation_json FROM steps WHERE run_id=? ORDER BY idx",
                      (run_id,)).fetchall()
    return [(i, s, json.loads(d), json.loads(o) if o else None) for i, s, d, o in rows]


# ---------------------------------------------------------------- processes


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    with suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def upstream_pids(gate_pid: int, marker: str, timeout: float = 60) -> list[int]:
    """Children of agentgate whose command line contains `marker` (waits until there is one
    that has exec'd, so its parent-death signal is already armed)."""
    return wait_for(lambda: [p for p in children(gate_pid) if marker in cmdline(p)], timeout,
                    message=f"an upstream '{marker}' under pid {gate_pid}")


def wait_gone(pids, timeout: float = 30) -> None:
    """Wait until none of `pids` is alive."""
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout, message=f"processes {list(pids)} to exit")


def reap(pids) -> None:
    """SIGKILL whatever of `pids` is still alive (cleanup after a failed assertion)."""
    for pid in pids:
        if pid_alive(pid):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def read_pid(path, timeout: float = 60) -> int:
    """The pid a process wrote to `path` (waits for the file)."""
    return int(wait_for(lambda: Path(path).exists() and Path(path).read_text().strip(), timeout,
                        message=f"pid file {path}"))


def has_raw_controls(text: str) -> str:
    """The first character a terminal would act on (C0/C1 controls except LF/TAB, DEL, bidi and
    zero-width format characters), or ''."""
    for ch in text:
        code = ord(ch)
        if (code < 0x20 and ch not in "\n\t") or 0x7F <= code <= 0x9F or 0x200B <= code <= 0x200F \
                or 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069 or code == 0xFEFF:
            return ch
    return ""
