"""A request's arguments are judged once for a pass through the gate (agentgate sections 8, 10).

Specification: issue 22, "Decide outside the lock". The schema check and the policy's
conditions on the arguments are functions of the request: the gate judges them before the
rules' lock (Gate._judge) and the decisions under the lock and in the write transaction read
that Judgement. What may change between the two is read afresh at every decision: the moment
(the time, the host), the grants in force (a grant created meanwhile counts), and the
executions a limit counts.

Pure functions, driven as the gate drives them: the same Judgement, facts of two moments.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402


def P(value):
    return agentgate.parse(json.dumps(value).encode("utf-8"))


def pay_tool(rule_doc):
    config = agentgate.Config(P({
        "database": "runs.db", "session": "s", "servers": [{
            "name": "bank", "command": ["x"], "manifest": "m.json",
            "rules": {"pay": {"side_effect": "remote_mutation", **rule_doc}}}]}),
        "/tmp/x/config.json")
    rule = config.servers[0].rules["pay"]
    return config, types.SimpleNamespace(name="pay", rule=rule, side_effect=rule.side_effect,
                                         schema={"type": "object"})


def facts(client="cli", grants=(), uses=None):
    return agentgate.Facts(0.0, client, lambda: [agentgate.Grant(g) for g in grants], uses)


def grant(grant_id, conditions):
    return {"id": grant_id, "by": "alice", "conditions_json": json.dumps(conditions)}


def decided(config, tool, args, moment, judged):
    decision = agentgate.policy_decision(config, tool, P(args), moment, judged=judged)
    return decision["outcome"], decision["by"]


def test_a_path_is_judged_once_for_a_pass_and_the_host_at_each_decision(tmp_path):
    safe, elsewhere, link = tmp_path / "safe", tmp_path / "elsewhere", tmp_path / "link"
    safe.mkdir()
    elsewhere.mkdir()
    link.symlink_to(safe)
    config, tool = pay_tool({"outcome": "require_approval", "when": [
        {"if": {"/path": {"under": [str(safe)]}}, "client": ["cli"], "outcome": "allow"}]})
    args = {"path": str(link / "statement.pdf")}
    judged = agentgate.Judgement()
    assert decided(config, tool, args, facts(), judged) == ("allow", "when[0]")
    link.unlink()
    link.symlink_to(elsewhere)
    # Under the lock, the pass reads what the arguments were judged to say before it...
    assert decided(config, tool, args, facts(), judged) == ("allow", "when[0]")
    # ...and the moment afresh: the entry holds only for the host it names.
    assert decided(config, tool, args, facts("ide"), judged) == ("require_approval",
                                                                 "rule outcome")
    # The next pass (after a hold, say) judges the arguments again.
    assert decided(config, tool, args, facts(), agentgate.Judgement()) == (
        "require_approval", "rule outcome")


def test_a_grant_created_after_the_request_was_judged_counts():
    config, tool = pay_tool({"outcome": "require_approval"})
    args = {"to": "landlord", "amount": 5}
    judged = agentgate.Judgement()
    assert decided(config, tool, args, facts(), judged) == ("require_approval", "rule outcome")
    other = grant("g-other", {"/to": {"equals": "grocer"}})
    covering = grant("g-landlord", {"/to": {"equals": "landlord"}})
    assert decided(config, tool, args, facts(grants=[other]), judged) == (
        "require_approval", "rule outcome")
    assert decided(config, tool, args, facts(grants=[other, covering]), judged) == (
        "allow", "grant g-landlord")


def test_a_limit_counts_the_executions_of_each_decision_not_those_when_judged():
    config, tool = pay_tool({"outcome": "allow", "limits": [{"calls": 1, "per": "1h"}]})
    args = {"to": "landlord", "amount": 5}
    judged = agentgate.Judgement()
    assert decided(config, tool, args, facts(uses=lambda since: []), judged) == (
        "allow", "rule outcome")
    # An execution committed between the judgement and the write transaction counts.
    assert decided(config, tool, args, facts(uses=lambda since: [(-60.0, {})]), judged) == (
        "require_approval", "limits[0]")
