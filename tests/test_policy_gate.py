"""The policy on what a call does (SPEC "Policy on what a call does"; agentgate.py sections 8
and 10), end to end: a real host (the MCP Python SDK client of tests/conftest.py) calls
agentgate in front of the fake payment server, whose ledger counts the payments made, and an
operator runs the operator commands in other processes.

Covered, one test per behaviour:
- `when` entries decide: an allow entry lets a small payment to a known payee run, a
  lookalike payee (Cyrillic a) waits, a deny entry refuses with its reason; amounts compare as
  exact decimals from their literals (50.000000000000001 is above 50.00, 5e1 is not, sent as
  raw bytes since the SDK would round them); the first entry that holds decides.
- Nothing the model is shown names the program, its commands, the config, the database or a
  run id, whatever the policy decided.
- `limits`: a calls limit denies (or, by default, asks about) the call past it, naming the
  limit and when it frees up (also when the model asks again while it waits); a sum limit
  counts exact decimals.
- The acceptance race: sixteen payments of 10 from two gate processes on one database, released
  at once against a sum limit of 100, make exactly ten payments.
- `"operator": "none"`: what would wait is denied and nothing waits.
- `client`: an entry holds only for the host name given in initialize.
- `check` prints each entry and limit on a line of its own and refuses a policy mistake with
  one sentence (a pointer the pinned schema lacks refuses the tool; a syntax mistake fails
  the config).
- `show` and `approve` say which entry or limit decided.
- `recheck` re-evaluates with the facts of the time of each decision: the history before it
  (a calls limit) and the time of day (a `during` entry, re-checked on a clock 12 hours on).
"""

from __future__ import annotations

import datetime
import math
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import AGENTGATE, Host, agentgate_argv
from kit import (
    DEADLINE,
    PAY,
    Bank,
    bankdir,  # noqa: F401 (fixture)
    check,
    operator,
    recheck_json,
    result_text,
    run_to_end,
    said,
    stored_seconds,
)

SESSION_NAME = "paybook"  # run ids start "paybook.": no answer may name it
SMALL_KNOWN = {"if": {"/amount": {"max": "50.00"}, "/to": {"in": ["landlord", "grocer"]}},
               "outcome": "allow", "reason": "a small payment to a known payee"}
BIG_DENIED = {"if": {"/amount": {"min": 1000}}, "outcome": "deny",
              "reason": "payments of 1000 or more are made by hand"}
LOOKALIKE = "l\u0430ndlord"  # Cyrillic a


# ---------------------------------------------------------------- helpers


def make_bank(workdir, pay: dict, **top) -> Bank:
    """The fake bank behind agentgate, with `pay`'s rule fields merged over remote_mutation,
    pinned, in session SESSION_NAME."""
    bank = Bank(workdir, rules={"pay": pay}, session=SESSION_NAME, **top)
    bank.top = top
    return bank


def rewrite(bank: Bank, pay: dict) -> None:
    """Rewrite the config with another pay rule (a gate started later reads it)."""
    bank.write({"pay": pay}, session=SESSION_NAME, **bank.top)


def assert_hidden(bank: Bank, *answers) -> None:
    """No answer names the program, its commands, the config, the database or a run id."""
    forbidden = {"agentgate", ".json", ".db", "-approval", "-config", SESSION_NAME,
                 *bank.forbidden()}
    for answer in answers:
        text = answer if isinstance(answer, str) else answer.text
        for word in forbidden:
            assert word.lower() not in text.lower(), f"the model was shown {word!r}: {text}"


def policy_of(bank: Bank, run_id: str) -> dict:
    """The policy record of a run's first step, as `show -json` prints it."""
    steps = bank.show(run_id)["steps"]
    assert steps and steps[0]["policy"], steps
    return steps[0]["policy"]


