"""What an operator approves must be what runs (issue 19 items 1, 2, 9 and 15; issue 21 item 3).

A prefix is resolved among all ids of its kind, whatever their state: when the run or approval
it names was already decided or has ended, the command says so and decides nothing; it never
moves on to another run made the same minute. A value that mixes scripts or holds invisible
characters is marked where the operator reads it. A grant keeps the directories its `under`
named as they were resolved when it was confirmed, and starts at its confirmation. `-json`
prints JSON only.

Everything runs through the real gate in front of the fake bank (or the scripted server), the
SDK host, and the operator commands as processes.
"""

import json
import os
import signal
import subprocess
from contextlib import suppress

import pytest

from conftest import agentgate_argv, wait_for
from test_watch import next_line, plain_watch
from kit import (DEADLINE, WRITE_SCHEMA, Bank, gate_host, pin, rule, said, scripted_server, tool,
                 write_config)

LANDLORD = {"to": "landlord", "amount": 5}
STRANGER = {"to": "stranger", "amount": 9999}


def hex_part(run_id: str) -> str:
    return run_id.split(".", 1)[1]


def distinct(target: str, others) -> str:
    """The shortest prefix of `target` (at least 6 characters) that starts none of `others`."""
    shared = max([len(os.path.commonprefix([target, other])) for other in others] + [0])
    return target[:max(6, shared + 1)]


# ---------------------------------------------------------------- item 1: a prefix never moves on


def decided_and_waiting(bank, host, order):
    """The landlord payment approved by whole ids and paid by the model's retry, the stranger's
    waiting; `order` says whether the stranger's call came after the landlord was decided or
    waited beside it all along. Returns (landlord run, landlord approval, stranger run,
    stranger approval)."""
    if order == "decided_before":
        run_l, approval_l = bank.pending(bank.call(host, LANDLORD))
        bank.approve(run_l, approval_l)
        run_s, approval_s = bank.pending(bank.call(host, STRANGER))
    else:
        run_s, approval_s = bank.pending(bank.call(host, STRANGER))
        run_l, approval_l = bank.pending(bank.call(host, LANDLORD))
        bank.approve(run_l, approval_l)
    assert bank.call(host, LANDLORD).text == "paid 5.00 to landlord"
    assert bank.run(run_l)["status"] == "COMPLETED"
    return run_l, approval_l, run_s, approval_s


def attempts(run_prefix, approval_prefix):
    """Every way an operator may name the landlord's decided run or approval by prefix."""
    return [
        ("approve", run_prefix, "-approval", approval_prefix),
        ("approve", run_prefix, "-approval", approval_prefix, "-yes"),
        ("approve", run_prefix, "-yes"),
        ("approve", approval_prefix, "-yes"),
        ("reject", run_prefix, "-approval", approval_prefix, "-yes", "-note", "no"),
        ("reject", run_prefix, "-yes", "-note", "no"),
        ("reject", approval_prefix, "-yes", "-note", "no"),
        ("cancel", run_prefix, "-note", "no"),
        ("cancel", approval_prefix, "-note", "no"),
    ]


