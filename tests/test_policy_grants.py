"""Standing approvals (`grant`, `grants`, `revoke`) and `"operator": "none"`, end to end: an
SDK host calls agentgate in front of the fake bank, an operator grants in another process.

SPEC "Policy on what a call does", issue 10 item 4 and 5: a grant answers only what would
wait for an operator, never a deny and never a re-run of an unknown outcome; it is printed in
full and confirmed like an approval, recorded in the event chain, and shown in `show` for every
call it lets through; limits still count the calls it lets through. With no operator at hand,
what would wait is denied unless a grant covers it. Not in the reference (agentrt has no
grants), so nothing here is ported.
"""

import json
import re

from kit import Bank, agentgate, event_rows, operator, release
from kit import bankdir  # noqa: F401 (fixture)

SMALL = {"/amount": {"max": 20}}


def grant(bank, tool="bank_pay", *extra, ok=True):
    done = operator(bank.config, "grant", tool, *extra, ok=False)
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def grant_id(done) -> str:
    return re.search(r"^grant ([0-9a-f]{16}): in force", done.stdout, re.M).group(1)


def test_a_grant_lets_matching_calls_run_without_asking(bankdir):
    workdir = bankdir
    bank = Bank(workdir)
    done = grant(bank, "bank_pay", "-if", json.dumps(SMALL), "-for", "2h", "-note", "rent week",
                 "-yes")
    gid = grant_id(done)
    # Printed in full before it is made: tool, what it covers, until when, who, the promise.
    for fragment in ("bank_pay", "/amount is at most 20", "until", "rent week",
                     "never turns a deny into anything else", f"grant {gid}: in force"):
        assert fragment in done.stdout, fragment
    host = bank.start()
    paid = bank.call(host, {"to": "bob", "amount": 15})
    assert not paid.is_error and paid.text == "paid 15.00 to bob", paid
    asked = bank.call(host, {"to": "bob", "amount": 25})
    assert asked.prefix == "PENDING_APPROVAL", asked
    assert bank.payments() == 1
    # show names the grant for the call it let through.
    run_id = bank.run_ids()[0]
    shown = operator(bank.config, "show", run_id)
    assert f"allow (grant {gid})" in shown.stdout and f"ran under grant {gid}" in shown.stdout
    assert "rent week" in shown.stdout
    policy = [json.loads(s["policy"]) if isinstance(s["policy"], str) else s["policy"]
              for s in bank.show(run_id)["steps"] if s["policy"]]
    assert policy[0]["grant"] == gid and policy[0]["by"] == f"grant {gid}"
    # Listed, and in the chain, which still verifies.
    listed = json.loads(operator(bank.config, "grants", "-json").stdout)
    assert [g["id"] for g in listed] == [gid] and listed[0]["state"] == "in force"
    types = [row[4] for row in event_rows(bank.db_path)]
    assert "grant.created" in types
    assert operator(bank.config, "verify").returncode == 0


def test_a_grant_never_turns_a_deny(bankdir):
    workdir = bankdir
    bank = Bank(workdir, rules={"pay": {"when": [
        {"if": {"/amount": {"min": 10}}, "outcome": "deny", "reason": "too much"}]}})
    grant(bank, "bank_pay", "-yes")
    host = bank.start()
    denied = bank.call(host, {"to": "bob", "amount": 15})
    assert denied.prefix == "DENIED" and "too much" in denied.text, denied
    destructive = bank.call(host, {"payment": "p1"}, tool="bank_refund")
    assert destructive.prefix == "DENIED", destructive
    assert bank.payments() == 0


def test_a_revoked_grant_covers_nothing_more(bankdir):
    workdir = bankdir
    bank = Bank(workdir)
    gid = grant_id(grant(bank, "bank_pay", "-yes"))
    host = bank.start()
    assert not bank.call(host, {"to": "ann", "amount": 5}).is_error
    revoked = operator(bank.config, "revoke", gid, "-note", "enough")
    assert revoked.returncode == 0 and f"grant {gid}: revoked" in revoked.stdout
    assert bank.call(host, {"to": "ann", "amount": 6}).prefix == "PENDING_APPROVAL"
    assert bank.payments() == 1
    again = operator(bank.config, "revoke", gid, ok=False)
    assert again.returncode == 1 and "not in force" in again.stderr
    state = json.loads(operator(bank.config, "grants", "-json").stdout)[0]["state"]
    assert state.startswith("revoked at")
    assert "grant.revoked" in [row[4] for row in event_rows(bank.db_path)]