def prose_at(stored: str, seconds: float = 0.0) -> str:
    """A stored time plus `seconds`, as the model's prose prints when a limit frees up (UTC,
    rounded up to the second, so a call made then is within the limit)."""
    moment = datetime.datetime.fromtimestamp(math.ceil(stored_seconds(stored) + seconds),
                                             datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def executions_at(bank: Bank) -> list[str]:
    """When each execution the limits count started, oldest first."""
    return [at for (at,) in bank.query("SELECT at FROM executions ORDER BY at, id")]


# agentgate with its clock moved 12 hours on: `python -c SHIFTED agentgate.py ARGS...`. Every
# time agentgate reads or stores goes through time.time, so this is agentgate run half a day
# later (the fake bank it starts is not shifted; it reads no clock).
SHIFTED = ("import runpy, sys, time\n"
           "_real = time.time\n"
           "time.time = lambda: _real() + 12 * 3600\n"
           "sys.argv = sys.argv[1:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def shifted_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", SHIFTED, str(AGENTGATE), *args]


# ---------------------------------------------------------------- 1. when entries decide


def test_when_entries_decide_on_the_call_itself(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN, BIG_DENIED]})
    host = bank.start()

    paid = bank.call(host, {"to": "landlord", "amount": 20})
    assert not paid.is_error and paid.text == "paid 20.00 to landlord", paid
    assert bank.payments() == 1 and bank.ledger_lines()[-1]["to"] == "landlord"

    lookalike = bank.call(host, {"to": LOOKALIKE, "amount": 20})
    assert lookalike.prefix == "PENDING_APPROVAL" and not lookalike.is_error, lookalike
    assert bank.payments() == 1

    denied = bank.call(host, {"to": "landlord", "amount": 1000})
    assert denied.is_error and denied.text == (
        "DENIED: The policy does not allow this request: payments of 1000 or more are made by "
        "hand. Nothing was executed."), denied
    assert bank.payments() == 1

    # Neither entry holds: the class (remote_mutation -> require_approval) decides.
    unknown_payee = bank.call(host, {"to": "plumber", "amount": 20})
    assert unknown_payee.prefix == "PENDING_APPROVAL", unknown_payee
    assert bank.payments() == 1
    assert [a["capability"]["args"]["to"] for a in bank.approvals("pending")] == \
        [LOOKALIKE, "plumber"]

    # The decisions name what made them.
    runs = bank.run_ids()
    assert [policy_of(bank, r)["by"] for r in runs] == ["when[0]", "class", "when[1]", "class"]
    assert_hidden(bank, paid, lookalike, denied, unknown_payee)


def test_amounts_compare_as_exact_decimals_from_their_literals(bankdir):
    """The SDK would send 50.000000000000001 as 50.0, so these are written as raw bytes."""
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN]})
    raw = bank.raw()
    above = raw.call_bytes(PAY, b'{"to":"grocer","amount":50.000000000000001}')
    assert above.prefix == "PENDING_APPROVAL", above
    assert bank.payments() == 0
    within = raw.call_bytes(PAY, b'{"to":"grocer","amount":5e1}')
    assert not within.is_error and within.text == "paid 50.00 to grocer", within
    exact = raw.call_bytes(PAY, b'{"to":"grocer","amount":50.00}')
    assert exact.text == "paid 50.00 to grocer", exact
    cent_above = raw.call_bytes(PAY, b'{"to":"grocer","amount":50.01}')
    assert cent_above.prefix == "PENDING_APPROVAL", cent_above
    assert bank.payments() == 2
    assert [policy_of(bank, r)["by"] for r in bank.run_ids()] == \
        ["class", "when[0]", "when[0]", "class"]
    assert_hidden(bank, above, within, exact, cent_above)


def test_the_first_entry_that_holds_decides(bankdir):
    landlord_first = {"if": {"/to": {"in": ["landlord"]}}, "outcome": "allow",
                      "reason": "the landlord is always paid"}
    bank = make_bank(bankdir, {"when": [landlord_first, BIG_DENIED]})
    with bank.start() as host:
        paid = bank.call(host, {"to": "landlord", "amount": 1200})
        assert not paid.is_error and paid.text == "paid 1200.00 to landlord", paid
    assert bank.payments() == 1

    rewrite(bank, {"when": [BIG_DENIED, landlord_first]})
    with bank.start() as host:
        denied = bank.call(host, {"to": "landlord", "amount": 1300})
        assert denied.prefix == "DENIED" and "made by hand" in denied.text, denied
        still_paid = bank.call(host, {"to": "landlord", "amount": 900})
        assert still_paid.text == "paid 900.00 to landlord", still_paid
    assert bank.payments() == 2
    assert [policy_of(bank, r)["by"] for r in bank.run_ids()] == ["when[0]", "when[0]", "when[1]"]
    assert_hidden(bank, paid, denied, still_paid)


