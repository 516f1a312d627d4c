"""The gate for one call: allowed, denied, invalid, pending, upstream errors, and what is recorded.

Each test runs agentgate with the SDK host in front of the fake payment server (hold 0s, so a
pending answer comes at once), the scripted server, or the npm reference servers.

Ported from the reference suite (agentrt-tests.md):
- proxy_test.go: TestProxy_AllowedReadReturnsContent, TestProxy_DeniedAndInvalidRunNothing,
  TestProxy_ApprovalRoundTrip (the first call only: PENDING, nothing paid, the operator line on
  stderr), TestProxy_UpstreamErrorAndStructuredResult (without the DUPLICATE repeat),
  TestProxy_RunsRecordWhatHappened (allowed, denied, invalid; the pending run up to
  approval.requested), TestProxy_ServerTextInProseIsEscaped (without the DUPLICATE repeats),
  TestProxy_HostCancelLetsTheCallFinish (without the DUPLICATE repeat).
- unknown_test.go TestUnknown_UnrecordedResultCountsAsExecuted (the first call only).
- tool_test.go: TestDeny_RemovedFromTheSchemaAndRefusedAtCall, TestFixed_RemovedFromTheSchemaAndInjectedAtCall,
  TestFixed_ACallThatSetsAFixedParameterFails, TestCall_StructuredAndTextResults,
  TestCall_IsErrorBecomesAnError, TestCall_InputRequiredIsRefused. Issue 20 departs from the
  reference on purpose: a result passes as the server sent it (no cap on what the model gets,
  no text instead of structured content), and the record keeps 64 KiB of its text.
- security_test.go TestCall_StructuredContentKeepsItsNumbers (stdio half).
- mcp/driver_test.go TestDriver_ApprovalNamesThePrefixedTool (the capability names the prefixed
  tool; approving and resuming belongs to later work).
Left for later work (approvals decided/collected, rules across calls, the status tool):
TestProxy_ApprovalRoundTrip's collection, TestProxy_RepeatWindowZeroAsksAgain,
TestProxy_ApprovedWithinTheHoldCompletesInOneCall, TestProxy_CanonicalMatching,
TestProxy_SeveralApprovalsAtOnceAndTheCap, TestProxy_RejectedIsNotAskedAgain,
TestProxy_ExpiredIsNotAskedAgain, TestProxy_StaleGrantExecutesNothing,
TestProxy_PolicyChangedToDenyBeforeCollection, TestProxy_ChangedFixedValueAsksAgain,
TestProxy_StatusToolReportsAndNeverExecutes,
TestProxy_StatusSaysWhetherAnApprovedRequestExecuted, TestProxy_ArgumentsTheRuntimeRefusesNeverCollect.
N/A since issue 20: TestCapText_NeverExceedsTheCap, TestCall_OversizedContentIsTruncated,
TestCall_CapCountsEncodedBytes, TestCall_OversizedStructuredContentFallsBackToText.
"""

import json

import pytest
from mcp.shared.exceptions import MCPError

from conftest import everything_server_argv, filesystem_server_argv, wait_for
from kit import (
    ROOT_SCHEMA,
    WRITE_SCHEMA,
    bank,
    check,
    event_types,
    gate_host,
    has_raw_controls,
    open_db,
    operator,
    payments,
    pin,
    result_text,
    rule,
    run_rows,
    scripted_server,
    steps,
    tool,
    write_config,
)

CAP = 65536
ALLOWED = ["run.created", "run.started", "step.started", "step.decided", "step.policy",
           "step.tool_started", "step.tool_finished", "run.finished"]
DENIED = ["run.created", "run.started", "step.started", "step.decided", "step.policy", "step.failed",
          "step.started", "step.decided", "run.finished"]
INVALID = ["run.created", "run.started", "step.started", "step.decided", "step.failed",
           "step.started", "step.decided", "run.finished"]
PENDING = ["run.created", "run.started", "step.started", "step.decided", "step.policy", "approval.requested"]
# An allowed read is recorded whole after it answers, in one event (issue 11).
READ = ["run.read"]


