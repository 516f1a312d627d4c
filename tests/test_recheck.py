"""Re-check and policy identity (issue 5): `recheck` asks "would today's configuration have
decided these calls differently?" of decisions real gates recorded.

The recorded session (tests/kit.py, made once per module by real gate processes, the fake
banks and the operator commands): bank_balance allowed; bank_pay kim/5 pending, approved,
collected; bank_refund denied (destructive); bank_pay rex/3 pending, rejected; vault_pay liv/7
(allowed by its rule, timeout 1s, "block") timed out after the payment, its re-run approved and
collected; and one balance call of another session on the same database. Each test re-checks
its own copy of that database under a config it writes in its own directory.

Specification: reference sections 3.5 and 15, issue 5 items 1 and 2. Ported from the reference
suite (agentrt-tests.md):
- proxy/recheck_test.go
  - TestRecheck_ChangedPolicyNamesTheCallsNowDenied -> test_the_same_config_rechecks_every_decision_the_same,
    test_the_json_report_is_one_object_per_run, test_tightening_a_class_names_the_decisions_now_denied,
    test_run_rechecks_just_that_run, test_limit_takes_the_newest_runs, test_a_mistyped_session_finds_nothing
  - TestConfig_PolicyIDCoversWhatThePolicyDecidesFrom: the identity itself is unit-tested in
    test_config.py; here, what recheck makes of it, field by field:
    test_a_change_the_policy_does_not_read_keeps_the_identity and
    test_a_change_the_policy_reads_changes_the_identity
  - TestRecheck_CurrentToolsAfterADescriptionChange -> test_current_tools_sees_a_reworded_description
  - TestRecheck_ReRunOfAnUnknownOutcomeIsTheSame -> test_a_rerun_after_an_unknown_outcome_rechecks_the_same
- proxy/internal/cli/recheck_test.go
  - TestCLI_Recheck -> the tests above through the command line, plus test_usage_errors_exit_2,
    test_an_unknown_run_is_not_found. Its "missing -config exits 2" does not apply: agentgate
    finds its config in $AGENTGATE_CONFIG or the default path when -config is not given.
  - TestCLI_RecheckOfNothingFails -> test_a_mistyped_session_finds_nothing and
    test_nothing_recheckable_fails. Its "policy error" half does not apply as written:
    agentgate's policy is a pure function of the configuration that cannot fail, so no
    "policy error" step is ever recorded; a decision whose recorded request is damaged (its
    tool spec gone) is the not-re-checkable case instead.
Beyond the ports: recheck is read-only and starts no server without -current-tools
(test_recheck_writes_nothing, test_recheck_starts_no_server_without_current_tools), the
current schema is applied with -current-tools (test_current_tools_applies_the_current_schema),
and every decision records its identity and tool spec (test_every_decision_records_*).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from contextlib import closing

import pytest

from conftest import AGENTGATE, fake_argv, wait_for
from kit import (
    DB,
    HEX64,
    OTHER_SESSION,
    POLICY_ID_RE,
    SESSION,
    clean_banks,  # noqa: F401 (fixture)
    fake_banks,
    file_state,
    policy_evaluations,
    query,
    recheck,
    recheck_json,
    recorded,  # noqa: F401 (fixture)
    report_line,
)

NEWEST_FIRST = ("liv", "rex", "refund", "kim", "balance")
STATUS = {"balance": "COMPLETED", "kim": "COMPLETED", "refund": "FAILED", "rex": "CANCELLED", "liv": "COMPLETED"}
SCOPE_COVERS = ("class map", "outcome", "fixed values", "renames")
SCOPE_LEAVES = ("does not cover the rules before the policy", "repeat window", "max_pending",
                "rejected or expired approvals", "refused before the gate", "-current-tools")
ANOTHER_APPROVAL = "asks for another approval: its capability, presentation, or tool spec changed"
NOT_A_TOOL = "the tool is not among the current tools"


def labelled(recorded, workdir) -> dict[str, list[dict]]:
    """The recorded policy evaluations (both sessions), by their run's label."""
    by_run = {run_id: label for label, run_id in recorded.runs.items()}
    found: dict[str, list[dict]] = {}
    for e in policy_evaluations(workdir / DB):
        found.setdefault(by_run[e["run_id"]], []).append(e)
    return found


