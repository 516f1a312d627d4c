"""The operator's side of an approval: what `approve` shows, when it decides, and what it refuses.

Ported from the reference suite (agentrt-tests.md), approval_test.go, re-expressed through the
gate (a real agentgate serving the SDK host, the operator commands as separate processes):
- TestApproval_TamperedRowRefused -> test_a_tampered_row_is_refused_and_never_collected
  (request_json edited in SQL; approve refuses it; an approved row altered afterwards is never
  collected).
- TestApproval_RejectCancelsRun -> test_reject_then_approve_fails.
- TestCancel_ApprovedButUnresumedRun -> test_cancel_of_an_approved_request_never_collected.
- TestApproval_RecordedWithHash -> checked in test_approve_prints_the_approval_in_full.
Added for issue 3: approve prints the approval in full and refuses to decide at a stdin that is
not a terminal without -approval or -yes; at a terminal it decides only after "yes"; -by
defaults to the operating system's user name; the hint agentgate writes to stderr can be pasted
as it is; `show -json` reports the arguments as recorded.

A row changed between being printed and being decided is hard to race from outside; what is
checked instead is the same guard from the other side: a row whose stored fields no longer hash
to its hash is refused by approve and by the gate.
"""

import json
import os
import pwd
import re
import shlex
import signal
import subprocess

from conftest import agentgate_argv
from kit import DEADLINE, Bank, agentgate

LONG = "x" * 600


def line_matching(text: str, pattern: str) -> str:
    found = [line for line in text.splitlines() if re.search(pattern, line)]
    assert len(found) == 1, f"{pattern!r} matched {found!r} in:\n{text}"
    return found[0]


def test_approve_prints_the_approval_in_full(workdir):
    bank = Bank(workdir, rules={"pay": {"fixed": {"currency": "EUR"}}})
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": LONG, "amount": 4}))
    stored = bank.approval(approval)
    assert stored["kind"] == "remote_mutation" and stored["status"] == "pending" and stored["run_id"] == run

    shown = bank.approve(run, None, ok=False)  # neither -approval nor -yes, stdin not a terminal
    assert shown.returncode == 2, shown
    assert "-full" in shown.stderr  # the long value was shortened: no decision on that printout
    assert "Traceback" not in shown.stderr
    out = shown.stdout
    assert approval in out.splitlines()[0]
    line_matching(out, r"^\s*server\s+bank\s*$")
    line_matching(out, r"^\s*upstream tool\s+pay\s*$")
    line_matching(out, r"^\s*amount = 4\s+\(1 bytes?\)\s*$")
    long_line = line_matching(out, r"^\s*to = \"x")
    assert "(600 bytes)" in long_line and len(long_line) < 600  # long values are shown bounded
    fixed_at = out.index("fixed values")
    assert re.search(r"^\s*currency = \"EUR\"\s+\(3 bytes\)\s*$", out[fixed_at:], re.M)
    assert "May the model call pay on server bank with these arguments?" in line_matching(out, r"^\s*question\s")
    assert "side effect remote_mutation is require_approval by policy" in line_matching(out, r"^\s*reason\s")
    assert out.rstrip().splitlines()[-1] == f"----- end of approval {approval} for tool bank_pay -----"

    # nothing was decided and nothing ran
    assert bank.approval(approval)["status"] == "pending"
    assert not bank.query("SELECT 1 FROM events WHERE type='approval.decided'")
    assert bank.payments() == 0

    fast = bank.approve(run, approval, ok=False)  # -approval decides at once, but not unseen bytes
    assert fast.returncode == 2 and "-full" in fast.stderr, fast
    assert bank.approval(approval)["status"] == "pending"
    whole = bank.approve(run, approval, "-full")
    assert f'to = "{LONG}"   (600 bytes)' in whole.stdout
    assert bank.call(host, {"to": LONG, "amount": 4}).text == f"paid 4.00 to {LONG}"
    assert bank.ledger_lines() == [{"amount": 4, "currency": "EUR", "to": LONG}]
    assert bank.payments() == 1


