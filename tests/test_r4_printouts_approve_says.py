"""What approve says happens next (issue 29 item 8).

Approved while the model's call is still held, the held call takes the approval up and runs it
in place: approve says so (and that the model need not call again), never "it runs when the
model calls again", which sends a person to ask for a retry that would be a duplicate. Approved
once the hold is over, the model's identical call runs it, and approve says that.
"""

from conftest import wait_for
from kit import DEADLINE
from kit import Bank, bankdir  # noqa: F401 (fixture)


def test_approved_within_the_hold_approve_says_the_held_call_runs_it(bankdir):
    bank = Bank(bankdir, hold="120s")
    host = bank.start()
    call = host.submit("bank_pay", {"to": "carol", "amount": 3})
    run, approval = wait_for(lambda: bank.hints() and bank.hints()[0], DEADLINE,
                             message="the operator hint")
    done = bank.approve(run, approval)
    assert "took it up and runs it now" in done.stdout, done.stdout
    assert "need not call again" in done.stdout
    assert "calls the tool again" not in done.stdout
    assert "WAITING_FOR_APPROVAL" not in done.stdout, done.stdout
    result = call.result()
    assert not result.is_error and "paid 3.00 to carol" in result.content[0].text
    assert bank.payments() == 1


def test_approved_after_the_hold_approve_says_the_identical_call_runs_it(bankdir):
    bank = Bank(bankdir)  # hold 0s: the model was answered PENDING_APPROVAL at once
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "dan", "amount": 4}))
    done = bank.approve(run, approval)
    assert "its hold ended" in done.stdout and "calls the tool again" in done.stdout, done.stdout
    assert "took it up" not in done.stdout
    assert bank.payments() == 0
    assert bank.call(host, {"to": "dan", "amount": 4}).text == "paid 4.00 to dan"
    assert bank.payments() == 1