# ---------------------------------------------------------------- the fake payment server


def test_allowed_read_returns_content(workdir):
    config = bank(workdir)
    with gate_host(config) as host:
        result = host.call("bank_balance", {"account": "A-1"})
    assert not result.is_error
    assert result_text(result) == "account A-1 holds 120.00 EUR"
    db = open_db(workdir / "runs.db")
    try:
        (run,) = run_rows(db)
        assert run[1:3] == ("bank_balance", "COMPLETED")
    finally:
        db.close()


def test_denied_and_invalid_run_nothing(workdir):
    ledger = workdir / "ledger"
    config = bank(workdir, rules={"pay": {"outcome": "deny"}})
    with gate_host(config) as host:
        refund = host.call("bank_refund", {"payment": "p-1"})
        assert refund.is_error and result_text(refund).startswith("DENIED: ")

        pay = host.call("bank_pay", {"to": "bob", "amount": 5})
        assert pay.is_error and result_text(pay).startswith("DENIED: ")
        assert "operator's rule" in result_text(pay)

        misspelt = host.call("bank_balance", {"acount": "A-1"})
        assert misspelt.is_error and result_text(misspelt).startswith("INVALID: ")
        assert "account" in result_text(misspelt).removeprefix("INVALID: ").replace("acount", "")
    assert payments(ledger) == 0


def test_pending_approval_names_its_approval_and_runs_nothing(workdir):
    ledger = workdir / "ledger"
    config = bank(workdir)
    with gate_host(config) as host:
        result = host.call("bank_pay", {"to": "bob", "amount": 25})
        text = result_text(result)
        assert not result.is_error
        assert text.startswith("PENDING_APPROVAL: ")
        assert payments(ledger) == 0
        db = open_db(workdir / "runs.db")
        try:
            (run_id, tool_name, status, _, _), = run_rows(db)
            (approval_id, kind, capability), = db.execute(
                "SELECT id, kind, capability_json FROM approvals WHERE run_id=?", (run_id,)).fetchall()
            assert event_types(db, run_id) == PENDING
        finally:
            db.close()
        assert (tool_name, status, kind) == ("bank_pay", "WAITING_FOR_APPROVAL", "remote_mutation")
        assert json.loads(capability)["name"] == "bank_pay"
        assert approval_id in text
        # nothing the model sees names the run, the database, the config or the program
        for secret in (run_id, str(workdir), "runs.db", "agentgate"):
            assert secret not in text
        log = host.stderr_text()
    assert f"approve {run_id} -approval {approval_id}" in log


def kept_spec_name(db, spec_hash: str) -> str:
    (spec,) = db.execute("SELECT spec_json FROM tool_specs WHERE hash=?", (spec_hash,)).fetchone()
    return json.loads(spec)["name"]


def test_upstream_error_and_structured_result(workdir):
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    with gate_host(config) as host:
        failed = host.call("bank_pay", {"to": "jo", "amount": 1, "mode": "error"})
        assert failed.is_error
        assert "card declined for jo" in result_text(failed)

        structured = host.call("bank_pay", {"to": "jo", "amount": 2, "mode": "structured"})
        assert not structured.is_error
        assert structured.structured_content == {"paid": 2, "to": "jo"}
    assert payments(workdir / "ledger") == 2


