"""Limits that count what the server really did (issue 19 item 8; SPEC "Policy on what a call
does"; agentgate.py sections 4, 8, 10 and 12), end to end through the real gate.

- An argument the call omits is read at the default the tool's pinned schema gives it, since
  the server fills that in: by a sum limit (an omitted amount paid 200 under a budget of 100)
  and by a `when` entry alike.
- A limit counts the executions in its window by the arguments each was recorded with: a
  limit added, or re-pointed, after payments were made counts them at what they were (180
  paid under a new budget of 100 leaves nothing), an omitted amount at its default.
- `recheck` under the unchanged policy agrees with what the gate decided.

A scripted server offers a `pay` whose schema gives `amount` a default (the fake bank's has
none); the fake bank serves the limit added after a payment.
"""

from __future__ import annotations

import json

import agentgate
from kit import (
    Bank,
    bankdir,  # noqa: F401 (fixture)
    db_path,
    gate_host,
    pin,
    query,
    recheck_json,
    records,
    rule,
    said,
    scripted_server,
    tool,
    write_config,
)

PAY = "shop_pay"
PAY_SCHEMA = {"type": "object", "required": ["to"], "additionalProperties": False,
              "properties": {"to": {"type": "string"},
                             "amount": {"type": "number", "default": 200},
                             "fee": {"type": "number"}}}


def J(value):
    return agentgate.parse(json.dumps(value))


def shop(workdir, **pay_rule):
    """A config with the scripted shop, whose pay echoes what it was sent and records it;
    pinned the first time. Rewritten with another rule, a gate started later reads it."""
    spec = {"tools": [tool("pay", PAY_SCHEMA, "Pay someone.")],
            "record": str(workdir / "shop.calls"), "calls": {"pay": {"echo": True}}}
    server = scripted_server(workdir, spec, name="shop", rules={
        "pay": rule("remote_mutation", outcome="allow", **pay_rule)})
    config = write_config(workdir, [server])
    if not (workdir / "shop.manifest.json").exists():
        pin(config)
    return config


def paid(workdir) -> list:
    """The arguments of every call the shop received, oldest first."""
    return [entry["arguments"] for entry in records(workdir / "shop.calls") if "call" in entry]


def pay(host, args) -> tuple[str, bool]:
    return said(host.call(PAY, args))


def budget(pointer: str, most) -> dict:
    return {"sum": pointer, "max": most, "per": "24h", "then": "deny"}


def run_ids(workdir) -> list[str]:
    return [row[0] for row in query(db_path(workdir), "SELECT id FROM runs ORDER BY rowid")]


def rechecked(config, run_id) -> list[tuple]:
    """(recorded, rechecked, result) of each decision of one run, re-checked under the
    config as it is, which must be the policy the run was decided under."""
    code, reports = recheck_json(config, "-run", run_id)
    assert [r["identity"] for r in reports] == ["unchanged"], reports
    assert code == (0 if all(r["same"] for r in reports) else 1), reports
    return [(e["recorded"], e["rechecked"], e["result"]) for r in reports
            for e in r["evaluations"]]


# ---------------------------------------------------------------- the value a pointer reads


def test_a_pointer_reads_the_default_the_server_fills_in_where_the_arguments_lack_it():
    schema = J({"type": "object",
                "$defs": {"payee": {"type": "object", "properties": {
                    "name": {"type": "string", "default": "landlord"}}}},
                "properties": {
                    "amount": {"type": "number", "default": 200},
                    "payee": {"$ref": "#/$defs/payee"},
                    "options": {"type": "object", "default": {"speed": "slow"}, "properties": {
                        "speed": {"type": "string"}, "fee": {"type": "number", "default": 2}}},
                    "lines": {"type": "array", "items": {"type": "number", "default": 7}},
                    "broken": {"$ref": "#/$defs/nothing"}}})

    def read(args, pointer, given=schema):
        value = agentgate.pointed(J(args), agentgate.parse_pointer(pointer, "t"), given)[0]
        return value.exact() if isinstance(value, agentgate.Number) else value

    assert read({"amount": 5}, "/amount") == 5           # what the call gives wins
    assert read({}, "/amount") == 200
    assert read({}, "/amount", None) is agentgate.MISSING  # no schema, no default
    assert read({"payee": {}}, "/payee/name") == "landlord"  # through a $ref
    assert read({}, "/payee/name") is agentgate.MISSING  # no payee is sent, so no name either
    assert read({}, "/options/speed") == "slow"          # inside its parent's default
    assert read({}, "/options/fee") == 2                 # the parent's default lacks it
    assert read({"options": {"fee": 3}}, "/options/fee") == 3
    assert read({"lines": []}, "/lines/0") is agentgate.MISSING  # no server fills in an item
    assert read({"broken": {}}, "/broken/x") is agentgate.MISSING
    assert read({}, "/nowhere") is agentgate.MISSING