def recorded_identity(recorded, workdir) -> str:
    ids = {e["policy_id"] for label, evals in labelled(recorded, workdir).items() for e in evals}
    assert len(ids) == 1, f"the session was recorded under {ids}"
    identity = ids.pop()
    assert POLICY_ID_RE.fullmatch(identity), identity
    return identity


def approval_hash_of(workdir, run_id: str, kind: str | None = None) -> str:
    rows = query(workdir / DB, "SELECT hash, kind FROM approvals WHERE run_id=? ORDER BY rowid", (run_id,))
    rows = [h for h, k in rows if kind is None or k == kind]
    assert len(rows) == 1, f"run {run_id} has approvals {rows}"
    return rows[0]


def summary_line(runs: int, identity: str, rechecked: int, skipped: int, differ: int, decisions: int = 0) -> str:
    """The report's first line (`decisions`: how many decisions differ)."""
    return (f"{runs} run(s) re-checked under {identity}: {rechecked} decision(s) re-checked, "
            f"{decisions} differ, {skipped} not re-checkable and skipped; {differ} run(s) differ")


def same_line(runs: int, decisions: int, identity: str) -> str:
    """The one line that counts the runs in which every decision is the same."""
    return f"the same today: every decision of {runs} run(s) ({decisions} in all); {identity}"


def assert_scope_line(stdout: str) -> None:
    last = stdout.rstrip("\n").split("\n")[-1]
    assert last.startswith("A re-check covers the gate's policy"), stdout
    for phrase in SCOPE_COVERS + SCOPE_LEAVES:
        assert phrase in last, f"the scope line does not say {phrase!r}: {last}"
    assert stdout.endswith(last + "\n")


# ---------------------------------------------------------------- the same configuration


def test_the_same_config_rechecks_every_decision_the_same(recorded, workdir):
    config = recorded.clone(workdir)
    identity = recorded_identity(recorded, workdir)
    done = recheck(config)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stderr == ""
    out = done.stdout
    assert "DIFFERENT" not in out and "skipped  " not in out

    evaluations = labelled(recorded, workdir)
    assert {label: len(e) for label, e in evaluations.items()} == {
        "balance": 1, "kim": 2, "refund": 1, "rex": 1, "liv": 3, "other": 1}
    # Nothing differs: the summary, one line that counts the runs, the scope (the runs one by
    # one are in -json, below, and with -run).
    lines = out.split("\n")
    assert lines[:2] == [summary_line(5, identity, 8, 0, 0),
                         same_line(5, 8, f'policy unchanged: "{identity}"')], out
    assert not [line for line in lines if line.startswith("run ")], out
    assert recorded.runs["other"] not in out  # another session's run is not this session's
    assert "run(s) re-checked under agentgate/sha256:" in out and "policy unchanged" in out
    assert_scope_line(out)


def test_the_json_report_is_one_object_per_run(recorded, workdir):
    config = recorded.clone(workdir)
    identity = recorded_identity(recorded, workdir)
    code, reports = recheck_json(config)
    assert code == 0
    assert isinstance(reports, list)
    assert [r["run_id"] for r in reports] == [recorded.runs[label] for label in NEWEST_FIRST]
    evaluations = labelled(recorded, workdir)
    for label, report in zip(NEWEST_FIRST, reports):
        assert report["run_status"] == STATUS[label]
        assert report["identity"] == "unchanged" and report["policy_id"] == identity
        assert report["spec_source"] == "recorded" and report["notes"] == []
        assert report["same"] is True and report["differences"] == 0
        assert report["rechecked"] == len(evaluations[label]) and report["not_recheckable"] == 0
        got = [(e["seq"], e["step_index"], e["on_resume"], e["tool"], e["result"], e["recorded"], e["rechecked"])
               for e in report["evaluations"]]
        assert got == [(e["seq"], e["step_index"], e["on_resume"], e["tool"], "same", e["outcome"], e["outcome"])
                       for e in evaluations[label]]
    # An approval's evaluation is the same only with the same approval hash: the one the
    # operator approved, rebuilt from the record.
    kim = reports[NEWEST_FIRST.index("kim")]["evaluations"]
    approved = approval_hash_of(workdir, recorded.runs["kim"])
    assert [(e["recorded_hash"], e["rechecked_hash"]) for e in kim] == [(approved, approved)] * 2
    assert [e["on_resume"] for e in kim] == [False, True]