# ---------------------------------------------------------------- 2. what the model is shown


def test_no_answer_names_the_operator_command_the_database_the_config_or_a_run(bankdir):
    """Every kind of answer the policy engine gives, looked at together."""
    bank = make_bank(bankdir, {
        "when": [SMALL_KNOWN, BIG_DENIED,
                 {"if": {"/currency": {"equals": "XAU"}}, "outcome": "require_approval",
                  "reason": "gold is paid by hand"}],
        "limits": [{"calls": 2, "per": "1h", "then": "deny"},
                   {"sum": "/amount", "max": "50", "per": "24h"}]})
    host = bank.start()
    answers = [bank.call(host, {"to": "landlord", "amount": 10}),                   # allowed
               bank.call(host, {"to": "grocer", "amount": 45}),                     # sum: waits
               bank.call(host, {"to": "landlord", "amount": 2000}),                 # when deny
               bank.call(host, {"to": "stranger", "amount": 1, "currency": "XAU"}),  # when asks
               bank.call(host, {"to": "stranger", "amount": 1})]                    # class asks
    assert [a.prefix for a in answers] == ["paid 10.00 to landlord", "PENDING_APPROVAL", "DENIED",
                                           "PENDING_APPROVAL", "PENDING_APPROVAL"], answers
    assert "a limit is reached" in answers[1].text and "frees up at" in answers[1].text
    answers.append(bank.call(host, {"to": "grocer", "amount": 5}))                  # allowed
    answers.append(bank.call(host, {"to": "grocer", "amount": 6}))                  # calls: deny
    assert answers[-2].text == "paid 5.00 to grocer" and answers[-1].prefix == "DENIED", answers
    assert "at most 2 calls" in answers[-1].text
    assert bank.payments() == 2
    assert bank.run_ids() and all(r.startswith(f"{SESSION_NAME}.") for r in bank.run_ids())
    assert_hidden(bank, *answers)
    host.close()
    # ... and with no operator at hand.
    bank.top = {"operator": "none"}
    rewrite(bank, {"when": [SMALL_KNOWN]})
    with bank.start() as quiet:
        alone = bank.call(quiet, {"to": "stranger", "amount": 2})
    assert alone.prefix == "DENIED" and "no operator" in alone.text, alone
    assert_hidden(bank, alone)


# ---------------------------------------------------------------- 3. calls limits


def test_a_calls_limit_denies_the_call_past_it_and_says_when_it_frees_up(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN],
                               "limits": [{"calls": 2, "per": "1h", "then": "deny"}]})
    host = bank.start()
    first = bank.call(host, {"to": "landlord", "amount": 10})
    second = bank.call(host, {"to": "grocer", "amount": 11})
    assert [first.text, second.text] == ["paid 10.00 to landlord", "paid 11.00 to grocer"]
    third = bank.call(host, {"to": "grocer", "amount": 12})
    assert third.is_error and third.prefix == "DENIED", third
    assert "at most 2 calls to bank_pay per 1h" in third.text, third
    # It frees up an hour after the oldest of the two executions it counted.
    oldest = executions_at(bank)[0]
    assert f"it frees up at {prose_at(oldest, 3600)}" in third.text, (oldest, third.text)
    assert bank.payments() == 2
    # Still denied, and still nothing paid, however often it is asked.
    assert bank.call(host, {"to": "grocer", "amount": 13}).prefix == "DENIED"
    assert bank.payments() == 2 and len(executions_at(bank)) == 2
    assert_hidden(bank, first, second, third)


