"""Nothing the model sees names how to approve: no database path, config path, program name,
operator command or run id, in any answer, tool description or server identity.

Ported from proxy_test.go TestProxy_ModelVisibleTextNamesNoOperatorPath. The test drives the
paths it can reach through the SDK host on its own (so it means something when run alone),
then scans those answers together with every answer the other approval tests collected through
kit (SEEN) against the paths and run ids of every scenario those tests made (BANKS). It sits
in the last of the approval files so that, in a whole run, it sees all of them.
"""

import json
import re

from kit import BANKS, SEEN, Bank

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\.[0-9a-f]{16}(?![0-9a-f])")
COMMAND_WORDS = re.compile(r"(approve|reject|cancel)\s+\S+\.[0-9a-f]{16}|-approval\b|-config\b|decide with",
                           re.I)


def problems(text: str, forbidden: set[str]) -> list[str]:
    found = []
    if "agentgate" in text.lower():
        found.append("names the program")
    for needle in ("runs.db", "agentgate.json", "python3"):
        if needle in text:
            found.append(f"contains {needle!r}")
    found += [f"contains {s!r}" for s in forbidden if s and s in text]
    found += [f"names run id {m.group(0)!r}" for m in RUN_ID.finditer(text)]
    found += [f"names an operator command: {m.group(0)!r}" for m in COMMAND_WORDS.finditer(text)]
    return found


def test_model_visible_text_names_no_operator_path(workdir):
    bank = Bank(workdir, max_pending=2, rules={"pay": {"timeout": "1s"}})
    host = bank.start()
    start = len(SEEN)

    assert not bank.call(host, {"account": "z"}, tool="bank_balance").is_error          # allowed
    assert bank.call(host, {"acount": "z"}, tool="bank_balance").prefix == "INVALID"     # invalid
    assert bank.call(host, {"payment": "p"}, tool="bank_refund").prefix == "DENIED"      # denied
    run_a, a = bank.pending(bank.call(host, {"to": "a", "amount": 1}))                  # pending
    assert bank.call(host, {"to": "a", "amount": 1}).approval_id() == a                 # pending again
    run_b, b = bank.pending(bank.call(host, {"to": "b", "amount": 2}))
    assert bank.call(host, {"to": "c", "amount": 3}).prefix == "BLOCKED"                # the cap
    assert "2 requests" in bank.call(host, {}, tool="gate_status").text                 # status
    bank.call(host, {"approval_id": a}, tool="gate_status")
    bank.approve(run_a, a)
    bank.reject(run_b, "no, not b")
    assert bank.call(host, {"to": "a", "amount": 1}).text == "paid 1.00 to a"           # collect
    assert bank.call(host, {"approval_id": a}, tool="gate_status").prefix == "GATE_STATUS"
    assert bank.call(host, {"to": "a", "amount": 1}).prefix == "DUPLICATE"              # duplicate
    assert bank.call(host, {"to": "b", "amount": 2}).prefix == "REJECTED"               # rejected
    bank.call(host, {"approval_id": b}, tool="gate_status")
    assert bank.call(host, {"approval_id": "nope"}, tool="gate_status").prefix == "GATE_STATUS"
    assert bank.call(host, {"run": run_a}, tool="gate_status").prefix == "INVALID"      # unknown field

    run_d, d = bank.pending(bank.call(host, {"to": "d", "amount": 4}))
    bank.cancel(run_d, "not d")
    assert bank.call(host, {"to": "d", "amount": 4}).prefix == "REJECTED"               # cancelled
    bank.call(host, {"approval_id": d}, tool="gate_status")

    stuck = {"to": "e", "amount": 5, "mode": "block"}
    run_e, e = bank.pending(bank.call(host, stuck))
    bank.approve(run_e, e)
    assert bank.call(host, stuck).prefix == "UNKNOWN_OUTCOME"                           # timed out
    assert bank.call(host, stuck).prefix == "UNKNOWN_OUTCOME"                           # still unknown
    assert bank.call(host, {"to": "f", "amount": 6}).prefix == "BLOCKED"                # tool blocked
    waiting = bank.call(host, {}, tool="gate_status").text
    assert "OUTCOME UNKNOWN" in waiting, waiting
    fate = bank.call(host, {"approval_id": e}, tool="gate_status").text
    assert "APPROVED and executed, but it timed out" in fate, fate
    assert len(SEEN) - start >= 15
    assert bank.payments() == 2  # a, and e's attempt, whose outcome the gate cannot know

    # what the host is told about the server and its tools
    SEEN.append(("serverInfo", json.dumps(host.client.server_info.model_dump(mode="json"))))
    for tool in host.list_tools():
        SEEN.append((f"tools/list {tool.name}", json.dumps({"name": tool.name, "description": tool.description,
                                                             "inputSchema": tool.input_schema})))
    forbidden = set().union(*(b.forbidden() for b in BANKS))
    assert {run_a, run_e, str(bank.db_path), str(bank.config)} <= forbidden

    bad = {f"{where}: {text[:200]!r}": problems(text, forbidden) for where, text in SEEN
           if problems(text, forbidden)}
    assert not bad, "model-visible text names the operator's path:\n" + "\n".join(f"{k} -> {v}" for k, v in bad.items())