def test_the_json_report_has_the_fields_the_reference_names(recorded, workdir):
    # Reference section 15: a report carries run_id, run_status, policy_id, identity,
    # spec_source, notes, evaluations and, in JSON, same, differences, rechecked,
    # not_recheckable, complete; each evaluation step_index, step_id, seq, tool, on_resume,
    # result, recorded, rechecked, recorded_hash, rechecked_hash, detail, spec_source, policy_id.
    config = recorded.clone(workdir)
    code, reports = recheck_json(config, "-run", recorded.runs["kim"])
    assert code == 0 and len(reports) == 1
    report = reports[0]
    missing = {"run_id", "run_status", "policy_id", "identity", "spec_source", "notes", "evaluations", "same",
               "differences", "rechecked", "not_recheckable", "complete"} - set(report)
    assert not missing, f"the report lacks {sorted(missing)}"
    for evaluation in report["evaluations"]:
        missing = {"step_index", "step_id", "seq", "tool", "on_resume", "result", "recorded", "rechecked",
                   "recorded_hash", "rechecked_hash", "detail", "spec_source", "policy_id"} - set(evaluation)
        assert not missing, f"an evaluation lacks {sorted(missing)}"
        assert evaluation["policy_id"] == report["policy_id"]
    assert report["complete"] is True


def test_a_rerun_after_an_unknown_outcome_rechecks_the_same(recorded, workdir):
    config = recorded.clone(workdir)
    run_id = recorded.runs["liv"]
    code, reports = recheck_json(config, "-run", run_id)
    assert code == 0 and len(reports) == 1
    report = reports[0]
    assert report["same"] is True and report["identity"] == "unchanged"
    summary = [(e["tool"], e["result"], e["recorded"], e["rechecked"], e["step_index"], e["on_resume"])
               for e in report["evaluations"]]
    assert summary == [("vault_pay", "same", "allow", "allow", 0, False),
                       ("vault_pay", "same", "require_approval", "require_approval", 1, False),
                       ("vault_pay", "same", "require_approval", "require_approval", 1, True)]
    # The re-checker rebuilds the interrupted attempt the gate held when it asked: both the
    # re-run's proposal and its collection hash to the interruption approval the operator approved.
    interruption = approval_hash_of(workdir, run_id, "interrupted_side_effect")
    for evaluation in report["evaluations"][1:]:
        assert evaluation["recorded_hash"] == evaluation["rechecked_hash"] == interruption
    (capability,) = query(workdir / DB, "SELECT capability_json FROM approvals WHERE run_id=?", (run_id,))[0]
    assert json.loads(capability)["interrupted"]["ended"] == "timed_out"


# ---------------------------------------------------------------- a changed configuration


def test_tightening_a_class_names_the_decisions_now_denied(recorded, workdir):
    config = recorded.clone(workdir, policy={"remote_mutation": "deny"})
    identity = recorded_identity(recorded, workdir)
    done = recheck(config)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    lines = out.split("\n")
    now = POLICY_ID_RE.search(out.split(" run(s) re-checked under ")[1]).group(0)
    assert now != identity
    assert f'policy changed: recorded "{identity}", given "{now}"' in out
    evaluations = labelled(recorded, workdir)
    denied = "require_approval -> deny: side effect remote_mutation is deny by policy"
    for e in evaluations["kim"] + evaluations["rex"]:
        assert report_line("DIFFERENT", e, denied) in lines, out
    assert out.count("DIFFERENT") == 3
    assert "bank_pay (on resume): require_approval -> deny" in out
    # The vault's pay is decided by its own rule, not the class map; the rest are unchanged,
    # and counted in one line after the differences.
    assert not [line for line in lines if line.startswith("same ")], out
    assert same_line(3, 5, f'policy changed: recorded "{identity}", given "{now}"') in lines, out
    assert lines[0] == summary_line(5, now, 8, 0, 2, decisions=3), out
    assert_scope_line(out)

    code, reports = recheck_json(config)
    assert code == 1
    same = {label: r["same"] for label, r in zip(NEWEST_FIRST, reports)}
    assert same == {"liv": True, "rex": False, "refund": True, "kim": False, "balance": True}
    assert {r["identity"] for r in reports} == {"changed"}
    assert {r["policy_id"] for r in reports} == {identity}


