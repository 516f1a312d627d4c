"""Shortened ids (issue 12): a run, an approval or a grant may be named by any unique prefix of
at least 6 characters (a run's with or without its session); a prefix several ids share is
refused with the candidates listed, and nothing is decided on a guess.

Ids begin with the time, so two runs made in the same minute share their first characters; a
test that needs two ids to share a prefix uses the session name (every run id starts with it)
or the ids' own common part, never luck.
"""

import json
import re
import os

from kit import Bank, agentgate


def common(a: str, b: str) -> str:
    return os.path.commonprefix([a, b])


def hex_part(run_id: str) -> str:
    return run_id.split(".", 1)[1]


def test_approve_and_show_take_a_prefix_of_six(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    shown = bank.operator("show", hex_part(run)[:6], "-json")
    assert shown.returncode == 0, shown
    assert json.loads(shown.stdout)["run"]["run"] == run
    decided = bank.approve(hex_part(run)[:6], approval[:6])
    assert f"approval {approval}: approved" in decided.stdout
    assert bank.call(host, {"to": "tia", "amount": 2}).text == "paid 2.00 to tia"
    # the session's part may be given too
    assert json.loads(bank.operator("show", run[:len("test.") + 6], "-json").stdout)["run"]["run"] == run


def test_a_prefix_two_ids_share_is_refused_with_both_listed(workdir):
    bank = Bank(workdir, session="gating")
    host = bank.start()
    first, _ = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    second, approval = bank.pending(bank.call(host, {"to": "bo", "amount": 3}))
    for given in ("gating", "gating." + common(hex_part(first), hex_part(second))[:10]):
        if len(given) < 6:
            continue
        refused = bank.operator("approve", given, "-yes")
        assert refused.returncode == 1, refused
        assert "ambiguous" in refused.stderr and first in refused.stderr and second in refused.stderr
        assert "Traceback" not in refused.stderr
    assert [a["status"] for a in bank.approvals()] == ["pending", "pending"]
    # one character past what they share tells them apart
    # (an approval id is looked up too, and one made between the two runs may share more)
    shared = max(len(common(hex_part(second), other)) for other in
                 [hex_part(first)] + [a["id"] for a in bank.approvals() if a["id"] != approval])
    decided = bank.approve(hex_part(second)[:max(6, shared + 1)], None, "-yes")
    assert f"approval {approval}: approved" in decided.stdout
    assert bank.approval(approval)["status"] == "approved"


def test_approve_looks_among_runs_in_every_state(workdir):
    # Issue 19 item 1: a prefix is resolved among all runs, not narrowed to those that wait.
    bank = Bank(workdir, session="gating")
    host = bank.start()
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text == "account A-1 holds 120.00 EUR"
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    assert len(bank.run_ids()) == 2
    # "gating" starts both runs; that only one waits for a decision does not tell them apart
    assert bank.operator("show", "gating").returncode == 1
    refused = bank.approve("gating", None, "-yes", ok=False)
    assert refused.returncode == 1 and "ambiguous" in refused.stderr, refused
    assert bank.approval(approval)["status"] == "pending"
    decided = bank.approve(run, None, "-yes")
    assert f"approval {approval}: approved" in decided.stdout


def test_short_unknown_and_grant_prefixes(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    short = bank.operator("show", hex_part(run)[:5])
    assert short.returncode == 1 and "at least 6 characters" in short.stderr, short
    unknown = bank.operator("show", "ffffffff")
    assert unknown.returncode == 1 and "not found" in unknown.stderr, unknown
    wrong = bank.approve(run, "ffffffff", ok=False)
    assert wrong.returncode == 1 and "approval \"ffffffff\" not found" in wrong.stderr, wrong
    assert bank.approval(approval)["status"] == "pending"

    granted = bank.operator("grant", "bank_pay", "-for", "1h", "-yes")
    assert granted.returncode == 0, granted
    grant_id = re.search(r"^grant ([0-9a-f]{16}): in force", granted.stdout, re.M).group(1)
    revoked = bank.operator("revoke", grant_id[:6], "-yes")
    assert revoked.returncode == 0 and f"grant {grant_id}: revoked" in revoked.stdout, revoked


def test_a_database_named_directly_finds_a_run_by_the_part_after_its_session(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    shown = agentgate("show", "-db", str(bank.db_path), hex_part(run)[:8], "-json")
    assert shown.returncode == 0, shown
    assert json.loads(shown.stdout)["run"]["run"] == run


def test_cancel_looks_among_runs_in_every_state(workdir):
    # Issue 19 item 1: a prefix is resolved among all runs, not narrowed to those not ended.
    bank = Bank(workdir, session="gating")
    host = bank.start()
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text == "account A-1 holds 120.00 EUR"
    run, _ = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    refused = bank.cancel("gating", "not today", ok=False)
    assert refused.returncode == 1 and "ambiguous" in refused.stderr, refused
    assert bank.run(run)["status"] == "WAITING_FOR_APPROVAL"
    cancelled = bank.cancel(run, "not today")
    assert f"run {run}: CANCELLED" in cancelled.stdout, cancelled