def test_runs_record_what_happened(workdir):
    config = bank(workdir)
    with gate_host(config) as host:
        assert not host.call("bank_balance", {"account": "z"}).is_error
        assert host.call("bank_refund", {"payment": "p"}).is_error
        assert host.call("bank_balance", {}).is_error  # invalid: account is required
    db = open_db(workdir / "runs.db")
    try:
        recorded = run_rows(db)
        assert [(r[1], r[2]) for r in recorded] == [
            ("bank_balance", "COMPLETED"), ("bank_refund", "FAILED"), ("bank_balance", "FAILED")]
        assert all(r[0].startswith("test.") for r in recorded)
        allowed, denied, invalid = (r[0] for r in recorded)
        assert event_types(db, allowed) == READ
        (payload,) = [json.loads(row[0]) for row in db.execute(
            "SELECT payload_json FROM events WHERE run_id=?", (allowed,))]
        assert payload["decision"]["args"] == {"account": "z"} and payload["status"] == "COMPLETED"
        assert payload["policy"]["outcome"] == "allow" and payload["policy"]["policy_id"]
        assert kept_spec_name(db, payload["policy"]["spec_hash"]) == "bank_balance"
        # The event is the read's one step, whole: no step row, and no row in the calls index
        # (no later decision reads it).
        observation = payload["observation"]
        assert observation["kind"] == "tool_result"
        assert observation["result"]["blocks"] == [{"type": "text", "text": "account z holds 120.00 EUR"}]
        assert observation["summary"] and len(observation["result"]["sha256"]) == 64
        assert steps(db, allowed) == []
        assert db.execute("SELECT count(*) FROM calls WHERE run_id=?", (allowed,)).fetchone()[0] == 0
        assert event_types(db, denied) == DENIED
        assert event_types(db, invalid) == INVALID
        for run_id, kind in ((denied, "policy_denied"), (invalid, "invalid_decision")):
            (i0, s0, d0, o0), (i1, s1, d1, o1) = steps(db, run_id)
            assert (i0, s0, d0["origin"], d0["kind"], o0["kind"]) == (0, "failed", "model", "tool_call", kind)
            assert (i1, s1, d1["origin"], d1["kind"]) == (1, "done", "operator", "fail")
        assert (payload["decision"]["origin"], payload["decision"]["kind"]) == ("model", "tool_call")
    finally:
        db.close()


def test_show_and_runs_read_an_allowed_reads_step_out_of_its_one_event(workdir):
    config = bank(workdir)
    with gate_host(config) as host:
        assert not host.call("bank_balance", {"account": "z"}).is_error
    db = open_db(workdir / "runs.db")
    try:
        ((run_id, *_),) = run_rows(db)
    finally:
        db.close()
    shown = operator(config, "show", run_id).stdout
    (step_line,) = [line for line in shown.splitlines() if line.startswith("0 ")]
    assert step_line.split()[:5] == ["0", "tool_call", "(model)", "done", "allow"], shown
    assert "tool_result: bank/balance: " in step_line
    assert "status    COMPLETED (goal_completed)" in shown and "steps     1" in shown
    (step,) = json.loads(operator(config, "show", run_id, "-json").stdout)["steps"]
    assert (step["index"], step["status"], step["decision"]["args"]) == (0, "done", {"account": "z"})
    assert step["observation"]["result"]["blocks"] == [{"type": "text", "text": "account z holds 120.00 EUR"}]
    assert step["policy"]["outcome"] == "allow" and "policy_id" not in step["policy"]
    assert run_id in operator(config, "runs").stdout


def test_an_answer_too_deep_to_record_is_unrecorded_not_failed(workdir):
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    with gate_host(config) as host:
        result = host.call("bank_pay", {"to": "ria", "amount": 4, "mode": "deep"})
    text = result_text(result)
    assert not result.is_error
    assert text.startswith("UNRECORDED: ")
    assert "so it executed" in text and "could not be recorded" in text
    assert "failed" not in text
    assert payments(workdir / "ledger") == 1


def test_server_text_in_prose_is_escaped_but_results_are_data(workdir):
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    to = "x\x1b[2J\u202e"
    with gate_host(config) as host:
        failed = host.call("bank_pay", {"to": to, "amount": 1, "mode": "error"})
        assert failed.is_error  # a server's error result is data too: as the server wrote it
        assert result_text(failed) == f"card declined for {to}"

        paid = host.call("bank_pay", {"to": to, "amount": 2})
        assert not paid.is_error
        assert result_text(paid) == f"paid 2.00 to {to}"  # the server's answer, as it sent it

        invalid = host.call("bank_balance", {"acc\x1b[2Jount\u202e": "x"})
        assert invalid.is_error and result_text(invalid).startswith("INVALID: ")
        assert not has_raw_controls(result_text(invalid)), repr(result_text(invalid))
        assert not has_raw_controls(host.stderr_text())


