"""The audit chain and `verify` (issue 5 item 3): every event's hash covers the previous hash
and its own fields as stored, in one chain across all runs and all processes; `verify` walks
it, prints the head to keep elsewhere, names the first break with what was expected and what
was found, and checks a kept head.

Databases here are written by real gate processes (the SDK host, the fake bank, the operator
commands); a test that tampers works on its own copy of the session recorded once per module
(tests/kit.py: allowed, approved, denied, rejected and re-run calls, two sessions). The
chain is recomputed in kit from reference section 16, independently of agentgate's code.

Ported from the reference suite (agentrt-tests.md), chain_test.go:
- TestEventHash_Golden: already in test_store.py (test_event_hash_golden).
- TestVerifyEvents_IntactChainAcrossRuns -> test_an_intact_chain_verifies_across_runs_and_processes,
  test_ranges_verify_what_they_name (EventHash(n+1) "not found" becomes a kept head past the chain)
- TestVerifyEvents_FindsTheFirstAlteredEvent -> test_the_first_break_is_found (the five subtests,
  plus issue 5's edited approval-decided event) and test_a_cut_tail_shows_against_a_kept_head_then_as_a_gap
- TestVerifyEvents_ReadsLongFieldsInChunks -> test_a_change_near_the_end_of_a_long_field_is_found
  (a ~130 KB argument of a real call)
- TestVerifyEvents_ConcurrentWritersKeepTheChain -> test_concurrent_gates_keep_one_chain (three
  gate processes on one database, four calls each in flight at once)
- TestStore_V040DatabaseMigratesWithChainedEvents: N/A. agentgate has its own schema, which
  starts at version 1 with the chain in it; there is no unchained older database to migrate.

Two details of the reference's Go report are not asserted: for a missing event agentgate
names the sequence numbers as expected and found ("seq 5" / "seq 6") rather than a hash, and
a deleted first event reads "the first event is seq 2" (reference section 16's wording), with
"seq 1" expected.
"""

from __future__ import annotations

import re
import sqlite3
from contextlib import closing

import pytest

from conftest import DEFAULT_TIMEOUT
from kit import (
    DB,
    HEX64,
    assert_chained,
    bank,
    chain_hash,
    clean_banks,  # noqa: F401 (fixture)
    event_rows,
    file_state,
    gate_host,
    recorded,  # noqa: F401 (fixture)
    result_text,
    tamper,
    verify,
)

BROKEN_RE = re.compile(r"^broken at seq (\d+): (.*)\n  expected: (.*)\n  found:    (.*)$", re.M)


def lines(done) -> list[str]:
    return done.stdout.split("\n")


def head_line(rows) -> str:
    return f"head: seq {rows[-1][0]} {rows[-1][6]}" if rows else "head: no events"


def assert_intact(done, rows, first: int = 1, last: int | None = None) -> None:
    """verify said the chain from `first` to `last` (default: its end) is intact."""
    last = rows[-1][0] if last is None else last
    assert done.returncode == 0, f"verify exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    by_seq = {row[0]: row for row in rows}
    assert lines(done)[:3] == [head_line(rows), f"intact: {last - first + 1} event(s), seq {first} to {last}",
                               f"last checked: seq {last} {by_seq[last][6]}"], done.stdout
    assert "broken" not in done.stdout


def broken(done) -> tuple[int, str, str, str]:
    """(seq, detail, expected, found) of the break verify reported."""
    assert done.returncode == 1, f"verify exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    found = BROKEN_RE.findall(done.stdout)
    assert len(found) == 1, f"no single break in:\n{done.stdout}"
    assert "intact" not in done.stdout
    seq, detail, expected, got = found[0]
    return int(seq), detail, expected, got


def play(config, *calls) -> None:
    """One gate process making these calls (tool, arguments, expected start of the answer)."""
    gate = gate_host(config)
    try:
        for tool, args, start in calls:
            text = result_text(gate.call(tool, args))
            assert text.startswith(start), f"{tool} {args}: {text[:300]}"
    finally:
        gate.close()