def test_a_calls_limit_asks_an_operator_by_default(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN], "limits": [{"calls": 2, "per": "1h"}]})
    host = bank.start()
    for payee, amount in (("landlord", 10), ("grocer", 11)):
        assert not bank.call(host, {"to": payee, "amount": amount}).is_error
    third_args = {"to": "grocer", "amount": 12}
    third = bank.call(host, third_args)
    assert third.prefix == "PENDING_APPROVAL" and not third.is_error, third
    assert "It waits because a limit is reached: at most 2 calls to bank_pay per 1h" in third.text
    assert "frees up at" in third.text
    assert bank.payments() == 2
    run_id, approval = bank.pending(third)
    # The operator is shown which limit decided, and approves.
    approved = bank.approve(run_id, approval)
    printed = approved.stdout
    assert "limits[0]" in printed and "at most 2 calls to bank_pay" in printed, printed
    assert printed.index("limits[0]") < printed.index(f"approval {approval}: approved")
    # An approved call is not counted against the limit again: it runs.
    collected = bank.call(host, third_args)
    assert collected.text == "paid 12.00 to grocer", collected
    assert bank.payments() == 3
    assert_hidden(bank, third, collected)


def test_asking_again_while_a_limit_waits_still_says_when_it_frees_up(bankdir):
    """SPEC: past a limit, "the prose names the limit and when it frees up". The model that
    calls again with the same arguments (as it is told to, once approved) is told the same."""
    bank = make_bank(bankdir, {"outcome": "allow", "limits": [{"calls": 1, "per": "1h"}]})
    host = bank.start()
    assert bank.call(host, {"to": "a", "amount": 1}).text == "paid 1.00 to a"
    first = bank.call(host, {"to": "b", "amount": 1})
    again = bank.call(host, {"to": "b", "amount": 1})
    assert first.prefix == again.prefix == "PENDING_APPROVAL", (first, again)
    assert again.approval_id() == first.approval_id()
    frees = f"it frees up at {prose_at(executions_at(bank)[0], 3600)}"
    assert frees in first.text, first
    assert frees in again.text, again
    assert bank.payments() == 1


# ---------------------------------------------------------------- 4. sum limits


def test_a_sum_limit_keeps_the_sum_of_executed_amounts_under_its_max(bankdir):
    bank = make_bank(bankdir, {"outcome": "allow", "limits": [
        {"sum": "/amount", "max": "100.00", "per": "24h", "then": "deny"}]})
    host = bank.start()
    for payee in ("a", "b", "c"):
        paid = bank.call(host, {"to": payee, "amount": 30})
        assert paid.text == f"paid 30.00 to {payee}", paid
    over = bank.call(host, {"to": "d", "amount": 20})
    assert over.prefix == "DENIED", over
    assert "a sum of /amount of at most 100.00 for bank_pay per 24h" in over.text, over
    # 20 fits once the first 30 leaves the window, a day after it executed.
    assert f"it frees up at {prose_at(executions_at(bank)[0], 24 * 3600)}" in over.text, over
    fits = bank.call(host, {"to": "e", "amount": 10})
    assert fits.text == "paid 10.00 to e", fits
    full = bank.call(host, {"to": "f", "amount": 1})
    assert full.prefix == "DENIED", full
    assert [line["to"] for line in bank.ledger_lines()] == ["a", "b", "c", "e"]
    # A call that alone is above the max never fits.
    alone = bank.call(host, {"to": "g", "amount": 101})
    assert alone.prefix == "DENIED" and "this call alone is above it" in alone.text, alone
    assert_hidden(bank, over, fits, full, alone)


def test_a_sum_limit_adds_exact_decimals(bankdir):
    """33.33 three times and 0.01 is 100.00 exactly (as floats, 100.00000000000001)."""
    bank = make_bank(bankdir, {"outcome": "allow", "limits": [
        {"sum": "/amount", "max": "100.00", "per": "24h", "then": "deny"}]})
    host = bank.start()
    for payee in ("a", "b", "c"):
        assert bank.call(host, {"to": payee, "amount": 33.33}).text == f"paid 33.33 to {payee}"
    last_cent = bank.call(host, {"to": "d", "amount": 0.01})
    assert last_cent.text == "paid 0.01 to d", last_cent
    one_too_many = bank.call(host, {"to": "e", "amount": 0.01})
    assert one_too_many.prefix == "DENIED", one_too_many
    assert bank.payments() == 4


# ---------------------------------------------------------------- 5. the race