def test_limits_still_count_what_a_grant_lets_through(bankdir):
    workdir = bankdir
    bank = Bank(workdir, rules={"pay": {"limits": [{"calls": 2, "per": "1h", "then": "deny"}]}})
    grant(bank, "bank_pay", "-yes")
    host = bank.start()
    for i in range(2):
        assert not bank.call(host, {"to": f"p{i}", "amount": 1}).is_error
    third = bank.call(host, {"to": "p2", "amount": 1})
    assert third.prefix == "DENIED" and "at most 2 calls" in third.text, third
    assert bank.payments() == 2


def test_with_no_operator_what_would_wait_is_denied_unless_granted(bankdir):
    workdir = bankdir
    bank = Bank(workdir, operator="none")
    host = bank.start()
    denied = bank.call(host, {"to": "bob", "amount": 5})
    assert denied.prefix == "DENIED" and "no operator is at hand" in denied.text, denied
    assert bank.approvals() == [] and bank.payments() == 0
    assert not bank.call(host, {"account": "main"}, tool="bank_balance").is_error
    grant(bank, "bank_pay", "-if", json.dumps(SMALL), "-yes")
    assert not bank.call(host, {"to": "bob", "amount": 6}).is_error
    assert bank.call(host, {"to": "bob", "amount": 60}).prefix == "DENIED"
    assert bank.payments() == 1


def test_a_grant_is_refused_when_it_cannot_be_what_it_says(bankdir):
    workdir = bankdir
    bank = Bank(workdir, grant_ttl="2h")
    cases = [
        (["bank_nothing", "-yes"], "no configured tool is named"),
        (["bank_pay", "-if", "{not json", "-yes"], "-if is not usable JSON"),
        (["bank_pay", "-if", '{"/amout": {"max": 1}}', "-yes"], "/amout"),
        (["bank_pay", "-if", '{"amount": {"max": 1}}', "-yes"], "not a JSON Pointer"),
        (["bank_pay", "-if", '{"/amount": {"maximum": 1}}', "-yes"], "unknown field"),
        (["bank_pay", "-for", "3h", "-yes"], "at most grant_ttl"),
        (["bank_pay", "-for", "soon", "-yes"], "-for is a duration"),
        (["bank_pay"], "refusing without -yes"),
    ]
    for args, fragment in cases:
        done = operator(bank.config, "grant", *args, ok=False)
        assert done.returncode in (1, 2), (args, done)
        assert fragment in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert not bank.db_path.exists()  # nothing was granted, nor any file made


def test_a_grant_is_confirmed_at_a_terminal_question(bankdir):
    """Without -yes the grant is asked about; anything but yes grants nothing. (stdin is not a
    terminal here, so the refusal is what a script gets; the interactive path is the same
    input() as approve's, covered by the approval tests' terminal runs.)"""
    workdir = bankdir
    bank = Bank(workdir)
    done = agentgate("grant", "bank_pay", "-config", str(bank.config))
    assert done.returncode == 2 and "refusing without -yes" in done.stderr
    assert "GRANT" in done.stdout  # printed in full before the question
    assert not bank.db_path.exists()


def test_a_grant_never_re_runs_an_unknown_outcome(bankdir):
    """A payment that times out may have gone through: its re-run, and every other payment
    while it is unknown, wait for an operator's decision about that attempt, grant or not."""
    workdir = bankdir
    bank = Bank(workdir, rules={"pay": {"timeout": "1s"}})
    grant(bank, "bank_pay", "-yes")
    host = bank.start()
    blocked = {"to": "kim", "amount": 7, "mode": "block"}
    first = bank.call(host, blocked)
    assert first.prefix == "UNKNOWN_OUTCOME", first
    assert bank.payments() == 1
    release(workdir)
    again = bank.call(host, blocked)
    assert again.prefix == "UNKNOWN_OUTCOME" and again.approval_id() == first.approval_id()
    other = bank.call(host, {"to": "lou", "amount": 1})
    assert other.prefix == "BLOCKED", other
    assert bank.payments() == 1
    assert [a["kind"] for a in bank.approvals("pending")] == ["interrupted_side_effect"]