# ---------------------------------------------------------------- an intact chain


def test_an_intact_chain_verifies_across_runs_and_processes(clean_banks):
    workdir = clean_banks
    config = bank(workdir)
    gate = gate_host(config)
    gate.list_tools()  # the database is created and migrated, nothing recorded yet
    gate.close()
    db = workdir / DB
    assert event_rows(db) == []
    done = verify(config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done)[:2] == ["head: no events", "intact: 0 event(s)"]

    play(config, ("bank_balance", {"account": "main"}, "account main holds"),
         ("bank_pay", {"to": "kim", "amount": 5}, "PENDING_APPROVAL:"),
         ("bank_refund", {"payment": "p1"}, "DENIED:"))
    first = event_rows(db)
    assert_chained(first)
    assert_intact(verify(config), first)

    play(config, ("bank_balance", {"account": "savings"}, "account savings holds"))  # another process
    rows = event_rows(db)
    assert rows[:len(first)] == first
    assert_chained(rows)
    assert len({row[1] for row in rows}) == 4 and rows[len(first)][1] not in {row[1] for row in first}
    done = verify(config)
    assert_intact(done, rows)
    n, head = rows[-1][0], rows[-1][6]
    assert HEX64.fullmatch(head)

    kept = verify(config, "-head", f"{n}:{head}")
    assert_intact(kept, rows)
    assert f"kept head: seq {n} matches" in lines(kept)
    beyond = verify(config, "-head", f"{n + 1}:{head}")
    assert beyond.returncode == 1
    assert f"kept head: seq {n + 1} is not in the chain: events were removed" in lines(beyond)


def test_ranges_verify_what_they_name(recorded, workdir):
    config = recorded.clone(workdir)
    db = workdir / DB
    rows = event_rows(db)
    n = rows[-1][0]
    before = file_state(db)

    assert_intact(verify(config, "-from", "5", "-to", "8"), rows, 5, 8)
    assert_intact(verify(config, "-from", "5"), rows, 5)
    assert_intact(verify(config, "-to", str(n)), rows)
    assert_intact(verify(config, "-from", "3", "-to", "3"), rows, 3, 3)
    assert_intact(verify(config, "-from", "7", "-head", f"{n}:{rows[-1][6]}"), rows, 7)

    past = verify(config, "-to", str(n + 1))
    assert past.returncode == 1
    assert f"the chain ends at seq {n}, before -to {n + 1}" in lines(past)
    assert head_line(rows) == lines(past)[0]
    after = verify(config, "-from", str(n + 1), "-to", str(n + 2))
    assert after.returncode == 1
    assert f"before -to {n + 2}" in after.stdout

    assert file_state(db) == before  # verify reads only


@pytest.mark.parametrize("args", [["-from", "-1"], ["-from", "5", "-to", "4"], ["-head", "12"], ["-head", "3:abc"],
                                  ["-head", f"x:{'a' * 64}"], ["-to", "ten"], ["-nope"], ["extra"]],
                         ids=["from-negative", "to-before-from", "head-no-hash", "head-short-hash", "head-no-seq",
                              "to-word", "unknown-flag", "positional"])
def test_usage_errors_exit_2(recorded, workdir, args):
    config = recorded.clone(workdir)
    done = verify(config, *args)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert done.stdout == "" and done.stderr.startswith("agentgate: ") and "Traceback" not in done.stderr


# ---------------------------------------------------------------- breaks


def _alter_payload(db, rows, k):
    row = rows[k - 1]
    tamper(db, ("UPDATE events SET payload_json=? WHERE seq=?", ('{"forged":true}', k)))
    expected = chain_hash(rows[k - 2][6], k, row[1], row[2], row[3], row[4], '{"forged":true}')
    return k, "the stored hash is not the one", expected, row[6]