UNCHANGED = {
    "hold": {"hold": "5s"},
    "rule timeouts": {"bank": {"pay": {"timeout": "1m"}, "balance": {"timeout": "2s"}}, "vault": {"pay": {"timeout": "30s"}}},
    "server timeouts": {"bank_fields": {"default_timeout": "45s", "connect_timeout": "9s"}},
    "leases and ttls": {"lease_ttl": "10s", "approval_ttl": "1h", "grant_ttl": "2h"},
    "repeat windows and max_pending": {"repeat_window": "1m", "max_pending": 2, "bank": {"pay": {"repeat_window": "5s"}}},
    "descriptions": {"bank": {"pay": {"description": "Send money."}}, "vault": {"balance": {"description": "Look."}}},
    "deny lists": {"bank": {"pay": {"deny": ["memo"]}}},
    "commands and environment": {"bank_fields": {"command": [sys.executable, str(AGENTGATE), "fake-payments", "-v"],
                                                 "inherit_env": ["LANG"]}},
    "status tool": {"status_tool": "bank_status"},
    "a default made explicit": {"policy": {"read_only": "allow", "destructive": "deny"}},
}


@pytest.mark.parametrize("change", UNCHANGED.values(), ids=UNCHANGED.keys())
def test_a_change_the_policy_does_not_read_keeps_the_identity(recorded, workdir, change):
    config = recorded.clone(workdir, **change)
    identity = recorded_identity(recorded, workdir)
    done = recheck(config)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "DIFFERENT" not in done.stdout and "policy changed" not in done.stdout
    assert same_line(5, 8, f'policy unchanged: "{identity}"') in done.stdout.split("\n")
    assert summary_line(5, identity, 8, 0, 0) in done.stdout


# label -> the evaluations that differ (by label and position) and what they say now.
CHANGED = {
    "a class": ({"policy": {"read_only": "deny"}},
                {("balance", 0): ("deny", "side effect read_only is deny by policy")}),
    "a rule's class": ({"bank": {"pay": {"side_effect": "local_mutation"}}},
                       {("kim", 0): ("allow", "side effect local_mutation is allow by policy"),
                        ("kim", 1): ("allow", "side effect local_mutation is allow by policy"),
                        ("rex", 0): ("allow", "side effect local_mutation is allow by policy")}),
    "a rule's outcome": ({"bank": {"pay": {"outcome": "allow"}, "refund": {"outcome": "require_approval"}}},
                         {("kim", 0): ("allow", "tool bank_pay is allow by the operator's rule"),
                          ("kim", 1): ("allow", "tool bank_pay is allow by the operator's rule"),
                          ("rex", 0): ("allow", "tool bank_pay is allow by the operator's rule"),
                          ("refund", 0): ("require_approval", "tool bank_refund is require_approval by the "
                                                              "operator's rule")}),
    "a rename": ({"bank": {"pay": {"rename": "pay"}}},
                 {("kim", 0): ("deny", NOT_A_TOOL), ("kim", 1): ("deny", NOT_A_TOOL), ("rex", 0): ("deny", NOT_A_TOOL)}),
    "a fixed value changed": ({"vault": {"pay": {"fixed": {"currency": "USD"}}}},
                              {("liv", 1): ("require_approval", ANOTHER_APPROVAL),
                               ("liv", 2): ("require_approval", ANOTHER_APPROVAL)}),
    "a fixed value added": ({"bank": {"pay": {"fixed": {"memo": "rent"}}}},
                            {("kim", 0): ("require_approval", ANOTHER_APPROVAL),
                             ("kim", 1): ("require_approval", ANOTHER_APPROVAL),
                             ("rex", 0): ("require_approval", ANOTHER_APPROVAL)}),
    "the server's name": ({"bank_fields": {"name": "bank2"}},
                          {(label, i): ("deny", NOT_A_TOOL) for label, n in
                           (("balance", 1), ("kim", 2), ("refund", 1), ("rex", 1)) for i in range(n)}),
    "a rule removed": ({"bank": {"refund": None}}, {("refund", 0): ("deny", NOT_A_TOOL)}),
    # The identity names the rename even when it gives the tool the name it had: changed, and
    # every decision the same.
    "a rename to the same name": ({"bank": {"pay": {"rename": "bank_pay"}}}, {}),
}


