"""A slow pattern stalls nothing but its own call (issue 19, item 7).

Specification: SPEC "Policy on what a call does" and the promises of sections 6, 8 and 10: the
pattern searches of one call, its schema check's and its policy's, share one bound on their
work; a value past what is left is too costly to check, which makes the call INVALID at once
(never valid: not through `not`, not by slipping past a deny entry); the schema check and the
policy's conditions are judged before the lock that orders the rules across calls, so an
unrelated call is answered while a slow one is still being checked.

The pattern used is one whose lazy DFA meets a new state at nearly every character of a text
of a and b: the costliest kind the matcher runs.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import AGENTGATE, Host, wait_for  # noqa: E402
from kit import (DEADLINE, bank_server, expect, ledger, payments, pin, result_text,  # noqa: E402
                 rule, said, scripted_server, tool, write_config)

SLOW = "[ab]*a[ab]{400}c"
SIZE = agentgate.compile_pattern(SLOW).size
CHECK_SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": SLOW},
    "codes": {"type": "array", "items": {"type": "string", "pattern": SLOW}}}}


def P(value):
    """A Python value as the gate would have parsed it (numbers become Number)."""
    return agentgate.parse(json.dumps(value).encode())


def adversarial(length: int, seed: int = 0) -> str:
    """a and b that never end in c: the search runs to the end and matches nothing."""
    pattern = "ab" if seed % 2 == 0 else "ba"
    return (pattern * (length // 2 + 1))[:length]


def matching(length: int, lead: int) -> str:
    """A text the pattern matches, different for each `lead`."""
    return "b" * lead + "a" * (length - lead - 1) + "c"


# ---------------------------------------------------------------- the budget, per call


def test_the_pattern_budget_is_shared_by_the_values_of_one_call():
    length = agentgate.PATTERN_WORK // SIZE // 3 + 1   # three of these cost more than a call may
    schema = P(CHECK_SCHEMA)
    values = [matching(length, lead) for lead in range(3)]
    for value in values:
        agentgate.validate(schema, P({"code": value}))          # each alone is checked and passes
    agentgate.validate(schema, P({"codes": values[:2]}))
    with pytest.raises(agentgate.PatternCost) as caught:
        agentgate.validate(schema, P({"codes": values}))
    assert str(caught.value).startswith(f"/codes/2: too long ({length} characters)")


def test_the_schema_check_and_the_policy_of_one_call_share_the_budget():
    length = agentgate.PATTERN_WORK // SIZE // 2 + 1
    condition = agentgate.Condition("/note", P({"pattern": SLOW}), "where")
    args = P({"code": matching(length, 0), "note": matching(length, 1)})
    assert condition.holds(args) is True                       # alone, it is judged
    work = agentgate.PatternWork()
    agentgate.validate(P(CHECK_SCHEMA), args, work=work)
    assert condition.holds(args, work) is None                 # after the schema's share, not


def test_a_value_searched_again_in_the_same_call_costs_nothing_more():
    length = agentgate.PATTERN_WORK // SIZE - 1
    value, work = adversarial(length), agentgate.PatternWork()
    schema = P({"anyOf": [{"pattern": SLOW}, {"pattern": SLOW, "minLength": 1}]})
    with pytest.raises(agentgate.SchemaError):
        agentgate.validate(schema, value, work=work)
    assert agentgate.Condition("/v", P({"pattern": SLOW}), "where").holds({"v": value}, work) \
        is False


def test_a_value_too_costly_to_check_never_passes_a_not():
    schema = P({"type": "object", "properties": {"name": {"not": {"pattern": SLOW}}}})
    cheap = adversarial(1000)
    agentgate.validate(schema, P({"name": cheap}))               # checked: not matched, so valid
    with pytest.raises(agentgate.PatternCost) as caught:
        agentgate.validate(schema, P({"name": adversarial(agentgate.PATTERN_WORK // SIZE + 1)}))
    assert str(caught.value).startswith("/name: too long")


class DroppedMidway(agentgate.Pattern):
    """A pattern whose DFA cache is dropped, as another thread's search drops it, each time a
    new state has just been stored and counted."""

    @property
    def _cached(self):
        return self.__dict__.get("counted", 0)

    @_cached.setter
    def _cached(self, value):
        self.__dict__["counted"] = value
        if value:
            self._states.clear()


def test_a_search_is_right_when_another_thread_drops_the_cache_midway():
    # Calls are judged outside the gate's lock, so two searches of one pattern run at once.
    compiled = agentgate.compile_pattern(SLOW)
    shared = DroppedMidway(compiled._program, compiled._start)
    assert shared.search(matching(500, 3)) is True
    assert shared.search(adversarial(500)) is False


# ---------------------------------------------------------------- the policy: never looser


def decide(when, args, grants=()):
    doc = {"database": "runs.db", "session": "s", "servers": [{
        "name": "bank", "command": ["x"], "manifest": "m.json",
        "rules": {"pay": {"side_effect": "remote_mutation", "outcome": "require_approval",
                          "when": when}}}]}
    config = agentgate.Config(P(doc), "/tmp/x/config.json")
    rule = config.servers[0].rules["pay"]
    tool = types.SimpleNamespace(name="pay", rule=rule, side_effect=rule.side_effect,
                                 schema={"type": "object"})
    facts = agentgate.Facts(0.0, "cli", lambda: list(grants), None)
    decision = agentgate.policy_decision(config, tool, P(args), facts)
    return decision["outcome"], decision["by"]


def test_an_entry_too_costly_to_judge_denies_unless_it_would_only_allow():
    long = adversarial(agentgate.PATTERN_WORK // SIZE + 1)
    deny = {"if": {"/to": {"pattern": SLOW}}, "outcome": "deny"}
    ask = {"if": {"/to": {"pattern": SLOW}}, "outcome": "require_approval"}
    allow = {"if": {"/to": {"pattern": SLOW}}, "outcome": "allow"}
    small = {"if": {"/amount": {"max": 10}}, "outcome": "allow"}
    assert decide([deny], {"to": "a" + "b" * 400 + "c"}) == ("deny", "when[0]")
    assert decide([deny], {"to": "ab"}) == ("require_approval", "rule outcome")
    assert decide([deny], {"to": long}) == ("deny", "when[0]")
    assert decide([small, ask], {"to": long, "amount": 50}) == ("deny", "when[1]")
    assert decide([allow], {"to": long}) == ("require_approval", "rule outcome")
    # A condition found false decides the entry, whatever the others could not judge.
    both = {"if": {"/to": {"pattern": SLOW}, "/amount": {"min": 100}}, "outcome": "deny"}
    assert decide([both], {"to": long, "amount": 5}) == ("require_approval", "rule outcome")


def test_a_grant_too_costly_to_judge_does_not_cover_the_call():
    grant = agentgate.Grant({"id": "g1", "by": "op", "conditions_json": json.dumps(
        {"/to": {"pattern": SLOW}})})
    assert decide([], {"to": "a" + "b" * 400 + "c"}, [grant]) == ("allow", "grant g1")
    assert decide([], {"to": adversarial(agentgate.PATTERN_WORK // SIZE + 1)}, [grant]) == \
        ("require_approval", "rule outcome")


def test_a_long_payee_does_not_slip_past_a_deny_entry(workdir):
    deny = {"if": {"/to": {"pattern": SLOW}}, "outcome": "deny", "reason": "blocked payee"}
    config = write_config(workdir, [bank_server(workdir, rules={
        "pay": {"outcome": "allow", "when": [deny]}})])
    pin(config)
    with Host([sys.executable, str(AGENTGATE), "-config", str(config)]) as host:
        text, error = said(host.call("bank_pay", {"to": adversarial(200_000), "amount": 5}))
        assert text.startswith("DENIED:") and error, text[:300]
        assert "too long to be checked against the operator's rule when[0]" in text, text
        assert SLOW not in text
        paid = host.call("bank_pay", {"to": "ab", "amount": 5})
        assert result_text(paid) == "paid 5.00 to ab", result_text(paid)
    assert payments(ledger(workdir)) == 1


# ---------------------------------------------------------------- a real gate


def checker(workdir) -> Path:
    """A server with a tool whose schema has the slow pattern and an unrelated read."""
    spec = {"tools": [tool("check", CHECK_SCHEMA, "Check a code."),
                      tool("look", {"type": "object"}, "Look around.")]}
    config = write_config(workdir, [scripted_server(workdir, spec, name="svc", rules={
        "check": rule("read_only"), "look": rule("read_only")})])
    pin(config)
    return config


def test_a_value_too_costly_to_check_is_invalid_at_once_and_names_its_place(workdir):
    with Host([sys.executable, str(AGENTGATE), "-config", str(checker(workdir))]) as host:
        text = expect(host.call("svc_check", {"code": adversarial(100_000)}), "INVALID", True)
        assert "/code: too long (100000 characters)" in text, text
        many = [adversarial(100_000, seed) for seed in range(4)]
        text = expect(host.call("svc_check", {"codes": many}), "INVALID", True)
        assert "/codes/0: too long (100000 characters)" in text, text
        assert result_text(host.call("svc_look", {})) == "called look"


# The gate with its pattern search held while a file named HELD_UNTIL does not exist, for texts
# of at least HELD_LENGTH characters: `python -c HOLDING agentgate.py WORKDIR ARGS...`. It writes
# the file CHECKING when a search is held, so a test knows the check is under way.
HELD_LENGTH = 2000
HOLDING = ("import os, sys, time\n"
           "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"
           "import agentgate\n"
           "work, searching = sys.argv[2], agentgate.Pattern.search\n"
           "def held(self, text):\n"
           f"    if len(text) >= {HELD_LENGTH}:\n"
           "        open(os.path.join(work, 'CHECKING'), 'w').close()\n"
           "        deadline = time.monotonic() + 300\n"
           "        while not os.path.exists(os.path.join(work, 'HELD_UNTIL')) and \\\n"
           "                time.monotonic() < deadline:\n"
           "            time.sleep(0.01)\n"
           "    return searching(self, text)\n"
           "agentgate.Pattern.search = held\n"
           "sys.exit(agentgate.main(sys.argv[3:]))\n")


def test_an_unrelated_call_is_answered_while_a_slow_one_is_checked(workdir):
    config = checker(workdir)
    argv = [sys.executable, "-c", HOLDING, str(AGENTGATE), str(workdir), "-config", str(config)]
    try:
        with Host(argv) as host:
            slow = host.submit("svc_check", {"code": adversarial(HELD_LENGTH)})
            wait_for(lambda: (workdir / "CHECKING").exists(), DEADLINE,
                     message="the slow call's pattern search never began")
            read = host.submit("svc_look", {})
            assert result_text(read.result(DEADLINE)) == "called look"
            assert not slow.done()          # still being checked: the read did not wait for it
            (workdir / "HELD_UNTIL").touch()
            text = expect(slow.result(DEADLINE), "INVALID", True)
            assert "/code: expected text matching the pattern" in text, text
    finally:
        (workdir / "HELD_UNTIL").touch()