def test_two_gates_racing_never_pass_a_sum_limit_together(bankdir):
    """The acceptance criterion: 16 payments of 10 (no two the same request) from two gate
    processes on one config and database, released at once, against a sum of at most 100:
    exactly 10 are paid and 6 denied."""
    bank = make_bank(bankdir, {"outcome": "allow", "limits": [
        {"sum": "/amount", "max": 100, "per": "24h", "then": "deny"}]})
    hosts = [bank.start(), bank.start()]
    for host in hosts:
        host.list_tools()  # both gates serve their tools and have their database open
    barrier = threading.Barrier(len(hosts), timeout=DEADLINE)

    def fire(index: int):
        host = hosts[index]

        async def eight(client):
            import asyncio
            calls = [client.call_tool(PAY, {"to": f"payee-{index}-{i}", "amount": 10})
                     for i in range(8)]
            return await asyncio.gather(*calls)

        barrier.wait()  # every call of both gates leaves at once
        return host.run(eight, timeout=DEADLINE * 2)

    with ThreadPoolExecutor(len(hosts)) as pool:
        results = [r for batch in pool.map(fire, range(len(hosts))) for r in batch]

    texts = [said(r)[0] for r in results]
    paid = [t for t in texts if t.startswith("paid 10.00 to payee-")]
    denied = [t for t in texts if t.startswith("DENIED:")]
    assert (len(paid), len(denied)) == (10, 6), texts
    assert all("a sum of /amount of at most 100 for bank_pay" in t for t in denied), denied
    assert bank.payments() == 10
    assert len({line["to"] for line in bank.ledger_lines()}) == 10
    assert len(executions_at(bank)) == 10
    assert_hidden(bank, *texts)
    # Re-checked one by one, with the history before each, every decision comes out the same.
    code, reports = recheck_json(bank.config)
    assert sorted(e["result"] for r in reports for e in r["evaluations"]) == ["same"] * 16, reports
    assert code == 0


# ---------------------------------------------------------------- 6. no operator at hand


def test_with_no_operator_at_hand_what_would_wait_is_denied(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN], "limits": [{"calls": 1, "per": "1h"}]},
                     operator="none")
    host = bank.start()
    stranger = bank.call(host, {"to": "stranger", "amount": 5})
    assert stranger.prefix == "DENIED" and stranger.is_error, stranger
    assert "no operator is at hand" in stranger.text, stranger
    allowed = bank.call(host, {"to": "landlord", "amount": 5})
    assert allowed.text == "paid 5.00 to landlord", allowed
    # Past the limit (then require_approval by default) it would wait: denied too.
    limited = bank.call(host, {"to": "grocer", "amount": 5})
    assert limited.prefix == "DENIED", limited
    assert "a limit is reached" in limited.text and "no operator is at hand" in limited.text
    assert bank.approvals() == []
    assert bank.payments() == 1
    assert {r["status"] for r in bank.runs_json()} <= {"COMPLETED", "FAILED"}, bank.runs_json()
    assert_hidden(bank, stranger, allowed, limited)


# ---------------------------------------------------------------- 7. client


def test_a_client_entry_holds_only_for_the_host_it_names(bankdir):
    bank = make_bank(bankdir, {"when": [{"client": ["some-host"], "outcome": "allow"}]})
    argv = agentgate_argv("-config", str(bank.config))
    with Host(argv, name="some-host") as named:
        paid = bank.call(named, {"to": "bob", "amount": 1})
    assert paid.text == "paid 1.00 to bob", paid
    # Every other name asks (each a request of its own, so each is decided afresh).
    for amount, name in enumerate(("other-host", "Some-Host", "some-host "), 2):
        with Host(argv, name=name) as other:
            asked = bank.call(other, {"to": "bob", "amount": amount})
        assert asked.prefix == "PENDING_APPROVAL", (name, asked)
    plain = bank.start()  # the SDK's own name, "mcp"
    assert bank.call(plain, {"to": "bob", "amount": 9}).prefix == "PENDING_APPROVAL"
    assert bank.payments() == 1
    runs = bank.run_ids()
    assert policy_of(bank, runs[0])["by"] == "when[0]"
    assert policy_of(bank, runs[0])["facts"]["client"] == "some-host"
    assert policy_of(bank, runs[1])["facts"]["client"] == "other-host"
    assert_hidden(bank, paid)