@pytest.mark.parametrize("change,differ", CHANGED.values(), ids=CHANGED.keys())
def test_a_change_the_policy_reads_changes_the_identity(recorded, workdir, change, differ):
    config = recorded.clone(workdir, **change)
    identity = recorded_identity(recorded, workdir)
    code, reports = recheck_json(config)
    assert code == (1 if differ else 0)
    assert {r["identity"] for r in reports} == {"changed"}
    got = {}
    for label, report in zip(NEWEST_FIRST, reports):
        assert report["run_id"] == recorded.runs[label] and report["policy_id"] == identity
        mine = {(label, i): e for i, e in enumerate(report["evaluations"]) if e["result"] != "same"}
        assert all(e["result"] == "different" for e in mine.values()), mine
        assert report["same"] is (not mine) and report["differences"] == len(mine)
        got.update(mine)
    assert set(got) == set(differ)
    for key, (now, detail) in differ.items():
        assert got[key]["rechecked"] == now, got[key]
        assert detail in got[key]["detail"], got[key]

    done = recheck(config)
    assert done.returncode == code
    assert done.stdout.count("DIFFERENT") == len(differ)
    # One line for each run that differs, and one that counts the runs that do not.
    runs_differ = len({label for label, _ in differ})
    assert done.stdout.count(f'policy changed: recorded "{identity}", given "') == runs_differ + (runs_differ < 5)
    assert (f"decision(s) re-checked, {len(differ)} differ, 0 not re-checkable and skipped; {runs_differ} run(s) "
            f"differ\n") in done.stdout


# ---------------------------------------------------------------- which runs


def test_a_mistyped_session_finds_nothing(recorded, workdir):
    config = recorded.clone(workdir)
    done = recheck(config, "-session", "no-such-session")
    assert done.returncode == 1
    assert 'no run of session "no-such-session" was found, so nothing was re-checked' in done.stderr
    assert "0 run(s) re-checked" in done.stdout
    done = recheck(config, "-session", "no-such-session", "-json")
    assert done.returncode == 1
    assert done.stdout == "[]\n"


def test_another_session_is_rechecked_when_named(recorded, workdir):
    config = recorded.clone(workdir)
    code, reports = recheck_json(config, "-session", OTHER_SESSION)
    assert code == 0
    assert [r["run_id"] for r in reports] == [recorded.runs["other"]]
    assert recorded.runs["other"].startswith(f"{OTHER_SESSION}.") and SESSION != OTHER_SESSION


def test_run_rechecks_just_that_run(recorded, workdir):
    config = recorded.clone(workdir)
    done = recheck(config, "-run", recorded.runs["balance"])
    assert done.returncode == 0, done.stderr
    assert "1 run(s) re-checked" in done.stdout
    assert "bank_balance: allow" in done.stdout
    headers = [line for line in done.stdout.split("\n") if line.startswith("run ")]
    assert len(headers) == 1 and headers[0].startswith(f"run {recorded.runs['balance']} COMPLETED: "), done.stdout
    # A run of another session can be named too.
    code, reports = recheck_json(config, "-run", recorded.runs["other"])
    assert code == 0 and [r["run_id"] for r in reports] == [recorded.runs["other"]]


def test_limit_takes_the_newest_runs(recorded, workdir):
    config = recorded.clone(workdir)
    code, reports = recheck_json(config, "-limit", "2")
    assert code == 0
    assert [r["run_id"] for r in reports] == [recorded.runs["liv"], recorded.runs["rex"]]


@pytest.mark.parametrize("args", [["-run", "x", "-session", "y"], ["-limit", "0"], ["-limit", "-3"], ["-nope"],
                                  ["extra"], ["-limit", "many"]],
                         ids=["run-and-session", "limit-0", "limit-negative", "unknown-flag", "positional", "limit-word"])
