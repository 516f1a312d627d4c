"""The reach check covers the database's companion files (SPEC "Configuration", the
three harms): a server whose argument names the write-ahead log, the shared-memory
index or the rollback journal of the gate's database could rewrite the record as
surely as one naming the database, so it is refused the same way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_config import home, reach_allowed, reach_refused  # noqa: E402,F401


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_a_server_naming_the_databases_companion_file_is_refused(home, suffix):
    proxy = home / "proxy"
    named = str(proxy / ("runs.db" + suffix))
    assert named in reach_refused(proxy, [named])
    (proxy / ("runs.db" + suffix)).write_bytes(b"")
    assert named in reach_refused(proxy, [f"--file={named}"])


def test_a_file_beside_the_database_of_another_name_is_allowed(home):
    reach_allowed(home / "proxy", [str(home / "sandbox" / "runs.db-wal")])
