"""A hostile or careless host: frames a well-behaved SDK never writes, and more requests at
once than the gate will hold.

Driven over raw pipes with every stdout line parsed as strict JSON (RFC 8259: no NaN or
Infinity, no unpaired surrogate in a string), as a strict host parser would read it.
Covers:
- an id that JSON has no value for (Infinity, NaN, -Infinity) is answered with "id": null in
  strict JSON, and the session goes on;
- an id holding an unpaired surrogate escape is answered with "id": null (a ping, and a
  tools/call, which begins no run), the session goes on and still ends when stdin closes;
- a batch with members that are not requests answers every member, in one line;
- the gate holds a bounded number of requests at once: past the bound a request is refused
  at once as busy, and the threads stay bounded; those held all get one answer each once an
  operator approves, and the payment is made once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import RawStdio, agentgate_argv, pid_alive, wait_for
from kit import agentgate, approvals, bank, open_db, payments, response_text

DEADLINE = 60.0  # seconds; generous for a loaded 2-core machine
BALANCE_A = {"name": "bank_balance", "arguments": {"account": "a"}}


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_strings(value) -> None:
    """Every string (and key) encodes as UTF-8: no unpaired surrogate escape."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)


def strict_loads(line: bytes):
    """Parse one stdout line as strict JSON, or fail the test naming the line."""
    try:
        text = line.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
        _check_strings(value)
    except (UnicodeError, ValueError) as err:
        raise AssertionError(f"not strict JSON on stdout ({err}): {line!r}") from None
    return value


class StrictRaw(RawStdio):
    """RawStdio whose every received line must be strict JSON."""

    def recv(self, timeout: float = 30):
        try:
            line = self._lines.get(timeout=max(timeout, 0))
        except Exception:
            raise TimeoutError(f"no stdout line within {timeout:.1f}s; stderr:\n"
                               f"{self.stderr_text()[-2000:]}") from None
        if line is None:
            self._lines.put(None)
            raise EOFError("server closed stdout")
        return strict_loads(line)


def gate(config) -> StrictRaw:
    return StrictRaw(agentgate_argv("-config", str(config)))


def serving(config, protocol: str = "2025-11-25") -> StrictRaw:
    """A gate initialized at `protocol` whose tools are loaded."""
    raw = gate(config)
    raw.initialize(protocol)
    listed = raw.request("tools/list", {}, timeout=DEADLINE * 2)
    assert "result" in listed, f"tools/list failed: {listed}\n{raw.stderr_text()}"
    return raw


def is_null_id_error(message, code: int | None = None) -> bool:
    return (isinstance(message, dict) and message.get("jsonrpc") == "2.0" and "id" in message
            and message["id"] is None and "result" not in message
            and isinstance(message.get("error"), dict)
            and isinstance(message["error"].get("code"), int)
            and isinstance(message["error"].get("message"), str)
            and (code is None or message["error"]["code"] == code))


def run_count(workdir) -> int:
    db = open_db(Path(workdir) / "runs.db")
    try:
        return db.execute("SELECT count(*) FROM runs").fetchone()[0]
    finally:
        db.close()


# ---------------------------------------------------------------- ids JSON cannot carry


@pytest.mark.parametrize("literal", ["Infinity", "NaN", "-Infinity"])
def test_a_non_finite_id_is_answered_with_a_null_id_in_strict_json(workdir, literal):
    config = bank(workdir)
    with gate(config) as raw:
        raw.initialize()
        raw.send(b'{"jsonrpc":"2.0","id":%s,"method":"ping"}' % literal.encode())
        reply = raw.recv(30)
        assert is_null_id_error(reply), reply
        assert raw.request("ping", id=5, timeout=30) == {"jsonrpc": "2.0", "id": 5, "result": {}}
        assert raw.skipped == []  # exactly one line answered the bad frame


def test_an_unpaired_surrogate_id_is_answered_with_a_null_id_and_the_session_goes_on(workdir):
    config = bank(workdir)
    with gate(config) as raw:
        raw.initialize()
        raw.send(b'{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}')
        reply = raw.recv(30)
        assert is_null_id_error(reply), reply
        assert raw.request("ping", id=5, timeout=30) == {"jsonrpc": "2.0", "id": 5, "result": {}}
        assert raw.skipped == []
        raw.proc.stdin.close()
        assert raw.wait(30) == 0, raw.stderr_text()[-2000:]
        assert "Traceback" not in raw.stderr_text()


def test_a_tools_call_with_an_unpaired_surrogate_id_is_refused_and_begins_no_run(workdir):
    config = bank(workdir)
    with serving(config) as raw:
        assert run_count(workdir) == 0
        frame = {"jsonrpc": "2.0", "id": "\ud800", "method": "tools/call", "params": BALANCE_A}
        raw.send(json.dumps(frame).encode())  # json.dumps writes the id as the escape \ud800
        reply = raw.recv(DEADLINE)
        assert is_null_id_error(reply, -32600), reply
        assert raw.request("ping", id=5, timeout=30) == {"jsonrpc": "2.0", "id": 5, "result": {}}
        assert raw.skipped == []
        assert run_count(workdir) == 0
        # the session still calls tools
        done = raw.request("tools/call", BALANCE_A, id=6, timeout=DEADLINE)
        assert response_text(done) == "account a holds 120.00 EUR"
        assert "Traceback" not in raw.stderr_text()


