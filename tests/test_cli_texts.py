"""What the operator commands say, as a newcomer meets them (issue 21 item 11).

- Every command's -h says what each flag (and each argument) does.
- `reject RUN -note TEXT` and `grant TOOL` without a terminal and without -yes decide nothing
  and say, in one sentence, which flag to add; grant never prints an id it did not create.
- `runs` shows a denied call as DENIED, has no unexplained mark, and names the host.
- `show` prints every event whole (wrapped, never cut) and the run's result.
- `recheck` leads with a summary and the differences; the runs where nothing differs are counted.
- A gate's start writes one line for what it serves, not one per tool; warnings keep their lines.

Everything runs through the real commands, the fake bank and the SDK host.
"""

import re

import pytest

from conftest import Host, agentgate_argv, wait_for
from kit import DEADLINE, POLICY_ID_RE, Bank, agentgate, query, recheck
from kit import bankdir, recorded  # noqa: F401 (fixtures)

LANDLORD = {"to": "landlord", "amount": 5}
COMMANDS = ["serve", "pin", "check", "recheck", "runs", "show", "approve", "reject", "cancel",
            "verify", "demo", "init", "watch", "grant", "grants", "revoke"]
INDENT = " " * 10  # show's continuation lines


def help_entries(text: str) -> dict:
    """Each argument argparse's -h lists, as its invocation -> its description."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            invocation, _, about = line.strip().partition("  ")
            current = invocation
            entries[current] = about.strip()
        elif current and re.match(r"^\s{3,}\S", line):
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_says_what_it_does(command):
    done = agentgate(command, "-h", env={"COLUMNS": "100"})
    assert done.returncode == 0, done
    entries = help_entries(done.stdout)
    flags = [invocation for invocation in entries if invocation.startswith("-")]
    assert "-h, --help" in flags, done.stdout
    usage = " ".join(done.stdout.split("\n\n")[0].split())
    named = set(re.findall(r"\[(-[a-z-]+)", usage))
    assert named <= {invocation.split()[0].rstrip(",") for invocation in flags}, (named, entries)
    for invocation, about in entries.items():
        assert len(about) > 10, f"{command} -h: {invocation!r} has no description:\n{done.stdout}"


def pending_payment(bank, name="claude-desktop"):
    gate = Host(agentgate_argv("-config", str(bank.config)), name=name).start()
    bank.hosts.append(gate)
    run_id, approval = bank.pending(bank.call(gate, LANDLORD))
    return gate, run_id, approval


def test_reject_without_a_terminal_says_to_add_yes_and_decides_nothing(bankdir):
    bank = Bank(bankdir)
    _, run_id, approval = pending_payment(bank)
    # As the README writes it: `reject RUN -note TEXT`, here with no terminal on stdin.
    done = agentgate("reject", run_id, "-note", "not now", "-config", str(bank.config))
    assert done.returncode == 2, done
    refusal = done.stderr.strip().splitlines()
    assert len(refusal) == 1 and "add -yes" in refusal[0] and "nothing was decided" in refusal[0]
    assert approval in done.stdout  # what would be rejected was printed in full first
    assert bank.approval(approval)["status"] == "pending"
    again = agentgate("reject", run_id, "-note", "not now", "-yes", "-config", str(bank.config))
    assert again.returncode == 0, again
    assert bank.approval(approval)["status"] == "rejected"


def test_grant_without_a_terminal_prints_no_id_it_did_not_create(bankdir):
    bank = Bank(bankdir)
    done = agentgate("grant", "bank_pay", "-for", "1h", "-config", str(bank.config))
    assert done.returncode == 2, done
    assert "add -yes" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "bank_pay" in done.stdout  # printed in full before the refusal
    assert not re.search(r"\b[0-9a-f]{16}\b", done.stdout + done.stderr), done
    assert not bank.db_path.exists() or not bank.query("SELECT id FROM grants")
    granted = agentgate("grant", "bank_pay", "-yes", "-config", str(bank.config))
    assert granted.returncode == 0, granted
    (grant_id,) = re.findall(r"\b[0-9a-f]{16}\b", granted.stdout)
    assert f"grant {grant_id}: in force" in granted.stdout
    assert bank.query("SELECT id FROM grants") == [(grant_id,)]
    revoked = agentgate("revoke", grant_id, "-config", str(bank.config))
    assert revoked.returncode == 0, revoked


def runs_rows(text: str) -> tuple[list, list]:
    """(header cells, rows as the header's columns) of the runs table."""
    lines = text.splitlines()
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S", header)]
    # A header cell of two words ("WAITING APPROVAL") is one column.
    starts = [s for i, s in enumerate(starts) if not (i and header[starts[i - 1]:s].strip() == "WAITING")]
    cells = [header[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    rows = [[line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
            for line in lines[1:] if re.match(r"\S+\.[0-9a-f]{16}\b", line)]
    return cells, rows


def test_runs_shows_a_denied_call_as_denied_and_names_the_host(bankdir):
    bank = Bank(bankdir)
    gate, waiting, _ = pending_payment(bank, name="claude-desktop")
    assert bank.call(gate, {"payment": "p1"}, tool="bank_refund").prefix == "DENIED"
    assert bank.call(gate, {"account": "main"}, tool="bank_balance").text.startswith("account main")
    done = bank.operator("runs")
    assert done.returncode == 0, done
    assert "*" not in done.stdout and "goal_failed" not in done.stdout, done.stdout
    cells, rows = runs_rows(done.stdout)
    assert "HOST" in cells and "STATE" in cells, cells
    by_tool = {row[cells.index("TOOL")]: row for row in rows}
    assert by_tool["bank_refund"][cells.index("STATE")] == "DENIED", done.stdout
    assert by_tool["bank_pay"][cells.index("STATE")] == "WAITING_FOR_APPROVAL", done.stdout
    assert by_tool["bank_pay"][cells.index("RUN")] == waiting
    assert by_tool["bank_balance"][cells.index("STATE")] == "COMPLETED", done.stdout
    assert {row[cells.index("HOST")] for row in rows} == {"claude-desktop"}, done.stdout


def shown_events(text: str) -> dict:
    """seq -> the payload show printed for it, its wrapped pieces joined."""
    events, seq = {}, None
    for line in text.splitlines():
        head = re.match(r"^  +(\d+)  \S+  \S+$", line)
        if head:
            seq = int(head.group(1))
            events[seq] = ""
        elif seq is not None and line.startswith(INDENT):
            events[seq] += line[len(INDENT):]
        else:
            seq = None
    return events


def test_show_prints_every_event_whole_and_the_result(bankdir):
    bank = Bank(bankdir)
    gate = Host(agentgate_argv("-config", str(bank.config))).start()
    bank.hosts.append(gate)
    answer = bank.call(gate, {"account": "main"}, tool="bank_balance")
    denied = bank.call(gate, {"payment": "p1"}, tool="bank_refund")
    assert denied.prefix == "DENIED"
    read_run, refund_run = bank.run_ids()
    shown = bank.operator("show", read_run)
    assert shown.returncode == 0, shown
    result = shown.stdout.split("\nresult    ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert "bank/balance" in result[0]
    assert answer.text in "".join(line[len(INDENT):] for line in result[1:]), shown.stdout
    stored = query(bank.db_path, "SELECT seq, payload_json FROM events WHERE run_id=?", (read_run,))
    assert any(len(payload) > 200 for _, payload in stored)  # what show used to cut
    assert shown_events(shown.stdout) == dict(stored), shown.stdout
    assert all(len(line) <= 110 for line in shown.stdout.splitlines())

    refused = bank.operator("show", refund_run)
    text = refused.stdout.split("\nresult    ", 1)[1].split("\n\n", 1)[0]
    assert text.startswith("policy_denied") and "destructive" in text, refused.stdout
    stored = query(bank.db_path, "SELECT seq, payload_json FROM events WHERE run_id=?", (refund_run,))
    assert shown_events(refused.stdout) == dict(stored), refused.stdout


def test_recheck_leads_with_the_differences(recorded, workdir):
    config = recorded.clone(workdir, policy={"remote_mutation": "deny"})
    done = recheck(config)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    now = POLICY_ID_RE.search(lines[0]).group(0)
    assert lines[0] == (f"5 run(s) re-checked under {now}: 8 decision(s) re-checked, 3 differ, 0 not "
                        f"re-checkable and skipped; 2 run(s) differ")
    listed = [line for line in lines if line.startswith(("DIFFERENT", "same ", "skipped "))]
    assert [line.split()[0] for line in listed] == ["DIFFERENT"] * 3, done.stdout
    assert [line for line in lines if line.startswith("the same today:")] == [
        f'the same today: every decision of 3 run(s) (5 in all); policy changed: recorded '
        f'"{POLICY_ID_RE.search(lines[1]).group(0)}", given "{now}"']
    assert len(lines) == 8, done.stdout  # summary, 2 runs with their 3 differences, the rest, scope
    assert lines[-1].startswith("A re-check covers the gate's policy")


def test_a_gate_start_writes_one_line_for_what_it_serves(bankdir):
    bank = Bank(bankdir, rules={"refund": None})  # refund unclassified: a warning of its own
    gate = bank.start()
    gate.list_tools()
    # The start line may be written just after the host is answered: wait for it, then read.
    wait_for(lambda: "serving session" in gate.stderr_text(), DEADLINE, message="the start line")
    log = gate.stderr_text().splitlines()
    assert not [line for line in log if " registered " in line], log
    serving = [line for line in log if "serving session" in line]
    assert len(serving) == 1 and "2 tool(s) from 1 server(s) (bank)" in serving[0], log
    assert "agentgate: bank: unclassified refund: no rule" in log, log