# ---------------------------------------------------------------- 8. check


def test_check_prints_each_entry_and_limit_on_a_line(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN, BIG_DENIED], "limits": [
        {"calls": 2, "per": "1h", "then": "deny"},
        {"sum": "/amount", "max": "100.00", "per": "24h"}]})
    done = check(bank.config)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for wanted in (
            'when[0]: if /amount is at most 50.00 and /to is one of ["landlord","grocer"] -> '
            'allow (a small payment to a known payee)',
            "when[1]: if /amount is at least 1000 -> deny (payments of 1000 or more are made by "
            "hand)",
            "limits[0]: at most 2 calls to bank_pay per 1h0m0s, then deny",
            "limits[1]: a sum of /amount of at most 100.00 for bank_pay per 24h0m0s, then "
            "require_approval"):
        assert sum(wanted in line for line in lines) == 1, (wanted, done.stdout)
    assert "registered pay as bank_pay (remote_mutation)" in done.stdout


def test_check_refuses_a_tool_whose_policy_points_at_no_property(bankdir):
    bank = make_bank(bankdir, {"when": [{"if": {"/amout": {"max": 50}}, "outcome": "allow"}]})
    done = check(bank.config)
    assert "Traceback" not in done.stderr
    refused = [line for line in done.stdout.splitlines() if "refused pay" in line]
    assert len(refused) == 1, done.stdout
    for fragment in ("when[0]", "/amout", "/amount", "/to"):
        assert fragment in refused[0], refused[0]
    assert "registered pay" not in done.stdout
    # Serving: the tool is not offered, and the rest of the server is.
    with bank.start() as host:
        names = [t.name for t in host.list_tools()]
    assert "bank_pay" not in names and "bank_balance" in names, names
    # The same for a sum limit's pointer.
    rewrite(bank, {"outcome": "allow",
                   "limits": [{"sum": "/amout", "max": 50, "per": "1h"}]})
    done = check(bank.config)
    refused = [line for line in done.stdout.splitlines() if "refused pay" in line]
    assert len(refused) == 1 and "limits[0]" in refused[0] and "/amount" in refused[0], \
        done.stdout


def test_check_fails_on_a_policy_syntax_mistake_with_one_line(bankdir):
    bank = make_bank(bankdir, {"when": [SMALL_KNOWN]})
    rewrite(bank, {"when": [{"if": {"/amount": {"maximum": "50.00"}}, "outcome": "allow"}]})
    done = check(bank.config)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1, done.stderr
    assert "rules.pay.when[0]" in errors[0] and "maximum" in errors[0], errors[0]
    # A gate with this config does not serve.
    served = run_to_end(agentgate_argv("-config", str(bank.config)), None, None, DEADLINE)
    assert served.returncode == 1 and "rules.pay.when[0]" in served.stderr, served


# ---------------------------------------------------------------- 9. show and approve


def test_show_and_approve_name_the_entry_that_asked(bankdir):
    bank = make_bank(bankdir, {"outcome": "allow", "when": [
        {"if": {"/to": {"in": ["stranger"]}}, "outcome": "require_approval",
         "reason": "a payee we have never paid"}]})
    host = bank.start()
    args = {"to": "stranger", "amount": 7}
    waiting = bank.call(host, args)
    assert waiting.prefix == "PENDING_APPROVAL", waiting
    run_id, approval = bank.pending(waiting)

    shown = operator(bank.config, "show", run_id).stdout
    assert "when[0]" in shown and "a payee we have never paid" in shown, shown
    assert "require_approval (when[0])" in shown, shown
    assert policy_of(bank, run_id)["by"] == "when[0]"

    approved = bank.approve(run_id, approval).stdout
    assert "when[0]" in approved and "a payee we have never paid" in approved, approved
    assert approved.index("when[0]") < approved.index(f"approval {approval}: approved")
    assert bank.payments() == 0
    assert bank.call(host, args).text == "paid 7.00 to stranger"
    assert bank.payments() == 1
    assert_hidden(bank, waiting)