def test_approve_at_a_terminal_decides_only_after_yes(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))

    def at_terminal(typed: bytes) -> subprocess.CompletedProcess:
        controller, terminal = os.openpty()
        try:
            proc = subprocess.Popen(agentgate_argv("approve", run, "-config", str(bank.config)),
                                    stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            os.write(controller, typed)
            try:
                out, err = proc.communicate(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        finally:
            os.close(terminal)
            os.close(controller)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())

    declined = at_terminal(b"no\n")
    assert declined.returncode != 0, declined
    assert "end of approval" in declined.stdout
    assert bank.approval(approval)["status"] == "pending"
    assert bank.call(host, {"to": "tia", "amount": 2}).prefix == "PENDING_APPROVAL"

    accepted = at_terminal(b"yes\n")
    assert accepted.returncode == 0, accepted
    assert bank.approval(approval)["status"] == "approved"
    assert bank.call(host, {"to": "tia", "amount": 2}).text == "paid 2.00 to tia"
    assert bank.payments() == 1


def test_by_defaults_to_the_os_user_name(workdir):
    bank = Bank(workdir)
    host = bank.start()
    me = pwd.getpwuid(os.geteuid()).pw_name
    decided = []
    for i, env in enumerate(({"USER": None, "LOGNAME": None, "USERNAME": None},
                             {"USER": "someone-else", "LOGNAME": "someone-else"})):
        run, approval = bank.pending(bank.call(host, {"to": f"u{i}", "amount": 1}))
        done = bank.approve(run, approval, env=env)
        assert f"approved by {me}" in done.stdout
        decided.append(bank.approval(approval)["decided_by"])
    run, approval = bank.pending(bank.call(host, {"to": "u2", "amount": 1}))
    bank.approve(run, approval, "-by", "joey")
    decided.append(bank.approval(approval)["decided_by"])
    assert decided == [me, me, "joey"]
    assert bank.payments() == 0


def test_the_hint_on_stderr_can_be_pasted_as_it_is(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "pat", "amount": 6}))
    stderr = host.stderr_text()
    assert re.search(rf"approval {approval} \(remote_mutation\) for bank_pay waits for an operator", stderr)
    line = line_matching(stderr, rf"approve {re.escape(run)} -approval {approval}")
    command = line.split("decide with:", 1)[1].split("(or reject)")[0].strip()
    assert f"-config {bank.config}" in command or f"-config '{bank.config}'" in command
    pasted = subprocess.run(shlex.split(command), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=DEADLINE)
    assert pasted.returncode == 0, pasted
    assert bank.approval(approval)["status"] == "approved"
    assert bank.call(host, {"to": "pat", "amount": 6}).text == "paid 6.00 to pat"
    assert bank.payments() == 1


def test_the_database_is_found_from_the_config_its_variable_or_db(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "rex", "amount": 9}))

    by_db = agentgate("runs", "-db", str(bank.db_path), "-json")
    assert by_db.returncode == 0, by_db.stderr
    assert [r["run"] for r in json.loads(by_db.stdout)] == [run]
    by_env = agentgate("show", run, "-json", env={"AGENTGATE_CONFIG": str(bank.config)})
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["approvals"][0]["id"] == approval

    done = agentgate("approve", run, "-approval", approval, "-db", str(bank.db_path))
    assert done.returncode == 0, done.stderr
    assert bank.call(host, {"to": "rex", "amount": 9}).text == "paid 9.00 to rex"
    assert bank.payments() == 1