@pytest.mark.parametrize("order", ["decided_before", "waiting_beside"])
def test_a_prefix_of_a_decided_payment_decides_nothing_else(workdir, order):
    bank = Bank(workdir)
    host = bank.start()
    run_l, approval_l, run_s, approval_s = decided_and_waiting(bank, host, order)

    # Six characters, which runs and approvals made the same minute share: refused as
    # ambiguous with the candidates listed, or (when the minute turned between the two
    # payments) said to be decided; never the stranger's payment.
    for argv in attempts(hex_part(run_l)[:6], approval_l[:6]):
        done = bank.operator(*argv)
        assert done.returncode == 1, (argv, done)
        assert "already" in done.stderr or (
            "ambiguous" in done.stderr and (run_s in done.stderr or approval_s in done.stderr)), \
            (argv, done.stderr)
        assert bank.approval(approval_s)["status"] == "pending", argv

    # Prefixes that name the landlord's run and approval and nothing else: the command says
    # they were decided or ended, and decides nothing.
    alone_run = distinct(hex_part(run_l), [hex_part(run_s), approval_s])
    alone_approval = distinct(approval_l, [approval_s, hex_part(run_s)])
    for argv in attempts(alone_run, alone_approval):
        done = bank.operator(*argv)
        assert done.returncode == 1, (argv, done)
        assert "already" in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
        assert approval_s not in done.stdout, (argv, done.stdout)
        assert bank.approval(approval_s)["status"] == "pending", argv

    assert bank.approval(approval_l)["status"] == "approved"
    assert bank.run(run_s)["status"] == "WAITING_FOR_APPROVAL"
    assert bank.call(host, STRANGER).prefix == "PENDING_APPROVAL"
    assert [line["to"] for line in bank.ledger_lines()] == ["landlord"]