# ---------------------------------------------------------------- through the gate


def test_an_omitted_amount_counts_at_its_schema_default_against_a_sum_limit(workdir):
    config = shop(workdir, limits=[budget("/amount", 100)])
    with gate_host(config) as host:
        text, error = pay(host, {"to": "stranger"})
        assert error and text.startswith("DENIED:"), text
        assert "a limit is reached" in text and "this call alone is above it" in text, text
        # Within the budget when the amount is given.
        text, error = pay(host, {"to": "grocer", "amount": 60})
        assert not error and json.loads(text) == {"to": "grocer", "amount": 60}, text
    assert paid(workdir) == [{"to": "grocer", "amount": 60}]


def test_a_when_entry_reads_the_schema_default_of_an_omitted_argument(workdir):
    by_hand = {"if": {"/amount": {"min": 100}}, "outcome": "deny",
               "reason": "payments of 100 or more are made by hand"}
    config = shop(workdir, when=[by_hand])
    with gate_host(config) as host:
        text, error = pay(host, {"to": "stranger"})
        assert error and text.startswith("DENIED:"), text
        assert "payments of 100 or more are made by hand" in text, text
        text, error = pay(host, {"to": "grocer", "amount": 60})
        assert not error, text
    assert paid(workdir) == [{"to": "grocer", "amount": 60}]


def test_a_limit_added_after_a_payment_counts_it(bankdir):
    bank = Bank(bankdir, rules={"pay": {"outcome": "allow"}})
    with bank.start() as host:
        assert bank.call(host, {"to": "landlord", "amount": 180}).text == "paid 180.00 to landlord"
    bank.write({"pay": {"outcome": "allow", "limits": [budget("/amount", 100)]}})
    with bank.start() as host:
        over = bank.call(host, {"to": "grocer", "amount": 10})
        assert over.prefix == "DENIED" and over.is_error, over
        assert "a sum of /amount of at most 100 for bank_pay per 24h" in over.text, over
    assert [line["to"] for line in bank.ledger_lines()] == ["landlord"]
    # recheck, under the policy the denial was made under, counts as the gate did.
    _, denied = bank.run_ids()
    assert rechecked(bank.config, denied) == [("deny", "deny", "same")]


def test_a_re_pointed_limit_counts_earlier_payments_at_what_they_were(workdir):
    """A budget on /fee, then re-pointed to /amount: the payment that omitted its amount
    (the server paid its default, 200) counts 200 against the new budget of 250."""
    config = shop(workdir, limits=[budget("/fee", 100)])
    with gate_host(config) as host:
        text, error = pay(host, {"to": "landlord", "fee": 1})
        assert not error, text
    config = shop(workdir, limits=[budget("/amount", 250)])
    with gate_host(config) as host:
        text, error = pay(host, {"to": "stranger", "amount": 60})
        assert error and text.startswith("DENIED:") and "a limit is reached" in text, text
        text, error = pay(host, {"to": "grocer", "amount": 50})   # 250 exactly
        assert not error, text
    assert [args["to"] for args in paid(workdir)] == ["landlord", "grocer"]
    _, denied, allowed = run_ids(workdir)
    assert rechecked(config, denied) == [("deny", "deny", "same")]
    assert rechecked(config, allowed) == [("allow", "allow", "same")]
