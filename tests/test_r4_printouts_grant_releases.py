"""A grant releases the calls already waiting that it covers (issue 29 item 9).

The natural moment to grant is in answer to a waiting call. The grant's printout lists every
waiting approval it covers, whole, as what it will release; once confirmed, each is approved
by the grant (recorded as decided by it, bound to the hash of the row printed), and the call
runs once. A waiting call the grant does not cover stays waiting.
"""

import json

from kit import Bank, bankdir  # noqa: F401 (fixture)

TODO = {"/to": {"in": ["todo-deploy", "todo-rent"]}}


def test_a_grant_releases_the_waiting_call_it_covers_and_it_runs_once(bankdir):
    bank = Bank(bankdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "todo-deploy", "amount": 7}))
    other_run, other = bank.pending(bank.call(host, {"to": "mallory", "amount": 7}))
    done = bank.operator("grant", "bank_pay", "-if", json.dumps(TODO), "-yes")
    assert done.returncode == 0, done
    printout, made = done.stdout.split("\ngrant ", 1)
    assert "releases       1 calls waiting now" in printout, printout
    assert f"APPROVAL WAITING  {approval}" in printout and '"todo-deploy"' in printout
    assert other not in printout
    grant_id = made.split(":", 1)[0]
    assert f"approval {approval}:" in made, done.stdout
    decided = bank.approval(approval)
    assert decided["status"] == "approved" and decided["decided_by"] == f"grant {grant_id}"
    assert bank.approval(other)["status"] == "pending"
    assert bank.payments() == 0
    paid = bank.call(host, {"to": "todo-deploy", "amount": 7})
    assert paid.text == "paid 7.00 to todo-deploy", paid
    assert bank.call(host, {"to": "todo-deploy", "amount": 7}).prefix == "DUPLICATE"
    assert bank.payments() == 1
    assert bank.call(host, {"to": "mallory", "amount": 7}).prefix == "PENDING_APPROVAL"
    assert bank.payments() == 1


def test_a_grant_that_covers_no_waiting_call_says_so(bankdir):
    bank = Bank(bankdir)
    host = bank.start()
    bank.pending(bank.call(host, {"to": "mallory", "amount": 7}))
    done = bank.operator("grant", "bank_pay", "-if", json.dumps(TODO), "-yes")
    assert done.returncode == 0, done
    assert "releases       no call" in done.stdout, done.stdout
    assert [a["status"] for a in bank.approvals()] == ["pending"]