def test_usage_errors_exit_2(recorded, workdir, args):
    config = recorded.clone(workdir)
    done = recheck(config, *args)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert done.stdout == ""
    assert done.stderr.startswith("agentgate: ") and "Traceback" not in done.stderr


def test_an_unknown_run_is_not_found(recorded, workdir):
    config = recorded.clone(workdir)
    done = recheck(config, "-run", "nope")
    assert done.returncode == 1
    assert "not found" in done.stderr and "Traceback" not in done.stderr


def test_nothing_recheckable_fails(recorded, workdir):
    # A damaged record: the tool specs the decisions were made for are gone (the state tables
    # are not chained, so nothing else notices), and no decision can be rebuilt.
    config = recorded.clone(workdir)
    with closing(sqlite3.connect(str(workdir / DB), timeout=30)) as db:
        assert db.execute("DELETE FROM tool_specs").rowcount > 0
        db.commit()
    (balance,) = labelled(recorded, workdir)["balance"]
    done = recheck(config, "-run", recorded.runs["balance"])
    assert done.returncode == 1
    assert "0 decision(s) re-checked, 0 differ, 1 not re-checkable and skipped" in done.stdout
    assert report_line("skipped", balance, "the recorded request is missing") in done.stdout.split("\n")
    assert "no decision of the policy was re-checked (1 not re-checkable)" in done.stderr


# ---------------------------------------------------------------- -current-tools


def test_current_tools_sees_a_reworded_description(recorded, clean_banks):
    workdir = clean_banks
    config = recorded.clone(workdir, bank={"pay": {"description": "Send money to someone, at once."}})
    identity = recorded_identity(recorded, workdir)
    plain = recheck(config)
    assert plain.returncode == 0, f"{plain.stdout}\n{plain.stderr}"
    assert "DIFFERENT" not in plain.stdout and f'policy unchanged: "{identity}"' in plain.stdout

    done = recheck(config, "-current-tools", "-json")
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    reports = json.loads(done.stdout)
    assert [r["run_id"] for r in reports] == [recorded.runs[label] for label in NEWEST_FIRST]
    assert "bank: registered pay as bank_pay (remote_mutation)" in done.stderr
    for label, report in zip(NEWEST_FIRST, reports):
        assert report["spec_source"] == "current" and report["identity"] == "unchanged"
        for e in report["evaluations"]:
            assert e["spec_source"] == "current"
            if label in ("kim", "rex"):
                assert (e["result"], e["recorded"], e["rechecked"]) == ("different", "require_approval",
                                                                        "require_approval"), e
                assert "tool spec" in e["detail"] and e["recorded_hash"] != e["rechecked_hash"], e
                assert HEX64.fullmatch(e["rechecked_hash"]), e
            else:
                assert e["result"] == "same", e
    assert [len(r["evaluations"]) for r in reports] == [3, 1, 1, 2, 1]
    wait_for(lambda: not fake_banks(workdir), 30, message="the servers recheck started to exit")


def test_current_tools_applies_the_current_schema(recorded, clean_banks):
    # Denying a parameter is outside the identity and outside a plain re-check (the scope line
    # says so); with -current-tools the recorded arguments fail the current schema.
    workdir = clean_banks
    config = recorded.clone(workdir, bank={"pay": {"deny": ["to"]}})
    assert recheck(config).returncode == 0
    code, reports = recheck_json(config, "-current-tools")
    assert code == 1
    for label, report in zip(NEWEST_FIRST, reports):
        for e in report["evaluations"]:
            if label in ("kim", "rex"):
                assert (e["result"], e["rechecked"]) == ("different", "invalid"), e
                assert 'parameter "to" is denied by the operator' in e["detail"], e
            else:
                assert e["result"] == "same", e
    wait_for(lambda: not fake_banks(workdir), 30, message="the servers recheck started to exit")


# ---------------------------------------------------------------- read only, no server


