"""A prefix names what it names once (issue 29 item 12): a run and its approvals are one
candidate, so the six characters a run and its own approval share name that run the first
time; two different runs sharing a prefix are still refused, each run listed once with its
approvals beside it, and a prefix never moves on to another id.
"""

import json
import os

from kit import Bank


def shared(run: str, approval: str) -> str:
    return os.path.commonprefix([run.split(".", 1)[1], approval])


def pending_sharing_six(bank, host, to):
    """A waiting payment whose run and approval share at least 6 characters (they are made
    within a millisecond or so; a minute boundary between the two is tried again)."""
    for amount in range(2, 12):
        run, approval = bank.pending(bank.call(host, {"to": to, "amount": amount}))
        if len(shared(run, approval)) >= 6:
            return run, approval
    raise AssertionError("no run shared 6 characters with its approval")


def test_a_run_and_its_approval_sharing_a_prefix_are_one_candidate(workdir):
    bank = Bank(workdir)
    host = bank.start()
    run, approval = pending_sharing_six(bank, host, "tia")
    prefix = shared(run, approval)
    others = [r for r in bank.run_ids() if r != run]
    assert not any(shared(r, prefix) == prefix for r in others), (prefix, others)
    shown = bank.operator("show", prefix, "-json")
    assert shown.returncode == 0, shown
    assert json.loads(shown.stdout)["run"]["run"] == run
    decided = bank.approve(prefix, None, "-yes")
    assert f"approval {approval}: approved" in decided.stdout, decided


def test_two_runs_sharing_a_prefix_are_two_candidates_each_listed_once(workdir):
    bank = Bank(workdir, session="gating")
    host = bank.start()
    first, first_approval = pending_sharing_six(bank, host, "tia")
    for amount in range(2, 12):  # a second pair made the same minute: all four share 6
        second, second_approval = bank.pending(bank.call(host, {"to": "bo", "amount": amount}))
        prefix = os.path.commonprefix([shared(first, first_approval),
                                       shared(second, second_approval)])
        if len(prefix) >= 6:
            break
    for command in ("approve", "show"):
        refused = bank.operator(command, prefix, "-yes" if command == "approve" else "-full")
        assert refused.returncode == 1 and "ambiguous" in refused.stderr, refused
        # each run once, its approval beside it
        assert refused.stderr.count(first) == 1 and refused.stderr.count(second) == 1, refused
        assert first_approval in refused.stderr and second_approval in refused.stderr, refused
    assert bank.approval(first_approval)["status"] == "pending"