def altered_payload(db, rows):
    return _alter_payload(db, rows, len(rows) // 2)


def edited_approval_decision(db, rows):
    # The operator approved kim's payment; the record is made to say they rejected it.
    seq, run_id, step_id, at, type_, payload, digest = next(
        row for row in rows if row[4] == "approval.decided" and '"approved"' in row[5])
    forged = payload.replace('"approved"', '"rejected"')
    tamper(db, ("UPDATE events SET payload_json=? WHERE seq=?", (forged, seq)))
    return seq, "the stored hash is not the one", chain_hash(rows[seq - 2][6], seq, run_id, step_id, at, type_,
                                                             forged), digest


def deleted_event(db, rows):
    k = len(rows) // 2
    tamper(db, ("DELETE FROM events WHERE seq=?", (k,)))
    return k + 1, f"seq {k + 1} follows {k - 1}: an event is missing", f"seq {k}", f"seq {k + 1}"


def swapped_pair(db, rows):
    k = len(rows) // 2
    a, b = rows[k - 1], rows[k]
    sql = "UPDATE events SET run_id=?, step_id=?, at=?, type=?, payload_json=?, hash=? WHERE seq=?"
    tamper(db, (sql, (*b[1:], k)), (sql, (*a[1:], k + 1)))
    return k, "the stored hash is not the one", chain_hash(rows[k - 2][6], k, *b[1:6]), b[6]


def altered_first_event(db, rows):
    row = rows[0]
    moved = "2026-10-01T09:00:00.000000Z"
    assert row[3] != moved
    tamper(db, ("UPDATE events SET at=? WHERE seq=1", (moved,)))
    return 1, "the stored hash is not the one", chain_hash("", 1, row[1], row[2], moved, row[4], row[5]), row[6]


def deleted_first_event(db, rows):
    tamper(db, ("DELETE FROM events WHERE seq=1", ()))
    return 2, "the first event is seq 2", "seq 1", "seq 2"


TAMPERING = [altered_payload, edited_approval_decision, deleted_event, swapped_pair, altered_first_event,
             deleted_first_event]


@pytest.mark.parametrize("change", TAMPERING, ids=[t.__name__ for t in TAMPERING])
def test_the_first_break_is_found(recorded, workdir, change):
    config = recorded.clone(workdir)
    db = workdir / DB
    rows = event_rows(db)
    assert_intact(verify(config), rows)
    n, head = rows[-1][0], rows[-1][6]

    at, detail, expected, found = change(db, rows)
    done = verify(config)
    assert lines(done)[0] == head_line(rows)  # the head is still printed, to keep elsewhere
    got = broken(done)
    assert got[0] == at, done.stdout
    assert detail in got[1], done.stdout
    assert got[2:] == (expected, found), done.stdout
    assert expected != found
    if detail.startswith("the stored hash"):
        assert HEX64.fullmatch(got[2]) and HEX64.fullmatch(got[3])
        assert "stored hash" in got[1]
    else:
        assert "missing" in got[1] or got[1].startswith("the first event is seq")

    # A head kept before the change no longer vouches for the chain, though its own row is untouched.
    kept = verify(config, "-head", f"{n}:{head}")
    assert kept.returncode == 1 and broken(kept)[0] == at
    assert f"kept head: seq {n} does not match: the record was changed" in lines(kept)

    # What lies before the break still verifies; past a changed payload, a range that trusts
    # the stored hash before it verifies too (only the changed event breaks the chain).
    first_wrong = int(expected[len("seq "):]) if expected.startswith("seq ") else at
    if first_wrong > 1:
        assert_intact(verify(config, "-to", str(first_wrong - 1)), rows, 1, first_wrong - 1)
    if change in (altered_payload, edited_approval_decision):
        assert_intact(verify(config, "-from", str(at + 1)), rows, at + 1)


def test_a_kept_head_that_differs_fails(recorded, workdir):
    config = recorded.clone(workdir)
    rows = event_rows(workdir / DB)
    k = len(rows) // 2
    done = verify(config, "-head", f"{k}:{rows[k - 2][6]}")
    assert done.returncode == 1
    assert f"kept head: seq {k} does not match: the record was changed" in lines(done)


def test_a_cut_tail_shows_against_a_kept_head_then_as_a_gap(recorded, clean_banks):
    workdir = clean_banks
    config = recorded.clone(workdir)
    db = workdir / DB
    rows = event_rows(db)
    n, head = rows[-1][0], rows[-1][6]
    assert_intact(verify(config), rows)

    tamper(db, ("DELETE FROM events WHERE seq=?", (n,)))
    cut = event_rows(db)
    done = verify(config)
    assert_intact(done, cut)  # a cut tail is a shorter chain: only a kept head shows it
    assert lines(done)[0] == f"head: seq {n - 1} {rows[-2][6]}"
    kept = verify(config, "-head", f"{n}:{head}")
    assert kept.returncode == 1
    assert f"kept head: seq {n} is not in the chain: events were removed" in lines(kept)

    # New events take fresh seqs, so the next run leaves the gap in the chain for all to see.
    play(config, ("bank_balance", {"account": "after"}, "account after holds"))
    rows = event_rows(db)
    assert rows[len(cut)][0] == n + 1
    done = verify(config)
    assert broken(done) == (n + 1, f"seq {n + 1} follows {n - 1}: an event is missing", f"seq {n}", f"seq {n + 1}")


def test_a_change_near_the_end_of_a_long_field_is_found(recorded, clean_banks):
    workdir = clean_banks
    config = recorded.clone(workdir)
    db = workdir / DB
    account = "é" * 65536  # 128 KiB of UTF-8, past any one read of 64 KiB
    # A policy record keeps its request whole in its event (step.decided carries a long
    # argument as its size and hash), so a payment that waits puts the long field in the chain,
    # in the one event its call began with.
    play(config, ("bank_pay", {"to": account, "amount": 1}, "PENDING_APPROVAL"))
    rows = event_rows(db)
    assert_chained(rows)
    assert_intact(verify(config), rows)

    seq, payload = next((row[0], row[5]) for row in rows if row[4] == "call.began" and account in row[5])
    assert len(payload.encode()) > 130_000
    at = payload.rindex("é")
    assert len(payload[:at].encode()) > 128 * 1024 - 10  # the change is far past the first 64 KiB
    forged = payload[:at] + "e" + payload[at + 1:]
    tamper(db, ("UPDATE events SET payload_json=? WHERE seq=?", (forged, seq)))
    row = rows[seq - 1]
    got = broken(verify(config))
    assert got == (seq, "the stored hash is not the one the event's fields and the previous event's hash give",
                   chain_hash(rows[seq - 2][6], seq, row[1], row[2], row[3], row[4], forged), row[6])


# ---------------------------------------------------------------- concurrent writers


def test_concurrent_gates_keep_one_chain(clean_banks):
    workdir = clean_banks
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    gates = []
    try:
        for _ in range(3):
            gate = gate_host(config)
            gates.append(gate)
            gate.list_tools()  # its upstream is up and its database open
        calls = []
        for g, gate in enumerate(gates):
            for j in range(2):
                calls.append((gate.submit("bank_pay", {"to": f"g{g}p{j}", "amount": j + 1, "mode": "slow"}),
                              f"paid {j + 1:.2f} to g{g}p{j}"))
                calls.append((gate.submit("bank_balance", {"account": f"g{g}a{j}"}),
                              f"account g{g}a{j} holds 120.00 EUR"))
        for call, text in calls:
            result = call.result(DEFAULT_TIMEOUT)
            assert result_text(result) == text and not result.is_error
    finally:
        for gate in gates:
            gate.close()

    rows = event_rows(workdir / DB)
    assert_chained(rows)
    assert_intact(verify(config), rows)
    runs = {}
    for row in rows:
        runs.setdefault(row[1], []).append(row[4])
    assert len(runs) == 12
    # Each run's events are whole: a payment's one event when it began and one when it ended, a
    # read's one run.read (it is recorded whole once it answered).
    assert all(types in (["run.read"], ["call.began", "call.ended"]) for types in runs.values()), runs
    assert sum(types == ["run.read"] for types in runs.values()) == 6
    with closing(sqlite3.connect(f"file:{workdir / DB}?mode=ro", uri=True)) as db:
        assert db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone()[0] == len(rows)
