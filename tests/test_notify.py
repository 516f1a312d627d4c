"""Noticing an approval: the `notify` program runs when an approval starts waiting (issue 12).

It gets the approval id, the run, the tool's name and the command that decides it in its
environment, never an argument's value; it runs off the call's path, so a program that hangs,
fails or does not exist never delays or fails the call, and a hanging one is stopped.
"""

import json
import os
import sys
from pathlib import Path

from conftest import pid_alive, wait_for
from kit import DEADLINE, Bank, agentgate, write_private

# Writes what it was given (its environment's AGENTGATE_* names and its argv) to a file named
# after the approval, then, with "hang" as its argument, records its pid and waits forever.
NOTIFY_PROGRAM = r'''
import json, os, sys, time
out = sys.argv[1]
seen = {k: v for k, v in os.environ.items() if k.startswith("AGENTGATE_")}
with open(os.path.join(out, seen["AGENTGATE_APPROVAL"] + ".json"), "w") as f:
    json.dump({"env": seen, "argv": sys.argv[1:], "all": dict(os.environ)}, f)
if sys.argv[2:] == ["hang"]:
    with open(os.path.join(out, "hang.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
'''


def notify_program(workdir: Path, *extra: str) -> list:
    script = workdir / "notify.py"
    script.write_text(NOTIFY_PROGRAM)
    out = workdir / "notified"
    out.mkdir(exist_ok=True)
    return [sys.executable, str(script), str(out), *extra]


def notified(workdir: Path, approval: str) -> dict:
    path = workdir / "notified" / f"{approval}.json"
    wait_for(lambda: path.exists() and path.stat().st_size > 0, DEADLINE,
             message=f"the notify program for approval {approval}")
    return wait_for(lambda: _read(path), DEADLINE, message=f"a whole notice in {path}")


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def test_notify_names_the_approval_and_the_command_never_the_arguments(workdir):
    bank = Bank(workdir, notify=notify_program(workdir))
    host = bank.start()
    secret_payee = "payee-7f3e9b-not-for-notices"
    run, approval = bank.pending(bank.call(host, {"to": secret_payee, "amount": 913.37}))
    notice = notified(workdir, approval)
    env = notice["env"]
    assert env["AGENTGATE_APPROVAL"] == approval
    assert env["AGENTGATE_RUN"] == run
    assert env["AGENTGATE_TOOL"] == "bank_pay"
    command = env["AGENTGATE_COMMAND"]
    assert command.endswith(f"approve {run} -approval {approval}")
    assert str(bank.config) in command  # pasteable as it is: it names the config
    everything = json.dumps(notice)
    assert secret_payee not in everything and "913.37" not in everything
    assert notice["argv"] == [str(workdir / "notified")]

    # The command it was given decides the approval as written.
    decided = agentgate(*command.split()[2:])
    assert decided.returncode == 0, decided
    assert bank.call(host, {"to": secret_payee, "amount": 913.37}).text == \
        f"paid 913.37 to {secret_payee}"


def test_a_hanging_notify_program_neither_delays_the_call_nor_outlives_its_bound(workdir):
    bank = Bank(workdir, notify=notify_program(workdir, "hang"))
    host = bank.start()
    # The call is answered (not held: hold is 0s) while the program hangs.
    run, approval = bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    notified(workdir, approval)
    pid_file = workdir / "notified" / "hang.pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), DEADLINE, message="the hung program's pid")
    pid = int(pid_file.read_text())
    assert bank.call(host, {"to": "tia", "amount": 2}).prefix == "PENDING_APPROVAL"
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text == "account A-1 holds 120.00 EUR"
    wait_for(lambda: not pid_alive(pid), 60, message="the hung notify program to be stopped")
    wait_for(lambda: "was stopped after 10s" in bank.stderr(), DEADLINE, message="the stop on stderr")


def test_a_notify_program_that_fails_or_is_missing_costs_the_call_nothing(workdir):
    failing = workdir / "fail.sh"
    write_private(failing, "#!/bin/sh\nexit 3\n")
    os.chmod(failing, 0o700)
    bank = Bank(workdir, notify=[str(failing)])
    host = bank.start()
    bank.pending(bank.call(host, {"to": "tia", "amount": 2}))
    wait_for(lambda: "exited with status 3" in bank.stderr(), DEADLINE, message="the failure on stderr")

    (workdir / "other").mkdir()
    missing = Bank(workdir / "other", notify=[str(workdir / "no-such-program")])
    other = missing.start()
    missing.pending(missing.call(other, {"to": "tia", "amount": 2}))
    wait_for(lambda: "notify could not run" in missing.stderr(), DEADLINE, message="the failure on stderr")
    assert missing.call(other, {"account": "A-1"}, tool="bank_balance").text == "account A-1 holds 120.00 EUR"


def test_notify_must_name_a_program(workdir):
    bank = Bank(workdir)
    config = bank.write(notify=[])
    done = agentgate("check", "-config", str(config))
    assert done.returncode == 1
    assert "notify must be a program and its arguments" in done.stderr
    assert "Traceback" not in done.stderr