def test_a_host_that_gives_up_does_not_stop_the_call(workdir):
    ledger = workdir / "ledger"
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    with gate_host(config) as host:
        # The host gives up once the payment is in the server (a call cancelled before it is
        # sent is not sent): it blocks there until released.
        pending = host.submit("bank_pay", {"to": "kim", "amount": 7, "mode": "block"}, timeout=3)
        wait_for(lambda: payments(ledger) == 1, 60, message="the payment to reach the server")
        with pytest.raises(MCPError):
            pending.result()
        (workdir / "ledger.release").touch()
        db = open_db(workdir / "runs.db")
        try:
            wait_for(lambda: [r[2] for r in run_rows(db)] == ["COMPLETED"], 60, message="the run to complete")
            (run,) = run_rows(db)
            assert event_types(db, run[0]) == ALLOWED
        finally:
            db.close()
        assert payments(ledger) == 1
        assert host.call_text("bank_balance", {"account": "k"}) == "account k holds 120.00 EUR"


# ---------------------------------------------------------------- the scripted server


def test_denied_and_fixed_parameters(workdir):
    spec = {"tools": [tool("write_file", WRITE_SCHEMA), tool("rooted", ROOT_SCHEMA)],
            "calls": {"write_file": {"echo": True}, "rooted": {"echo": True}}}
    rules = {"write_file": rule("local_mutation", deny=["force"]),
             "rooted": rule("read_only", fixed={"root": "/srv/sandbox"})}
    config = write_config(workdir, [scripted_server(workdir, spec, rules=rules)])
    pin(config)
    with gate_host(config) as host:
        tools = {t.name: t.input_schema for t in host.list_tools()}
        assert "force" not in tools["fs_write_file"]["properties"]
        assert "root" not in json.dumps(tools["fs_rooted"])
        assert tools["fs_rooted"]["required"] == ["path"]

        assert json.loads(host.call_text("fs_write_file", {"path": "a", "text": "hi"})) == {"path": "a", "text": "hi"}
        denied = host.call("fs_write_file", {"path": "a", "text": "hi", "force": True})
        assert denied.is_error and result_text(denied).startswith("INVALID: ")
        assert '"force" is denied' in result_text(denied)

        received = json.loads(host.call_text("fs_rooted", {"path": "a"}))
        assert received == {"path": "a", "root": "/srv/sandbox"}
        fixed = host.call("fs_rooted", {"path": "p", "root": "/etc"})
        assert fixed.is_error and result_text(fixed).startswith("INVALID: ")
        assert '"root" is fixed' in result_text(fixed)


