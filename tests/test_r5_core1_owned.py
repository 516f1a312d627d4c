"""One ownership check (issue 30, item 2): a config, a database file and a
token file that others could change or read are refused through the same
check, each refusal naming the file and how to fix it.

Specification: README (a config or manifest writable by group/others is
refused with one sentence saying what to do; the database and token files
are kept 0600).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kit import agentgate, bank, check, rule, write_config, write_private

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agentgate as gate  # noqa: E402


def test_a_config_its_group_can_write_is_refused_naming_it_and_the_fix(workdir):
    config = bank(workdir)
    config.chmod(0o660)
    done = check(config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"config {config} has mode -rw-rw----" in done.stderr, done.stderr
    assert "lets its group or others write it: chmod go-w it" in done.stderr


def test_a_database_file_its_group_can_write_is_refused_naming_it(workdir):
    config = bank(workdir)
    gate.Store(str(workdir / "runs.db")).close()
    wal = workdir / "runs.db-wal"
    write_private(wal, "")
    wal.chmod(0o620)
    done = agentgate("runs", "-config", str(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"database file {wal} has mode -rw--w----" in done.stderr, done.stderr
    assert "lets its group or others write it: chmod go-w it" in done.stderr


def test_a_token_file_others_can_read_is_refused_naming_it_and_the_fix(workdir):
    config = write_config(workdir, [{
        "name": "bank", "url": "http://127.0.0.1:9/mcp",
        "manifest": "bank.manifest.json", "rules": {"balance": rule("read_only")}}])
    tokens = workdir / "agentgate.bank.tokens.json"
    write_private(tokens, json.dumps({
        "tokens": {"access_token": "never-shown", "token_type": "Bearer"}}))
    tokens.chmod(0o604)
    done = check(config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"token file {tokens} has mode -rw----r--" in done.stderr, done.stderr
    assert "lets others read them: chmod 600 it" in done.stderr
    assert "never-shown" not in done.stdout + done.stderr