def test_show_names_the_limit_that_denied(bankdir):
    bank = make_bank(bankdir, {"outcome": "allow",
                               "limits": [{"calls": 1, "per": "1h", "then": "deny"}]})
    host = bank.start()
    assert bank.call(host, {"to": "a", "amount": 1}).text == "paid 1.00 to a"
    assert bank.call(host, {"to": "b", "amount": 1}).prefix == "DENIED"
    first, denied = bank.run_ids()
    policy = policy_of(bank, denied)
    assert policy["outcome"] == "deny" and policy["by"] == "limits[0]", policy
    assert policy["limit"] == "at most 1 call to bank_pay per 1h0m0s", policy
    assert policy_of(bank, first)["by"] == "rule outcome"
    assert "deny (limits[0])" in operator(bank.config, "show", denied).stdout


# ---------------------------------------------------------------- 10. recheck


def test_recheck_counts_the_history_before_each_decision(bankdir):
    limited = {"outcome": "allow", "limits": [{"calls": 2, "per": "1h", "then": "deny"}]}
    bank = make_bank(bankdir, limited)
    with bank.start() as host:
        assert bank.call(host, {"to": "a", "amount": 1}).text == "paid 1.00 to a"
        assert bank.call(host, {"to": "b", "amount": 1}).text == "paid 1.00 to b"
        assert bank.call(host, {"to": "c", "amount": 1}).prefix == "DENIED"
    first, second, third = bank.run_ids()
    assert {"at", "client"} <= set(policy_of(bank, third)["facts"]), policy_of(bank, third)

    code, reports = recheck_json(bank.config)
    results = {r["run_id"]: [(e["recorded"], e["rechecked"], e["result"])
                             for e in r["evaluations"]] for r in reports}
    assert results == {first: [("allow", "allow", "same")],
                       second: [("allow", "allow", "same")],
                       third: [("deny", "deny", "same")]}, reports
    assert code == 0

    rewrite(bank, {**limited, "limits": [{"calls": 10, "per": "1h", "then": "deny"}]})
    code, reports = recheck_json(bank.config)
    results = {r["run_id"]: [(e["recorded"], e["rechecked"], e["result"])
                             for e in r["evaluations"]] for r in reports}
    assert results == {first: [("allow", "allow", "same")],
                       second: [("allow", "allow", "same")],
                       third: [("deny", "allow", "different")]}, reports
    assert {r["identity"] for r in reports} == {"changed"}, reports
    assert code == 1


def test_recheck_reads_the_time_of_day_of_the_decision_not_now(bankdir):
    """A `during` entry allows payments in the four hours around now (UTC). Re-checked on a
    clock 12 hours on, the decision is still the same: the recorded time counts. A gate on
    that clock would have asked an operator, which shows the entry does depend on the time."""
    now, two_hours = datetime.datetime.now(datetime.timezone.utc), datetime.timedelta(hours=2)
    hours = f"{now - two_hours:%H:%M}-{now + two_hours:%H:%M}"  # may run past midnight
    bank = make_bank(bankdir, {"when": [{"during": {"hours": hours, "zone": "UTC"},
                                         "outcome": "allow", "reason": "office hours"}]})
    with bank.start() as host:
        paid = bank.call(host, {"to": "a", "amount": 1})
    assert paid.text == "paid 1.00 to a", paid
    (run_id,) = bank.run_ids()
    policy = policy_of(bank, run_id)
    assert policy["by"] == "when[0]"
    assert abs(stored_seconds(policy["facts"]["at"]) - time.time()) < DEADLINE

    code, reports = recheck_json(bank.config)
    assert code == 0 and [e["result"] for e in reports[0]["evaluations"]] == ["same"], reports

    later = run_to_end(shifted_argv("recheck", "-config", str(bank.config), "-json"), None, None,
                       DEADLINE)
    assert later.returncode == 0, (later.stdout, later.stderr)
    evaluation = json.loads(later.stdout)[0]["evaluations"][0]
    assert (evaluation["recorded"], evaluation["rechecked"], evaluation["result"]) == \
        ("allow", "allow", "same"), evaluation

    # The control: a gate on that clock asks an operator for the same kind of payment.
    with Host(shifted_argv("-config", str(bank.config))) as host:
        asked = result_text(host.call(PAY, {"to": "b", "amount": 1}))
    assert asked.startswith("PENDING_APPROVAL:"), asked
    assert bank.payments() == 1