# ---------------------------------------------------------------- batches


def test_a_batch_with_members_that_are_not_requests_answers_every_member_in_one_line(workdir):
    config = bank(workdir)
    with serving(config, "2025-03-26") as raw:
        raw.send(b'[1, {"jsonrpc":"2.0","id":7,"method":"ping"}, null, [], "x"]')
        reply = raw.recv(DEADLINE)
        assert isinstance(reply, list) and len(reply) == 5, reply
        invalid = [m for m in reply if is_null_id_error(m, -32600)]
        answered = [m for m in reply if m not in invalid]
        assert len(invalid) == 4, reply
        assert answered == [{"jsonrpc": "2.0", "id": 7, "result": {}}], reply

        raw.send(json.dumps([{"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": BALANCE_A},
                             2]).encode())
        reply = raw.recv(DEADLINE)
        assert isinstance(reply, list) and len(reply) == 2, reply
        invalid = [m for m in reply if is_null_id_error(m, -32600)]
        called = [m for m in reply if m.get("id") == 8]
        assert len(invalid) == 1 and len(called) == 1, reply
        assert response_text(called[0]) == "account a holds 120.00 EUR"

        assert raw.request("ping", id=9, timeout=30)["result"] == {}
        assert raw.skipped == []  # one line for each batch, nothing else
        assert "Traceback" not in raw.stderr_text()


# ---------------------------------------------------------------- bounded concurrency


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads: line for pid {pid}")


def test_past_the_bound_identical_calls_are_refused_as_busy_and_the_held_ones_all_get_one_answer(workdir):
    total, bound = 100, 64
    config = bank(workdir, hold="60s")  # pay is remote_mutation: it waits for an approval
    pay = {"name": "bank_pay", "arguments": {"to": "x", "amount": 1}}
    with serving(config) as raw:
        baseline = threads_of(raw.pid)
        frames = b"".join(json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                      "params": pay}).encode() + b"\n" for i in range(1, total + 1))
        raw.send(frames, newline=False)

        answers: dict[int, list] = {}
        most_threads = [baseline]

        def take(timeout: float) -> None:
            message = raw.recv(timeout)
            assert isinstance(message, dict) and "method" not in message, message
            answers.setdefault(message["id"], []).append(message)

        def busy() -> list[int]:
            return [i for i, got in answers.items()
                    if "error" in got[0] and "busy" in got[0]["error"]["message"]]

        # The ones past the bound are answered at once; the rest wait for the operator.
        deadline = time.monotonic() + DEADLINE
        while len(busy()) < total - bound:
            most_threads.append(threads_of(raw.pid))
            take(deadline - time.monotonic())
        for i in busy():
            assert answers[i][0]["error"]["code"] == -32000, answers[i]

        def pending():
            most_threads.append(threads_of(raw.pid))
            return run_count(workdir) and approvals(workdir, "pending")
        (approval,) = wait_for(pending, DEADLINE, message="the pending approval")
        # Held: no answer but busy ones yet, and the thread count stayed bounded meanwhile.
        most_threads.append(threads_of(raw.pid))
        assert all(len(got) == 1 and "busy" in got[0].get("error", {}).get("message", "")
                   for got in answers.values()), answers
        held = total - len(answers)
        assert 0 < held <= bound, f"{held} held"
        assert max(most_threads) <= 100, f"the gate ran {max(most_threads)} threads"

        done = agentgate("approve", approval["run_id"], "-approval", approval["id"], "-config", str(config))
        assert done.returncode == 0, f"approve exited {done.returncode}:\n{done.stdout}\n{done.stderr}"

        deadline = time.monotonic() + DEADLINE * 2
        while len(answers) < total:
            take(deadline - time.monotonic())
        assert raw.request("ping", id="after", timeout=30)["result"] == {}
        for message in raw.skipped:
            answers.setdefault(message["id"], []).append(message)
        assert sorted(answers) == list(range(1, total + 1))
        assert all(len(got) == 1 for got in answers.values()), {i: g for i, g in answers.items() if len(g) > 1}
        held_answers = [got[0] for i, got in answers.items() if i not in busy()]
        assert len(held_answers) == held
        assert all("result" in m for m in held_answers), [m for m in held_answers if "result" not in m]
        texts = [response_text(m) for m in held_answers]
        assert texts.count("paid 1.00 to x") == 1, texts
        assert all(t == "paid 1.00 to x" or t.startswith(("DUPLICATE:", "IN_PROGRESS:", "PENDING_APPROVAL:"))
                   for t in texts), texts
    assert payments(Path(workdir) / "ledger") == 1
    assert not pid_alive(raw.pid)