def test_a_tampered_row_is_refused_and_never_collected(workdir):
    bank = Bank(workdir)
    host = bank.start()
    bob = {"to": "bob", "amount": 25}
    run, approval = bank.pending(bank.call(host, bob))
    bank.tamper("UPDATE approvals SET request_json=replace(request_json, '\"amount\":25', '\"amount\":99') "
                "WHERE id=?", (approval,))

    refused = bank.approve(run, approval, ok=False)
    assert refused.returncode == 1, refused
    assert "hash" in refused.stderr and approval in refused.stderr
    assert bank.approval(approval)["status"] == "pending"
    still = bank.call(host, bob)
    assert still.prefix == "PENDING_APPROVAL" and still.approval_id() == approval, still
    assert bank.payments() == 0

    # approved first, altered afterwards: the gate refuses to collect it
    cy = {"to": "cy", "amount": 7}
    run2, approval2 = bank.pending(bank.call(host, cy))
    bank.approve(run2, approval2)
    bank.tamper("UPDATE approvals SET request_json=replace(request_json, '\"amount\":7', '\"amount\":70') "
                "WHERE id=?", (approval2,))
    for _ in range(2):
        answer = bank.call(host, cy)
        assert answer.is_error and answer.prefix == "DENIED", answer
        assert "paid" not in answer.text
    assert bank.payments() == 0
    assert bank.run(run2)["status"] != "COMPLETED"


def test_reject_then_approve_fails(workdir):
    bank = Bank(workdir)
    host = bank.start()
    ann = {"to": "ann", "amount": 8}
    run, approval = bank.pending(bank.call(host, ann))
    # SPEC.md: reject takes -note (the model is shown it); without one it is a usage error.
    bare = bank.operator("reject", run, "-approval", approval, "-yes")
    assert bare.returncode == 2 and "-note" in bare.stderr, bare
    assert bank.approval(approval)["status"] == "pending"
    done = bank.reject(run, "not now")
    assert f"approval {approval}: rejected" in done.stdout
    assert bank.run(run)["status"] == "CANCELLED" and bank.run(run)["reason"] == "approval_rejected"

    late = bank.approve(run, approval, ok=False)
    assert late.returncode == 1 and "rejected" in late.stderr, late
    unnamed = bank.approve(run, None, "-yes", ok=False)
    assert unnamed.returncode == 1 and "no pending approval" in unnamed.stderr, unnamed
    assert bank.approval(approval)["status"] == "rejected"

    answer = bank.call(host, ann)
    assert answer.prefix == "REJECTED" and answer.is_error and "not now" in answer.text, answer
    assert bank.payments() == 0


def test_cancel_of_an_approved_request_never_collected(workdir):
    bank = Bank(workdir)
    host = bank.start()
    quy = {"to": "quy", "amount": 2}
    run, approval = bank.pending(bank.call(host, quy))
    bank.approve(run, approval)

    undo = bank.operator("reject", run, "-approval", approval, "-yes", "-note", "too late")
    assert undo.returncode == 1 and "approved" in undo.stderr, undo
    assert bank.approval(approval)["status"] == "approved"

    done = bank.cancel(run, "changed my mind")
    assert "CANCELLED" in done.stdout and "operator_cancelled" in done.stdout
    record = bank.show(run)
    assert record["run"]["status"] == "CANCELLED" and record["run"]["reason"] == "operator_cancelled"
    assert record["run"]["detail"] == "changed my mind"
    paused = record["steps"][0]
    assert paused["status"] == "failed" and paused["observation"]["kind"] == "interrupted"
    assert record["events"][-1]["type"] == "run.finished"

    again = bank.cancel(run, "twice", ok=False)
    assert again.returncode == 1, again

    answer = bank.call(host, quy)
    assert answer.prefix == "REJECTED" and answer.is_error, answer
    assert "cancelled" in answer.text and "changed my mind" in answer.text
    assert bank.payments() == 0


def test_show_json_reports_the_arguments_as_recorded(workdir):
    bank = Bank(workdir)
    raw = bank.raw()
    run, approval = bank.pending(raw.call_bytes("bank_pay", b'{"to":"kay","amount":1e1}'))
    done = bank.operator("show", run, "-json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout, parse_float=str, parse_int=str)
    assert record["steps"][0]["decision"]["args"] == {"amount": "1e1", "to": "kay"}
    assert [a["id"] for a in record["approvals"]] == [approval]
    assert json.loads(record["approvals"][0]["request_json"], parse_float=str, parse_int=str)["args"] == \
        {"amount": "1e1", "to": "kay"}
    assert bank.payments() == 0
