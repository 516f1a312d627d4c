"""The store: its files, its schema version, its transactions and the audit hash chain.

Specification: reference sections 2.1 (store-level rules) and 16 (the chain), SPEC "The
database". Ported from the reference suite: chain_test.go's TestEventHash_Golden, the
recomputation half of TestVerifyEvents_IntactChainAcrossRuns, TestVerifyEvents_ConcurrentWritersKeepTheChain
(as two Store objects on one file written from threads), the "new events take fresh seqs"
part of TestVerifyEvents_FindsTheFirstAlteredEvent, and proxy/config_test.go's database
checks. The `verify` walk itself (breaks, ranges, kept heads) belongs to the operator
command tests; TestStore_V040DatabaseMigratesWithChainedEvents does not apply (agentgate's
schema is its own and starts at version 1).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

Store, StoreError, event_hash = agentgate.Store, agentgate.StoreError, agentgate.event_hash
REFUSED = (StoreError, agentgate.ConfigError)  # the path checks are shared with the config's

GOLDEN = "215d2d4feca5e8542594838002508a9d6739ae568ac25b15fa28058b3943b60f"


@pytest.fixture
def db_path(workdir) -> str:
    return str(workdir / "runs.db")


@pytest.fixture
def store(db_path):
    opened = Store(db_path)
    yield opened
    opened.close()


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def events(store) -> list[tuple]:
    return store.read("SELECT seq, run_id, step_id, at, type, payload_json, hash FROM events ORDER BY seq")


def assert_intact_chain(rows) -> None:
    """Every hash recomputes from the previous hash and the stored fields; seqs are 1..n."""
    prev = ""
    for expected_seq, (seq, run_id, step_id, at, type_, payload, digest) in enumerate(rows, 1):
        assert seq == expected_seq, f"seq {seq} where {expected_seq} was due"
        assert digest == event_hash(prev, seq, run_id, step_id, at, type_, payload), f"seq {seq}"
        prev = digest


def emit(*specs):
    """A transaction body writing one event per (run_id, type, payload[, step_id])."""

    def body(tx):
        for spec in specs:
            tx.event(*spec[:3], **({"step_id": spec[3]} if len(spec) > 3 else {}))

    return body


# ---------------------------------------------------------------- the hash


def test_event_hash_golden():
    assert event_hash("", 1, "r", "", "2026-10-01T09:00:00Z", "run.started", "{}") == GOLDEN


def test_event_hash_is_sha256_over_seven_netstrings():
    import hashlib

    parts = ["", "1", "r", "", "2026-10-01T09:00:00Z", "run.started", "{}"]
    data = b"".join(f"{len(p.encode())}:{p},".encode() for p in parts)
    assert hashlib.sha256(data).hexdigest() == GOLDEN
    # lengths are in bytes, so a multi-byte field cannot be re-cut into another
    assert event_hash(GOLDEN, 2, "r\u00e9", "s", "t", "x", "{}") != event_hash(GOLDEN, 2, "r", "\u00e9s", "t", "x", "{}")


def test_every_field_enters_the_hash():
    base = ("p", 7, "r", "s", "2026-10-01T09:00:00Z", "t", "{}")
    seen = {event_hash(*base)}
    for i in range(len(base)):
        changed = list(base)
        changed[i] = changed[i] + 1 if isinstance(changed[i], int) else changed[i] + "x"
        seen.add(event_hash(*changed))
    assert len(seen) == len(base) + 1


# ---------------------------------------------------------------- files and settings


def test_a_new_database_and_its_sidecars_are_0600_whatever_the_umask(db_path):
    old = os.umask(0)
    try:
        store = Store(db_path)
        store.write(emit(("r", "run.started", {})))
        for path in (db_path, db_path + "-wal", db_path + "-shm"):
            assert os.path.exists(path), path
            assert mode(path) == 0o600, (path, oct(mode(path)))
        store.close()
    finally:
        os.umask(old)


def test_the_connection_is_set_up_as_promised(store):
    assert store.read("PRAGMA journal_mode")[0][0] == "wal"
    assert store.read("PRAGMA synchronous")[0][0] == 2  # FULL
    assert store.read("PRAGMA foreign_keys")[0][0] == 1
    assert store.read("PRAGMA trusted_schema")[0][0] == 0
    assert store.read("PRAGMA busy_timeout")[0][0] >= 5000


def test_the_schema_is_migrated_once_to_this_agentgates_version(db_path):
    Store(db_path).close()
    Store(db_path).close()
    db = sqlite3.connect(db_path)
    versions = [row[0] for row in db.execute("SELECT version FROM schema_migrations ORDER BY version")]
    db.close()
    assert versions == list(range(1, len(agentgate.SCHEMA) + 1))


def test_a_database_others_can_write_is_refused(db_path):
    Store(db_path).close()
    os.chmod(db_path, 0o664)
    with pytest.raises(REFUSED) as caught:
        Store(db_path)
    assert db_path in str(caught.value) and "-rw-rw-r--" in str(caught.value)


def test_a_database_others_can_read_is_tightened_to_0600(db_path):
    Store(db_path).close()
    os.chmod(db_path, 0o644)
    Store(db_path).close()
    assert mode(db_path) == 0o600


def test_a_sidecar_others_can_write_is_refused(db_path):
    Store(db_path).close()
    Path(db_path + "-wal").write_bytes(b"")
    os.chmod(db_path + "-wal", 0o666)
    with pytest.raises(REFUSED) as caught:
        Store(db_path)
    # One ownership check serves every trusted file: its one fix.
    assert "-wal" in str(caught.value) and "chmod go-w" in str(caught.value)


def test_a_sidecar_that_is_a_symbolic_link_is_refused(db_path, workdir):
    Store(db_path).close()
    (workdir / "elsewhere").write_bytes(b"")
    os.symlink(workdir / "elsewhere", db_path + "-shm")
    with pytest.raises(REFUSED) as caught:
        Store(db_path)
    assert "-shm" in str(caught.value)


def test_a_database_that_is_a_symbolic_link_is_refused(db_path, workdir):
    Store(db_path).close()
    link = str(workdir / "link.db")
    os.symlink(db_path, link)
    with pytest.raises(REFUSED) as caught:
        Store(link)
    assert "symbolic link" in str(caught.value)


def test_a_database_migrated_by_a_newer_agentgate_is_refused(db_path):
    Store(db_path).close()
    db = sqlite3.connect(db_path)
    db.execute("INSERT INTO schema_migrations VALUES(99, '2030-01-01T00:00:00Z')")
    db.commit()
    db.close()
    with pytest.raises(StoreError) as caught:
        Store(db_path)
    assert "newer" in str(caught.value)
    with pytest.raises(StoreError):
        Store(db_path, readonly=True, create=False)


@pytest.mark.parametrize("ddl", ["CREATE TRIGGER sneaky AFTER INSERT ON events BEGIN DELETE FROM events; END",
                                 "CREATE VIEW pending AS SELECT * FROM approvals"])
def test_a_database_holding_a_trigger_or_a_view_is_refused(db_path, ddl):
    Store(db_path).close()
    db = sqlite3.connect(db_path)
    db.execute(ddl)
    db.commit()
    db.close()
    with pytest.raises(StoreError) as caught:
        Store(db_path)
    assert "trigger or view" in str(caught.value)


def test_an_operator_open_never_creates_a_database(db_path):
    with pytest.raises(StoreError) as caught:
        Store(db_path, readonly=True, create=False)
    assert "does not exist" in str(caught.value)
    assert not os.path.exists(db_path)


def test_a_read_only_open_sees_what_was_written(db_path, store):
    store.write(emit(("r", "run.started", {"n": 1})))
    reader = Store(db_path, readonly=True, create=False)
    try:
        assert [row[4] for row in events(reader)] == ["run.started"]
        with pytest.raises(StoreError):
            reader.write(emit(("r", "run.finished", {})))
    finally:
        reader.close()


# ---------------------------------------------------------------- transactions and the chain


def test_events_in_two_transactions_chain(store):
    store.write(emit(("r1", "run.created", {"goal": "call bank_pay"}), ("r1", "run.started", {})))
    store.write(emit(("r2", "run.created", {"amount": agentgate.parse(b"1.50")}, "step-1"),
                     ("r1", "run.finished", {"status": "COMPLETED", "text": "<b>"})))
    rows = events(store)
    assert [row[0] for row in rows] == [1, 2, 3, 4]
    assert [(row[1], row[4]) for row in rows] == [("r1", "run.created"), ("r1", "run.started"),
                                                  ("r2", "run.created"), ("r1", "run.finished")]
    assert rows[2][2] == "step-1"
    assert rows[2][5] == '{"amount":1.50}'  # the payload is stored in canonical form
    assert rows[3][5] == '{"status":"COMPLETED","text":"\\u003cb\\u003e"}'
    assert_intact_chain(rows)


def test_the_first_event_chains_from_the_empty_hash(store):
    store.write(emit(("r", "run.started", {})))
    (seq, run_id, step_id, at, type_, payload, digest), = events(store)
    assert digest == event_hash("", 1, "r", "", at, "run.started", "{}")


def test_a_failed_transaction_leaves_nothing_behind(store):
    store.write(emit(("r", "run.started", {})))

    def fails(tx):
        tx.event("r", "step.started", {})
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        store.write(fails)
    assert len(events(store)) == 1
    store.write(emit(("r", "run.finished", {})))
    assert_intact_chain(events(store))


def test_a_state_change_and_its_events_commit_together(store):
    def orphan_step(tx):
        tx.event("ghost", "step.started", {})
        tx.execute("INSERT INTO steps(id, run_id, idx, status, decision_json, started_at) "
                   "VALUES('s1', 'ghost', 0, 'deciding', '{}', 'now')")

    with pytest.raises(StoreError):
        store.write(orphan_step)  # the foreign key on steps.run_id refuses it
    assert events(store) == []


def test_a_deleted_last_event_leaves_its_seq_unused(store, db_path):
    store.write(emit(("r", "a", {}), ("r", "b", {}), ("r", "c", {})))
    store.write(lambda tx: tx.execute("DELETE FROM events WHERE seq=3"))
    store.write(emit(("r", "d", {})))
    rows = events(store)
    assert [row[0] for row in rows] == [1, 2, 4]  # a cut tail shows as a gap, never as reuse


def test_after_a_cut_tail_the_next_event_chains_from_the_newest_stored_event(store):
    # Reference 16: "previous" is the next lower seq present, so only the seq gap shows the
    # cut; the new event does not restart the chain from the empty hash.
    store.write(emit(("r", "a", {}), ("r", "b", {}), ("r", "c", {})))
    store.write(lambda tx: tx.execute("DELETE FROM events WHERE seq=3"))
    store.write(emit(("r", "d", {})))
    rows = events(store)
    assert rows[2][0] == 4
    assert rows[2][6] == event_hash(rows[1][6], 4, "r", "", rows[2][3], "d", "{}")


def test_two_stores_on_one_file_writing_concurrently_keep_one_chain(db_path):
    stores = [Store(db_path), Store(db_path)]
    threads_per_store, transactions, failures = 3, 20, []
    start = threading.Barrier(len(stores) * threads_per_store)

    def writer(store, name):
        try:
            start.wait()
            for i in range(transactions):
                store.write(emit((f"{name}-{i}", "run.created", {"i": i}),
                                 (f"{name}-{i}", "run.started", {}, f"step-{i}")))
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=writer, args=(store, f"run-{s}-{t}"))
               for s, store in enumerate(stores) for t in range(threads_per_store)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert failures == []
        rows = events(stores[0])
        total = len(stores) * threads_per_store * transactions * 2
        assert len(rows) == total
        assert len({row[0] for row in rows}) == total  # no seq used twice
        assert_intact_chain(rows)
        assert len({row[1] for row in rows}) == total // 2
        # the two events of one transaction are adjacent: nobody wrote between them
        for first, second in zip(rows[::2], rows[1::2]):
            assert first[1] == second[1] and (first[4], second[4]) == ("run.created", "run.started")
    finally:
        for store in stores:
            store.close()


def test_a_second_process_extends_the_same_chain(db_path, store):
    import subprocess

    store.write(emit(("r", "run.created", {})))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import agentgate; "
            "s = agentgate.Store(sys.argv[2]); "
            "s.write(lambda tx: (tx.event('other', 'run.created', {}), tx.event('other', 'run.started', {}))); "
            "s.close()")
    repo = str(Path(agentgate.__file__).resolve().parent)
    subprocess.run([sys.executable, "-c", code, repo, db_path], check=True, timeout=60)
    store.write(emit(("r", "run.finished", {})))
    rows = events(store)
    assert [(row[0], row[1]) for row in rows] == [(1, "r"), (2, "other"), (3, "other"), (4, "r")]
    assert_intact_chain(rows)