def test_an_approval_id_names_its_run(workdir):
    # Issue 21 item 3: the model relays the approval id; approve, show and cancel take it.
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, LANDLORD))
    shown = bank.operator("show", approval, "-json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["run"]["run"] == run, shown
    decided = bank.approve(approval, None, "-yes")
    assert f"approval {approval}: approved" in decided.stdout, decided
    assert bank.call(host, LANDLORD).text == "paid 5.00 to landlord"
    other, other_approval = bank.pending(bank.call(host, STRANGER))
    cancelled = bank.operator("cancel", other_approval, "-note", "not ours")
    assert cancelled.returncode == 0 and f"run {other}: CANCELLED" in cancelled.stdout, cancelled
    # the approval a command names must be one of the run it names
    mismatch = bank.approve(run, other_approval, ok=False)
    assert mismatch.returncode == 1 and "no approval of" in mismatch.stderr, mismatch


# ---------------------------------------------------------------- item 2: lookalikes are marked

LOOKALIKE = {"to": "l\u0430ndlord", "amount": 5}  # a Cyrillic а


def test_a_lookalike_payee_is_marked_where_the_operator_reads_it(workdir):
    bank = Bank(workdir)
    host = bank.start()
    host.list_tools()  # the gate has made its database
    proc, lines = plain_watch(bank)
    try:
        run, approval = bank.pending(bank.call(host, LOOKALIKE))
        waiting = next_line(lines)
        assert approval in waiting, waiting
        assert 'CAUTION {"amount":5,"to":"l\u0430ndlord"}' in waiting, waiting
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    marked = '"l\u0430ndlord" mixes scripts: U+0430 CYRILLIC SMALL LETTER A among LATIN letters'
    shown = bank.operator("show", run)
    assert marked in shown.stdout, shown.stdout
    decided = bank.approve(run, approval)
    assert f"CAUTION  {marked}" in decided.stdout, decided.stdout
    # The approval still binds the exact bytes: the look-alike is not the real name.
    assert bank.call(host, {"to": "landlord", "amount": 5}).prefix == "PENDING_APPROVAL"
    assert bank.call(host, LOOKALIKE).text == "paid 5.00 to l\u0430ndlord"
    assert [line["to"] for line in bank.ledger_lines()] == ["l\u0430ndlord"]


def test_an_invisible_character_is_named_in_the_printout(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": "land\u200blord", "amount": 5}))
    decided = bank.approve(run, approval)
    assert "CAUTION  holds invisible characters: U+200B ZERO WIDTH SPACE" in decided.stdout, \
        decided.stdout
    plain = bank.pending(bank.call(host, {"to": "landlord", "amount": 5}))
    assert "CAUTION" not in bank.approve(*plain).stdout


# ---------------------------------------------------------------- item 9: a grant as confirmed


def write_file_gate(workdir):
    """A gate in front of the scripted server's write_file, which waits for an operator."""
    spec = {"tools": [tool("write_file", WRITE_SCHEMA, "Write a file.")]}
    server = scripted_server(workdir, spec, rules={"write_file": rule("remote_mutation")})
    config = write_config(workdir, [server])
    pin(config)
    return config, gate_host(config)


def write(host, path):
    return said(host.call("fs_write_file", {"path": str(path), "text": "hi"}))


def test_a_grant_keeps_the_directory_it_showed_when_it_later_becomes_a_link(workdir):
    drafts, other = workdir / "drafts", workdir / "other"
    drafts.mkdir()
    other.mkdir()
    config, host = write_file_gate(workdir)
    granted = subprocess.run(agentgate_argv("grant", "fs_write_file", "-yes", "-for", "1h", "-if",
                                            json.dumps({"/path": {"under": [str(drafts)]}}),
                                            "-config", str(config)),
                             capture_output=True, text=True, timeout=DEADLINE)
    assert granted.returncode == 0, granted
    # kept as resolved and shown when confirmed
    [kept] = agentgate_json(config, "grants", "-json")
    assert kept["conditions"] == {"/path": {"under": [os.path.realpath(drafts)]}}
    assert os.path.realpath(drafts) in granted.stdout
    text, error = write(host, drafts / "a.txt")
    assert text == "called write_file" and not error, text

    # The directory is replaced by a link to another: the grant does not follow it there.
    drafts.rmdir()
    drafts.symlink_to(other)
    text, error = write(host, drafts / "b.txt")
    assert text.startswith("PENDING_APPROVAL:"), text
    text, error = write(host, other / "c.txt")
    assert text.startswith("PENDING_APPROVAL:"), text


def agentgate_json(config, *args):
    done = subprocess.run(agentgate_argv(*args, "-config", str(config)), capture_output=True,
                          text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done
    return json.loads(done.stdout)


def test_a_grant_starts_when_it_is_confirmed_not_when_it_was_printed(workdir):
    bank = Bank(workdir)
    host = bank.start()
    printout = workdir / "grant.out"
    controller, terminal = os.openpty()
    try:
        with open(printout, "w") as out:
            proc = subprocess.Popen(agentgate_argv("grant", "bank_pay", "-for", "1h", "-config",
                                                   str(bank.config)),
                                    stdin=terminal, stdout=out, stderr=subprocess.PIPE,
                                    start_new_session=True)
        try:
            wait_for(lambda: "type yes to grant" in printout.read_text(), DEADLINE,
                     message="the grant's question")
            # decided while the question waits: no grant is in force yet, so it asks
            run, _ = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
            os.write(controller, b"yes\n")
            _, err = proc.communicate(timeout=DEADLINE)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        os.close(terminal)
        os.close(controller)
    assert proc.returncode == 0, (printout.read_text(), err)
    assert bank.call(host, {"to": "bo", "amount": 3}).text == "paid 3.00 to bo"
    rechecked = bank.operator("recheck", "-run", run, "-json")
    assert rechecked.returncode == 0, rechecked
    [report] = json.loads(rechecked.stdout)
    assert report["same"] and report["rechecked"] >= 1, report


# ---------------------------------------------------------------- item 15: -json is JSON only


def test_json_prints_one_json_value_and_nothing_else(workdir):
    bank = Bank(workdir)
    host = bank.start()
    granted = bank.operator("grant", "bank_refund", "-for", "1h", "-yes", "-json")
    assert granted.returncode == 0, granted
    assert json.loads(granted.stdout)["name"] == "bank_refund"
    assert "GRANT" in granted.stderr  # the printout is still there for a person to read
    run, approval = bank.pending(bank.call(host, LANDLORD))
    approved = bank.approve(run, approval, "-json")
    assert json.loads(approved.stdout)["approval"]["id"] == approval
    assert "APPROVAL WAITING" in approved.stderr
    rejected_run, rejected = bank.pending(bank.call(host, STRANGER))
    done = bank.operator("reject", rejected_run, "-yes", "-note", "no", "-json")
    assert json.loads(done.stdout)["approval"]["status"] == "rejected"
