"""A `min`/`max` rule on an amount the server types as a string (issue 29 item 4; SPEC
"Policy on what a call does"), through a real gate in front of a scripted payment server whose
schema says `"amount": {"type": "string"}`, with the README's payment rule:

- "20.00" to the landlord runs, as the README's rule says; "60.00" asks, and `approve` and
  `show` say which `when` entries were tried and why none held.
- a sum limit reads the string amounts as decimals too, and `recheck` reaches the same decisions.
- a string where the schema types a number is still no amount (unit).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import (approval_in, gate_host, operator, pin, recheck_json, records, rule, said,
                 scripted_server, tool, write_config)  # noqa: E402

PAY = "shop_pay"
SCHEMA = {"type": "object", "required": ["to", "amount"],
          "properties": {"to": {"type": "string"}, "amount": {"type": "string"}}}
README_RULE = {  # the README's payment rule, as it is written there
    "when": [
        {"if": {"/amount": {"min": "0.01", "max": "50.00"}, "/to": {"in": ["landlord", "grocer"]}},
         "outcome": "allow", "reason": "a small payment to a known payee"},
        {"if": {"/amount": {"min": 1000}}, "outcome": "deny",
         "reason": "payments of 1000 or more are made by hand"}],
    "limits": [{"sum": "/amount", "max": "100.00", "per": "24h"},
               {"calls": 5, "per": "1h", "then": "deny"}]}


def shop(workdir):
    spec = {"tools": [tool("pay", SCHEMA, "Pay someone.")],
            "record": str(workdir / "shop.calls")}
    server = scripted_server(workdir, spec, name="shop",
                             rules={"pay": rule("remote_mutation", **README_RULE)})
    config = write_config(workdir, [server])
    pin(config)
    return config


def paid(workdir):
    return [e["arguments"] for e in records(workdir / "shop.calls") if "call" in e]


def test_a_string_amount_is_compared_as_its_decimal_and_approve_says_why_none_held(tmp_path):
    config = shop(tmp_path)
    host = gate_host(config)
    try:
        text, error = said(host.call(PAY, {"to": "landlord", "amount": "20.00"}))
        assert not error and text == "called pay", text
        text, error = said(host.call(PAY, {"to": "landlord", "amount": "60.00"}))
        assert text.startswith("PENDING_APPROVAL:"), text
        # 20.00 + 45.00 is within the sum limit of 100.00; 20.00 + 85.00 is not.
        assert said(host.call(PAY, {"to": "grocer", "amount": "45.00"}))[0] == "called pay"
        text = said(host.call(PAY, {"to": "grocer", "amount": "40.00"}))[0]
        assert text.startswith("PENDING_APPROVAL:") and "limit" in text, text
    finally:
        host.close()
    assert [p["amount"] for p in paid(tmp_path)] == ["20.00", "45.00"]
    approval = approval_in(said_first_pending(tmp_path))
    done = operator(config, "approve", approval, "-approval", approval)
    assert "no when entry held: when[0]: /amount is not at most 50.00; " \
           "when[1]: /amount is not at least 1000" in done.stdout, done.stdout
    shown = operator(config, "show", approval).stdout
    assert "step 0: no when entry held: when[0]: /amount is not at most 50.00" in shown, shown
    code, reports = recheck_json(config)
    assert code == 0 and all(r["same"] for r in reports), reports
    assert sum(r["rechecked"] for r in reports) >= 4, reports


def said_first_pending(workdir):
    """The approval id of the first approval the database holds, as the model was told."""
    with sqlite3.connect(workdir / "runs.db") as db:
        (ident,), = db.execute("SELECT id FROM approvals ORDER BY created_at LIMIT 1")
    return f"approval {ident}"


def J(value):
    return agentgate.parse(json.dumps(value))


def test_a_decimal_string_is_an_amount_only_where_the_schema_types_a_string():
    condition = agentgate.Condition("/amount", J({"max": "50.00"}), "t")
    as_string = {"type": "object", "properties": {"amount": {"type": "string"}}}
    as_number = {"type": "object", "properties": {"amount": {"type": "number"}}}
    assert condition.holds(J({"amount": "20.00"}), schema=as_string)
    assert not condition.holds(J({"amount": "60.00"}), schema=as_string)
    assert not condition.holds(J({"amount": "20.00"}), schema=as_number)
    assert not condition.holds(J({"amount": "twenty"}), schema=as_string)
    assert not condition.holds(J({"amount": "1e99999"}), schema=as_string)
    assert condition.miss(J({"amount": "twenty"}), None, as_string) == "/amount is not a number"
    assert condition.miss(J({}), None, as_string) == "/amount is absent"
    assert condition.miss(J({"amount": "20.00"}), None, as_string) == ""
