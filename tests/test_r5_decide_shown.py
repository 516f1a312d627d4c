"""One printout and one rule for every operator decision (issue 30 item 1).

- grant prints each call it would release exactly as approve prints it, the policy's
  `when` entries that were tried included, every byte of an argument past 120 bytes shown.
- A value past what is shown whole is shown as its head and tail, and then grant, like
  approve, decides nothing until -full has printed every byte.
- The late outcome of a cut-off attempt is a value of the printout like any other: shown
  whole, or shortened by the same rule and then decided on only with -full (it used to be
  cut silently at 480 bytes).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import Bank  # noqa: E402
from kit import bankdir  # noqa: E402,F401 (fixture)

SMALL_ONLY = {"pay": {"when": [{"if": {"/amount": {"max": 1}}, "outcome": "allow"}]}}


def waiting(bankdir, to):
    bank = Bank(bankdir, rules=SMALL_ONLY)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, {"to": to, "amount": 5}))
    return bank, run, approval


def test_grant_prints_each_call_it_releases_as_approve_prints_it(bankdir):
    payee = "p" * 200  # past the 120 bytes grant once cut its texts at
    bank, run, approval = waiting(bankdir, payee)
    approve = bank.approve(run, None, ok=False)  # no terminal, no -yes: prints, decides nothing
    assert approve.returncode == 2 and f"end of approval {approval}" in approve.stdout, approve
    printed = approve.stdout.rstrip("\n").splitlines()
    assert any(line.startswith("no when entry held: when[0]: /amount") for line in printed)
    assert f'    to = "{payee}"   (200 bytes)' in printed

    grant = bank.operator("grant", "bank_pay", "-for", "1h")
    assert grant.returncode == 2 and "nothing was granted" in grant.stderr, grant
    rows = grant.stdout.splitlines()
    first = rows.index(f"    {printed[0]}")
    assert rows[first:first + len(printed)] == [f"    {line}" for line in printed], grant.stdout
    assert bank.approval(approval)["status"] == "pending"


def test_grant_releases_a_call_with_a_long_value_only_once_every_byte_was_printed(bankdir):
    payee = "q" * 300 + "MIDDLE" + "q" * 300
    bank, run, approval = waiting(bankdir, payee)
    cut = bank.operator("grant", "bank_pay", "-yes")
    assert cut.returncode == 2 and "-full" in cut.stderr, cut
    assert "bytes in all" in cut.stdout and "MIDDLE" not in cut.stdout
    assert bank.approval(approval)["status"] == "pending"
    assert not bank.query("SELECT id FROM grants")

    whole = bank.operator("grant", "bank_pay", "-yes", "-full")
    assert whole.returncode == 0, whole
    assert f'to = "{payee}"   (606 bytes)' in whole.stdout
    assert bank.approval(approval)["status"] == "approved"


def J(value):
    return json.dumps(value)


def cut_off_approval(result):
    """An approval over an attempt that was cut off, and its late outcome: `result`."""
    approval = {"id": "a1", "kind": "interrupted_side_effect", "run_id": "r1",
                "created_at": "2026-01-01T00:00:00Z", "expires_at": "",
                "presentation_json": J({"server": "bank", "tool": "pay"}),
                "request_json": J({"spec": {"name": "bank_pay"}, "args": {"to": "kim"}}),
                "capability_json": J({"interrupted": {"step_id": "s1"}})}
    late = [("s1", {"kind": "tool_result", "content": result})]
    return approval, late


def late_line(lines):
    (line,) = [line for line in lines if line.startswith("  LATE OUTCOME")]
    return line


def test_a_long_late_outcome_is_shortened_by_the_rule_of_every_value():
    result = "r" * 400 + "TAIL-OF-THE-MIDDLE" + "r" * 400
    approval, late = cut_off_approval(result)
    lines, shortened = agentgate.approval_lines(approval, False, late)
    assert shortened, lines
    assert "[... 818 bytes in all ...]" in late_line(lines)
    assert "TAIL-OF-THE-MIDDLE" not in late_line(lines)
    lines, shortened = agentgate.approval_lines(approval, True, late)
    assert not shortened and late_line(lines).endswith(f"with this result: {result}")


def test_a_short_late_outcome_is_shown_whole_and_decided_on_as_it_is():
    approval, late = cut_off_approval("paid 5.00 to kim")
    lines, shortened = agentgate.approval_lines(approval, False, late)
    assert not shortened
    assert late_line(lines).endswith("it succeeded, with this result: paid 5.00 to kim")


def test_approve_and_watch_refuse_a_shortened_printout_in_one_sentence():
    approve = agentgate.unshown(True, "approval a1", "approve", "run the command again with -full")
    watch = agentgate.unshown(True, "this approval", "decide", "press f")
    assert approve.startswith("run the command again with -full to show every byte")
    assert watch.startswith("press f to show every byte before you decide")
    assert agentgate.unshown(False, "approval a1", "approve", "press f") == ""
