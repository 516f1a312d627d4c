"""The status tool: what waits for an operator, and what became of an approval, read from the
database only; it never executes, decides or records anything.

Ported from the reference suite (agentrt-tests.md):
- proxy_test.go TestProxy_StatusToolReportsAndNeverExecutes,
  TestProxy_StatusSaysWhetherAnApprovedRequestExecuted;
- config_test.go TestProxy_StatusToolNameClashRefused.
Differences on purpose: no clock to skew, so the expired forms come from a second agentgate
process started with a 1s approval_ttl on the same database; "the decider switched to deny" is
a rewritten config and a fresh process. The server-reported-failure form of "APPROVED and
executed" is added (the fake bank's `mode: error`).
"""

import re

from conftest import RawStdio, agentgate_argv
from kit import Bank, check, wait_until_past


def status(bank, host, approval_id=None, **args):
    if approval_id is not None:
        args["approval_id"] = approval_id
    return bank.call(host, args, tool="gate_status")


def writes(bank) -> tuple:
    """Everything a status call could have written: runs, events, approvals as they stand."""
    return (bank.query("SELECT count(*) FROM runs")[0][0], bank.query("SELECT count(*) FROM events")[0][0],
            bank.query("SELECT id, status, decided_at FROM approvals ORDER BY rowid"))


def test_status_tool_reports_and_never_executes(workdir):
    bank = Bank(workdir)
    host = bank.start()
    quiet = status(bank, host)
    assert quiet.prefix == "GATE_STATUS" and not quiet.is_error, quiet
    assert "no request" in quiet.text
    assert not bank.query("SELECT 1 FROM runs")  # the status call is not a run

    pays = [{"to": "a", "amount": 1}, {"to": "b", "amount": 2}, {"to": "c", "amount": 3}]
    pending = [bank.pending(bank.call(host, pay)) for pay in pays]
    ids = [approval for _, approval in pending]
    listing = status(bank, host)
    assert listing.prefix == "GATE_STATUS" and not listing.is_error
    assert "3 requests" in listing.text and "PENDING" in listing.text
    assert all(approval in listing.text for approval in ids)
    assert len([line for line in listing.text.splitlines() if line.startswith("- ")]) == 3

    bank.approve(pending[0][0], ids[0])
    bank.reject(pending[1][0], "wrong account")
    before = writes(bank)

    approved = status(bank, host, ids[0])
    assert approved.prefix == "GATE_STATUS" and "APPROVED" in approved.text, approved
    assert "Call bank_pay again with exactly the same arguments" in approved.text
    assert status(bank, host, f"  {ids[0]} ").text == approved.text  # the id is trimmed
    rejected = status(bank, host, ids[1])
    assert "REJECTED" in rejected.text and "wrong account" in rejected.text, rejected
    waiting = status(bank, host, ids[2])
    assert "PENDING" in waiting.text and ids[2] in waiting.text, waiting
    one = status(bank, host)
    assert one.text.startswith("GATE_STATUS: 1 request in this session is waiting"), one
    assert ids[2] in one.text and ids[0] not in one.text

    unknown = status(bank, host, "nope")
    assert unknown.prefix == "GATE_STATUS" and not unknown.is_error and "nope" in unknown.text, unknown
    for bad in ({"run": "x"}, {"approval_id": 5}, {"approval_id": "x", "extra": 1}):
        answer = bank.call(host, bad, tool="gate_status")
        assert answer.prefix == "INVALID" and answer.is_error, (bad, answer)

    # however often it is asked, an approved request is not executed by the status tool
    assert writes(bank) == before
    assert bank.run(pending[0][0])["status"] == "WAITING_FOR_APPROVAL"
    assert bank.payments() == 0
    host.close()

    # a question left unanswered past its expiry
    bank.write(approval_ttl="1s")
    host = bank.start()
    run, short = bank.pending(bank.call(host, {"to": "d", "amount": 4}))
    wait_until_past(bank.approval(short)["expires_at"], 0, "the approval's expiry")
    before = writes(bank)
    lapsed = status(bank, host, short)
    assert "EXPIRED" in lapsed.text and "not executed" in lapsed.text, lapsed
    still = status(bank, host)
    assert short not in still.text and ids[2] in still.text and "1 request" in still.text, still
    assert writes(bank) == before
    assert bank.payments() == 0


def test_status_says_whether_an_approved_request_executed(workdir):
    bank = Bank(workdir)
    host = bank.start()
    pam, quy, ray, zed = ({"to": "pam", "amount": 1}, {"to": "quy", "amount": 2}, {"to": "ray", "amount": 3},
                          {"to": "zed", "amount": 1, "mode": "error"})
    pending = [bank.pending(bank.call(host, pay)) for pay in (pam, quy, ray, zed)]
    for run, approval in pending:
        bank.approve(run, approval)
    ids = [approval for _, approval in pending]

    assert "APPROVED, awaiting collection" in status(bank, host, ids[0]).text
    assert bank.call(host, pam).text == "paid 1.00 to pam"
    assert "APPROVED and executed, and it succeeded" in status(bank, host, ids[0]).text

    failed = bank.call(host, zed)
    assert failed.is_error and "card declined for zed" in failed.text, failed
    told = status(bank, host, ids[3]).text
    assert "APPROVED and executed, and the server reported a failure" in told and "card declined" in told, told

    bank.cancel(pending[1][0], "changed my mind")
    assert "APPROVED but not executed: an operator cancelled it" in status(bank, host, ids[1]).text
    host.close()

    bank.write(policy={"read_only": "allow", "remote_mutation": "deny"})
    host = bank.start()
    denied = bank.call(host, ray)
    assert denied.prefix == "DENIED" and denied.is_error, denied
    assert "APPROVED but not executed: the policy denied it when it was collected" in \
        status(bank, host, ids[2]).text
    assert bank.payments() == 2  # pam, and zed's declined attempt (the bank records it before declining)
    assert [line["to"] for line in bank.ledger_lines()] == ["pam", "zed"]


def test_status_tool_name_clash_refused(workdir):
    bank = Bank(workdir, rules={"balance": {"rename": "gate_status"}})
    done = check(bank.config)
    assert done.returncode == 1, done
    assert "status tool" in done.stderr and "status_tool" in done.stderr and "rename" in done.stderr
    assert "Traceback" not in done.stderr

    serving = RawStdio(agentgate_argv("-config", str(bank.config)))
    try:
        serving.send({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})  # servers start
        assert serving.wait(60) == 1
        assert re.search(r"status tool.*status_tool", serving.stderr_text()), serving.stderr_text()
    finally:
        serving.close()

    bank.write(rules={"balance": {"rename": "gate_status"}}, status_tool="bank_status")
    done = check(bank.config)
    assert done.returncode == 0, done.stderr
    assert "status tool: bank_status" in done.stdout
    host = bank.start()
    assert {tool.name for tool in host.list_tools()} == {"gate_status", "bank_pay", "bank_refund", "bank_status"}
    quiet = bank.call(host, {}, tool="bank_status")
    assert quiet.prefix == "GATE_STATUS" and not quiet.is_error, quiet
    balance = bank.call(host, {"account": "q"}, tool="gate_status")
    assert balance.text == "account q holds 120.00 EUR", balance
    assert bank.payments() == 0