def test_results_pass_whole_and_the_record_keeps_their_text_up_to_64_kib(workdir):
    """Issue 20 changed this test: results used to be mapped (an image to "[image omitted]",
    structured content instead of the text, text cut at 64 KiB); now every result passes as
    the server sent it, and only the record keeps at most 64 KiB of its text."""
    image = {"type": "image", "data": "aGk=", "mimeType": "image/png"}
    calls = {
        "structured": {"result": {"content": [{"type": "text", "text": "two"}],
                                  "structuredContent": {"lines": 2, "ok": True}}},
        "mixed": {"result": {"content": [{"type": "text", "text": "first"}, image,
                                         {"type": "text", "text": "last"}]}},
        "failing": {"error": "no such file"},
        "long": {"text": "x" * 70000},
        "wide": {"text": "世" * 30000},
        "alone": {"result": {"content": [], "structuredContent": {"k": "x" * 70000}}},
        "asks": {"result": {"resultType": "input_required",
                            "inputRequests": {"q": {"method": "elicitation/create",
                                                    "params": {"message": "which file?"}}}}},
        "numbers": {"raw_result": '{"content":[{"type":"text","text":"n"}],"structuredContent":'
                                  '{"id":123456789012345678901234567890,"n":9007199254740993,"f":0.1,"s":"<b>"}}'},
    }
    spec = {"tools": [tool(name) for name in calls], "calls": calls}
    config = write_config(workdir, [scripted_server(workdir, spec, rules={name: rule("read_only") for name in calls})])
    pin(config)
    with gate_host(config) as host:
        def call(name):
            result = host.call(f"fs_{name}", {})
            return result, result_text(result)

        result, text = call("structured")
        assert not result.is_error and result.structured_content == {"lines": 2, "ok": True}
        assert text == "two"

        result, text = call("mixed")
        assert [b.type for b in result.content] == ["text", "image", "text"]
        assert (result.content[1].data, result.content[1].mime_type) == ("aGk=", "image/png")
        assert text == "first\nlast"

        result, text = call("failing")
        assert result.is_error and text == "no such file"

        for name, whole in (("long", "x" * 70000), ("wide", "世" * 30000)):
            result, text = call(name)
            assert not result.is_error and text == whole, name

        result, text = call("alone")
        assert result.content == [] and result.structured_content == {"k": "x" * 70000}

        result, text = call("asks")
        assert result.is_error and "asked for more input" in text

        result, text = call("numbers")
        assert text == "n"
        assert result.structured_content == {"id": 123456789012345678901234567890, "n": 9007199254740993,
                                             "f": 0.1, "s": "<b>"}

    db = open_db(workdir / "runs.db")
    try:
        observations = {}
        for (payload,) in db.execute("SELECT payload_json FROM events WHERE type='run.read'"):
            observation = json.loads(payload)["observation"]
            observations[observation["summary"].split(":")[0]] = observation
        assert observations["fs/structured"]["result"]["structured"]["value"] == {"lines": 2, "ok": True}
        assert observations["fs/structured"]["summary"].endswith("1 block, structured content")
        long = observations["fs/long"]["result"]["blocks"][0]
        assert long["text"] == "x" * CAP and long["bytes"] == 70000
        wide = observations["fs/wide"]["result"]["blocks"][0]
        assert wide["text"] == "世" * (CAP // 3) and wide["bytes"] == 90000  # whole characters only
        alone = observations["fs/alone"]["result"]["structured"]
        assert "value" not in alone and alone["bytes"] == len('{"k":""}') + 70000
        assert observations["fs/failing"]["result"]["is_error"]
    finally:
        db.close()


# ---------------------------------------------------------------- the npm reference servers


def test_filesystem_server_read_and_write(workdir, tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "note.txt").write_text("hello through the gate\n")
    big = "abcdefghij" * 10000
    (files / "big.txt").write_text(big)
    rules = {"read_file": rule("read_only"),
             "write_file": rule("local_mutation", allow_hint_mismatch=True)}
    server = {"name": "fs", "command": filesystem_server_argv(files), "manifest": "fs.manifest.json", "rules": rules}
    config = write_config(workdir, [server])
    pin(config)
    with gate_host(config) as host:
        # this server answers with structuredContent beside its text, and both pass
        note = host.call("fs_read_file", {"path": str(files / "note.txt")})
        assert not note.is_error
        assert note.structured_content == {"content": "hello through the gate\n"}
        assert result_text(note) == "hello through the gate\n"

        result = host.call("fs_read_file", {"path": str(files / "big.txt")})
        assert not result.is_error  # whole, past the 64 KiB the record keeps of it
        assert result_text(result) == big and result.structured_content == {"content": big}

        written = host.call("fs_write_file", {"path": str(files / "out.txt"), "content": "written by the gate"})
        assert not written.is_error, result_text(written)
        assert (files / "out.txt").read_text() == "written by the gate"
    # The mismatch the rule allows is check's to list (a gate's start says what it serves in one line).
    assert "registered write_file as fs_write_file (local_mutation) [hint mismatch allowed: classified " \
           "local_mutation, but the server claims destructiveHint]" in check(config).stdout


def test_everything_server_echo(workdir):
    server = {"name": "every", "command": everything_server_argv(), "manifest": "every.manifest.json",
              "rules": {"echo": rule("read_only")}}
    config = write_config(workdir, [server])
    pin(config)
    with gate_host(config) as host:
        names = [t.name for t in host.list_tools()]
        assert names == ["every_echo", "gate_status"]
        result = host.call("every_echo", {"message": "hi there"})
        assert not result.is_error
        assert result_text(result) == "Echo: hi there"