def test_recheck_writes_nothing(recorded, clean_banks):
    workdir = clean_banks
    config = recorded.clone(workdir)
    db = workdir / DB
    before = file_state(db)
    for args, code in (((), 0), (("-json",), 0), (("-session", "no-such-session"), 1),
                       (("-run", recorded.runs["kim"]), 0), (("-current-tools",), 0)):
        done = recheck(config, *args)
        assert done.returncode == code, f"recheck {args}: {done.stdout}\n{done.stderr}"
        assert file_state(db) == before, f"recheck {' '.join(args)} changed the database or its -wal"


WRAPPER = """import os, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
os.execv(sys.executable, [sys.executable, sys.argv[2], "fake-payments"])
"""


def test_recheck_starts_no_server_without_current_tools(recorded, clean_banks):
    workdir = clean_banks
    wrapper = workdir / "started.py"
    wrapper.write_text(WRAPPER)
    marks = {name: workdir / f"{name}.started" for name in ("bank", "vault")}
    config = recorded.clone(workdir, **{f"{name}_fields": {"command": [sys.executable, str(wrapper), str(mark),
                                                                        fake_argv()[1]]}
                                        for name, mark in marks.items()})
    done = recheck(config)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    done = recheck(config, "-json")
    assert done.returncode == 0
    assert not any(mark.exists() for mark in marks.values()), "recheck started a server without -current-tools"
    assert not fake_banks(workdir)
    # The same config does start both servers when asked to load the current tools.
    done = recheck(config, "-current-tools")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert all(mark.exists() for mark in marks.values())
    wait_for(lambda: not fake_banks(workdir), 30, message="the servers recheck started to exit")


# ---------------------------------------------------------------- what each decision records


def test_every_decision_records_the_identity_and_the_tool_spec(recorded, workdir):
    recorded.clone(workdir)
    identity = recorded_identity(recorded, workdir)
    rows = query(workdir / DB, "SELECT s.id, s.policy_id, s.spec_hash, r.tool FROM steps s JOIN runs r ON "
                               "r.id = s.run_id WHERE s.policy_json != '' ORDER BY s.rowid")
    # An allowed read's one step is its run.read event, which carries the same two fields.
    for step_id, payload, tool in query(workdir / DB, "SELECT e.step_id, e.payload_json, r.tool FROM events e "
                                                      "JOIN runs r ON r.id = e.run_id WHERE e.type='run.read'"):
        policy = json.loads(payload)["policy"]
        rows.append((step_id, policy["policy_id"], policy["spec_hash"], tool))
    # 9 evaluations of both sessions on 7 steps: kim's and the re-run's are evaluated again on resume.
    assert len(rows) == 7
    for step_id, policy_id, spec_hash, tool in rows:
        assert policy_id == identity
        (spec,) = query(workdir / DB, "SELECT spec_json FROM tool_specs WHERE hash=?", (spec_hash,))[0]
        assert json.loads(spec)["name"] == tool


def test_every_policy_event_names_the_tool_spec_it_was_made_for(recorded, workdir):
    # Reference sections 2.5 and 3.5: the chained policy event carries policy_id and
    # spec_hash, so the audit chain binds which tool (as described and classified) a decision
    # was made for, not only the unchained steps table.
    recorded.clone(workdir)
    evaluations = policy_evaluations(workdir / DB)
    assert any(e["tool"] == "bank_balance" for e in evaluations)  # reads are among them
    for e in evaluations:
        # The chained policy record: a step.policy part of its event (a call's begin, or a
        # later change of its run), or an allowed read's one run.read event.
        recorded_event = e["recorded"]
        step = query(workdir / DB, "SELECT spec_hash FROM steps WHERE id=?", (e["step_id"],))
        if not step:
            # An allowed read's decision is chained in its one run.read event, under "policy";
            # the event is its step, so the spec it names must be kept and be the tool's.
            spec_hash = recorded_event["spec_hash"]
            (spec,) = query(workdir / DB, "SELECT spec_json FROM tool_specs WHERE hash=?", (spec_hash,))[0]
            assert json.loads(spec)["name"] == e["tool"]
        else:
            spec_hash = step[0][0]
        assert recorded_event.get("policy_id") == e["policy_id"] and e["policy_id"]
        assert recorded_event.get("spec_hash") == spec_hash, f"step.policy at seq {e['seq']}: {recorded_event}"
