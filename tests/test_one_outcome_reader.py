"""One place reads what a recorded step came to (issue 22, one mechanism for each job).

- step_outcome classifies every observation the gate has recorded, in every version, from its
  fields: the prose inside a record (an error's text, a run's detail) never decides.
- `runs` names a failed call by what its step came to: TOOL_ERROR, DENIED, INVALID.

The second runs through the real commands, the fake bank and the SDK host.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import Bank, agentgate as agentgate_command  # noqa: E402
from kit import bankdir  # noqa: E402,F401 (fixture)

RESULT = {"bytes": 2, "sha256": "0" * 64, "blocks": []}

# Each observation as a version of the gate recorded it, and what it came to. The texts inside
# say something else on purpose: only the fields decide.
RECORDED = [
    ({"kind": "tool_result", "summary": "bank/pay: 2 bytes", "result": RESULT}, "ok"),
    ({"kind": "tool_result", "summary": "x", "content": "timed out"}, "ok"),  # schema 3
    ({"kind": "tool_error", "summary": "pay error: timed out", "content": {
        "tool": "bank_pay", "error": "the call timed out", "ending": "error"}}, "error"),
    ({"kind": "tool_error", "summary": "x", "result": {**RESULT, "is_error": True},
      "content": {"tool": "bank_pay", "ending": "error"}}, "error"),
    ({"kind": "tool_error", "summary": "x", "content": {
        "tool": "bank_pay", "error": "card declined", "ending": "unrecorded"}}, "unrecorded"),
    ({"kind": "tool_error", "summary": "x", "content": {
        "tool": "bank_pay", "error": "card declined", "ending": "timed_out"}}, "timed_out"),
    ({"kind": "tool_error", "summary": "x", "content": {
        "tool": "bank_pay", "error": "it succeeded", "ending": "no_answer"}}, "no_answer"),
    ({"kind": "interrupted", "summary": "step interrupted while executing",
      "content": {"previous_status": "executing"}}, "cut_off"),
    ({"kind": "interrupted", "content": {"by": "op", "note": "stop",
                                         "previous_status": "executing"}}, "cut_off"),
    ({"kind": "interrupted", "summary": "step interrupted while deciding",
      "content": {"previous_status": "deciding"}}, "interrupted"),
    ({"kind": "interrupted", "content": {"by": "op", "note": "executing"}}, "interrupted"),
    ({"kind": "policy_denied", "content": {"error": "denied: no"}}, "denied"),
    ({"kind": "policy_denied", "content": {"error": "invalid decision on resume: x"}}, "denied"),
    ({"kind": "policy_denied", "content": {"approval_id": "a1", "note": "denied on resume"}},
     "rejected"),
    ({"kind": "invalid_decision", "content": {"error": "denied on resume: x"}}, "invalid"),
]


@pytest.mark.parametrize("observed, outcome", RECORDED)
def test_every_recorded_observation_is_classified_by_its_fields(observed, outcome):
    assert agentgate.step_outcome(observed) == outcome


def states(bank) -> dict:
    """Each run's tool and STATE as `runs` prints them, by run id."""
    done = agentgate_command("runs", "-config", str(bank.config))
    assert done.returncode == 0, done
    rows = {}
    for line in done.stdout.splitlines()[1:]:
        cells = line.split()
        if cells and "." in cells[0]:
            rows[cells[0]] = (cells[1], cells[-1])
    return rows


def test_runs_names_a_failed_call_by_what_its_step_came_to(bankdir):
    bank = Bank(bankdir, rules={"pay": {"outcome": "allow"}})
    host = bank.start()
    assert bank.call(host, {"to": "jo", "amount": 1, "mode": "error"}).is_error
    assert bank.call(host, {"payment": "p1"}, tool="bank_refund").prefix == "DENIED"
    assert bank.call(host, {"to": "jo"}).prefix == "INVALID"
    assert not bank.call(host, {"to": "kim", "amount": 2}).is_error
    listed = {r["run"]: r for r in bank.runs_json()}
    shown = states(bank)
    assert set(shown) == set(listed), (shown, listed)
    by_state = sorted((state, tool) for state, tool in shown.values())
    assert by_state == [("COMPLETED", "bank_pay"), ("DENIED", "bank_refund"),
                        ("INVALID", "bank_pay"), ("TOOL_ERROR", "bank_pay")], shown
    assert {listed[run]["status"] for run, (state, _) in shown.items()
            if state != "COMPLETED"} == {"FAILED"}
