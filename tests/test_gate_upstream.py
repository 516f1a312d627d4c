"""agentgate as an MCP client: the upstream server as a child process, and what it may get wrong.

The upstream is tests/scripted_server.py (or the fake payment server); agentgate is driven
through `pin`, `check` or a served session with the SDK host.

Ported from the reference suite (agentrt-tests.md):
- transport_test.go: TestStdio_ServerGetsOnlyTheEnvironmentItIsGiven (with TestChildEnv_IsMinimalAndExplicit's
  linux case end to end), TestServer_RejectsMalformedEnv, TestStdio_StderrTailIsInAFailedConnect,
  TestStdio_StderrTailIsInAFailedListing.
- connect_timeout_test.go: TestServer_ConnectTimeoutBoundsAnInitializeThatNeverAnswers,
  TestServer_ConnectTimeoutBoundsAListingThatNeverAnswers, TestServer_ConnectTimeoutDoesNotShortenTheSession.
- listing_test.go: TestPin_ToolListedTwiceFails, TestPin_ListingIsBounded (+ pagination followed to
  the end, an empty-string cursor being a valid cursor).
- security_test.go: TestPin_ErrorEscapesTheServersMessage, TestPin_RawListingMatchesKeysExactly.
- call_robustness_test.go: TestCall_DeadSessionFailsFastNamingTheServer,
  TestCall_ReturnsWhenTheRuleTimeoutPassesEvenIfTheServerNeverAnswers,
  TestConnection_CloseIsSafeTwiceAndConcurrentWithACall (as: the host closes stdin while a call is
  in flight; the call finishes, is recorded, and agentgate exits 0).
- proc_unix_test.go: TestStdio_CloseKillsTheServersDescendants.
- tool_test.go: TestCall_TimeoutIsHonoured (with the never-answering server).
Beyond the reference (the promises of agentgate's "Upstream servers"): requests the server sends are answered
(ping with a result, roots/sampling/elicitation with an error), garbage on the server's stdout is
ignored, an answer larger than the cap or not usable JSON fails only that call.
N/A:
- transport_test.go TestLimitedTransport_*, TestHTTPClient_*, TestPin_OverStreamableHTTPReadsTheRawSchema,
  TestPin_OversizedHTTPResponseFails, TestMessageTap_*; security_test.go TestHTTP_RedirectIsNotFollowed,
  TestMessageTap_SkipsEventsTheSDKIgnores: HTTP upstreams, ported (or marked N/A with the reason)
  in test_http_upstream.py.
- transport_test.go TestStdio_StderrTailIsInAFailedConnect's "operator supplies its own stderr
  writer" half and TestChildEnv_* on darwin/windows: a Go API option and other platforms.
- connect_timeout_test.go TestPhaseErr_NamesTheStepOnlyWhenItsOwnDeadlineFired: a Go-internal
  helper distinguishing a caller's cancellation; agentgate has no caller cancellation at load.
"""

import json
import os
import signal
import sys
import time

import pytest

from conftest import RawStdio, agentgate_argv, pid_alive, wait_for
from kit import (
    agentgate,
    bank,
    check,
    event_types,
    gate_host,
    has_raw_controls,
    open_db,
    payments,
    pin,
    read_manifest,
    read_pid,
    reap,
    records,
    result_text,
    rule,
    run_rows,
    scripted_server,
    tool,
    write_config,
    write_spec,
)


def fs_config(workdir, spec, rules=None, **fields):
    return write_config(workdir, [scripted_server(workdir, spec, rules=rules, **fields)])


def pin_fails(config):
    done = agentgate("pin", "-config", str(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


# ---------------------------------------------------------------- the child's environment


def test_server_gets_only_the_environment_it_is_given(workdir, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    spec = {"tools": [tool("env")], "calls": {"env": {"env": True}}}
    config = fs_config(workdir, spec, rules={"env": rule("read_only")},
                       inherit_env=["AG_TEST_PASSED", "AG_TEST_UNSET"],
                       env=["AG_TEST_EXPLICIT=k", "HOME=/nonexistent/op", "EMPTY="])
    host_env = {"TMPDIR": str(tmpdir), "AG_TEST_SECRET": "s3cret", "AG_TEST_PASSED": "yes", "LANG": "C"}
    pin(config, env=host_env)
    with gate_host(config, env=host_env) as host:
        result = host.call("fs_env", {})
        assert not result.is_error, result_text(result)
        environ = result_text(result).split("\n")
    assert environ == [f"PATH={os.environ['PATH']}", "HOME=/nonexistent/op", f"TMPDIR={tmpdir}",
                       "AG_TEST_PASSED=yes", "AG_TEST_EXPLICIT=k", "EMPTY="]
    assert not any("s3cret" in entry for entry in environ)


@pytest.mark.parametrize("field, entry", [("env", "NOEQUALS"), ("env", "=v"), ("inherit_env", "A=B"),
                                          ("inherit_env", "")])
def test_a_malformed_environment_entry_is_refused(workdir, field, entry):
    config = fs_config(workdir, {"tools": [tool("a")]}, rules={"a": rule("read_only")}, **{field: [entry]})
    done = check(config)
    assert done.returncode == 1
    assert field in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------- failing to connect or list


def test_stderr_tail_is_in_a_failed_connect(workdir):
    config = write_config(workdir, [{"name": "fs", "command": ["sh", "-c", "echo oops: missing config >&2; exit 1"],
                                     "manifest": "fs.manifest.json"}])
    err = pin_fails(config)
    assert '"fs"' in err and "connect" in err
    assert "oops: missing config" in err


def test_the_stderr_tail_is_bounded(workdir):
    noisy = [sys.executable, "-c", "import sys; sys.stderr.write('x' * 20000 + '\\nthe end\\n'); sys.exit(1)"]
    config = write_config(workdir, [{"name": "fs", "command": noisy, "manifest": "fs.manifest.json"}])
    err = pin_fails(config)
    assert "the end" in err
    assert len(err) <= 4096 + 500, len(err)


def test_stderr_tail_is_in_a_failed_listing(workdir):
    config = fs_config(workdir, {"list": "die", "list_stderr": "listing refused: no licence\n"})
    err = pin_fails(config)
    assert '"fs"' in err and "list tools" in err
    assert "listing refused: no licence" in err


def test_connect_timeout_bounds_an_initialize_that_never_answers(workdir):
    config = fs_config(workdir, {"initialize": "never"}, connect_timeout="300ms")
    started = time.monotonic()
    err = pin_fails(config)
    assert '"fs"' in err and "connect" in err and "timed out after 300ms" in err
    assert time.monotonic() - started < 60


def test_connect_timeout_bounds_a_listing_that_never_answers(workdir):
    # 3s leaves the initialize room on a loaded machine; the listing never answers at all.
    config = fs_config(workdir, {"list": "never"}, connect_timeout="3s")
    err = pin_fails(config)
    assert '"fs"' in err and "list tools" in err and "timed out after 3s" in err

    config = fs_config(workdir, {"tools": [tool("a")]}, rules={"a": rule("read_only")}, connect_timeout="3s")
    pin(config)
    write_spec(workdir / "fs.spec.json", {"list": "never"})
    done = check(config)
    assert done.returncode == 1
    assert "list tools" in done.stderr and "timed out after 3s" in done.stderr
    assert "fs:" not in done.stdout  # no report: the server could not be loaded


def test_connect_timeout_does_not_shorten_the_session(workdir):
    spec = {"tools": [tool("slow")], "calls": {"slow": {"text": "contents", "delay": 1.0}}}
    config = fs_config(workdir, spec, rules={"slow": rule("read_only", "30s")}, connect_timeout="300ms")
    pin(config)
    with gate_host(config) as host:
        started = time.monotonic()
        assert host.call_text("fs_slow", {}) == "contents"
        assert time.monotonic() - started >= 0.9  # the answer came after the connect deadline


# ---------------------------------------------------------------- listing


def test_pagination_is_followed_to_the_end(workdir):
    record = workdir / "record.jsonl"
    pages = [{"tools": [tool("a")], "nextCursor": ""},
             {"tools": [tool("b")], "nextCursor": "2"},
             {"tools": [tool("c")]}]
    config = fs_config(workdir, {"pages": pages, "record": str(record)})
    pin(config)
    assert sorted(read_manifest(workdir / "fs.manifest.json")["tools"]) == ["a", "b", "c"]
    assert [entry["list"] for entry in records(record)] == [{}, {"cursor": ""}, {"cursor": "2"}]


def test_a_repeating_cursor_is_refused(workdir):
    pages = [{"tools": [tool("a")], "nextCursor": "same"}, {"tools": [tool("b")], "nextCursor": "same"}]
    err = pin_fails(fs_config(workdir, {"pages": pages}))
    assert '"fs"' in err and "list tools" in err and "repeats" in err
    assert not (workdir / "fs.manifest.json").exists()


def test_a_tool_listed_twice_is_refused(workdir):
    err = pin_fails(fs_config(workdir, {"tools": [tool("a"), tool("a")]}))
    assert '"a" twice' in err

    pages = [{"tools": [tool("a")], "nextCursor": "2"}, {"tools": [tool("a")]}]
    err = pin_fails(fs_config(workdir, {"pages": pages}))
    assert '"a" twice' in err


def test_the_listing_is_bounded(workdir):
    err = pin_fails(fs_config(workdir, {"endless": True}))
    assert "100 pages" in err

    err = pin_fails(fs_config(workdir, {"tools": [tool(f"t{i}") for i in range(1001)]}))
    assert "more than 1000 tools" in err

    pin(fs_config(workdir, {"tools": [tool(f"t{i}") for i in range(1000)]}))
    assert len(read_manifest(workdir / "fs.manifest.json")["tools"]) == 1000


def test_the_listing_key_is_matched_exactly(workdir):
    raw = json.dumps({
        "tools": [{"name": "a", "description": "SDK sees this entry",
                   "inputSchema": {"type": "object", "properties": {"a": {"type": "string"}}}}],
        "Tools": [{"name": "b", "description": "not this one",
                   "inputSchema": {"type": "object", "properties": {"b": {"type": "integer"}}}}],
    })
    pin(fs_config(workdir, {"list_raw": raw}))
    tools = read_manifest(workdir / "fs.manifest.json")["tools"]
    assert list(tools) == ["a"]
    assert tools["a"]["description"] == "SDK sees this entry"
    assert tools["a"]["input_schema"] == {"type": "object", "properties": {"a": {"type": "string"}}}


def test_a_listing_error_is_escaped(workdir):
    message = "\x1b[2K\r\x1b[32m pinned 3 tools OK\x1b[0m"
    err = pin_fails(fs_config(workdir, {"list": "error", "list_error": message}))
    assert "pinned 3 tools OK" in err
    assert not has_raw_controls(err) and "\r" not in err, repr(err)


# ---------------------------------------------------------------- what the server sends


def test_requests_from_the_server_are_answered(workdir):
    record = workdir / "record.jsonl"
    spec = {"tools": [tool("a")], "record": str(record),
            "server_requests": ["ping", "roots/list", "sampling/createMessage", "elicitation/create"]}
    pin(fs_config(workdir, spec))
    answers = {entry["method"]: entry["answer"] for entry in records(record) if "method" in entry}
    assert set(answers) == {"ping", "roots/list", "sampling/createMessage", "elicitation/create"}
    for method, answer in answers.items():
        assert answer is not None, f"{method} was never answered"
        assert answer["jsonrpc"] == "2.0" and answer["id"].startswith("srv-")
    assert answers["ping"]["result"] == {}
    for method in ("roots/list", "sampling/createMessage", "elicitation/create"):
        error = answers[method].get("error")
        assert isinstance(error, dict) and isinstance(error.get("code"), int) and error.get("message"), answers[method]
        assert "result" not in answers[method]


def test_garbage_on_the_servers_stdout_is_ignored(workdir):
    garbage = ["", "not json", "[1,2]", "\x1b[31mred", '{"jsonrpc":"2.0","id":424242,"result":{}}',
               '{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"x"}}',
               '{"id":"x","result":1}']
    spec = {"tools": [tool("a")], "garbage": garbage, "calls": {"a": {"text": "still fine"}}}
    config = fs_config(workdir, spec, rules={"a": rule("read_only")})
    pin(config)
    with gate_host(config) as host:
        assert host.call_text("fs_a", {}) == "still fine"
        assert host.call_text("fs_a", {"x": 1}) == "still fine"


def test_an_unusable_answer_fails_only_that_call(workdir):
    spec = {"tools": [tool("dup"), tool("big"), tool("ok")],
            "calls": {"dup": {"raw_result": '{"content":[{"type":"text","text":"a"}],"content":[]}'},
                      "big": {"huge": 16 * 1024 * 1024 + 100},
                      "ok": {"text": "fine"}}}
    config = fs_config(workdir, spec, rules={name: rule("read_only", "60s") for name in ("dup", "big", "ok")})
    pin(config)
    with gate_host(config) as host:
        result = host.call("fs_dup", {})
        assert result.is_error
        assert "not usable JSON" in result_text(result) and "duplicate key" in result_text(result)
        assert host.call_text("fs_ok", {}) == "fine"

        result = host.call("fs_big", {})
        assert result.is_error
        assert "larger than 16777216 bytes" in result_text(result)
        assert len(result_text(result)) < 2000
        assert host.call_text("fs_ok", {}) == "fine"


# ---------------------------------------------------------------- calls that never end well


def test_a_server_that_dies_mid_call_fails_fast_naming_it(workdir):
    spec = {"tools": [tool("die"), tool("ok")], "calls": {"die": {"die": True}}}
    config = fs_config(workdir, spec, rules={"die": rule("read_only", "300s"), "ok": rule("read_only", "300s")})
    pin(config)
    with gate_host(config) as host:
        started = time.monotonic()
        result = host.call("fs_die", {})
        assert result.is_error
        assert 'server "fs"' in result_text(result)
        assert time.monotonic() - started < 60  # nowhere near the 300s rule timeout

        # Issue 29: the server is started again (tests/test_r4_restart_servers.py: while down)
        wait_for(lambda: "server fs was started again" in host.stderr_text(), 180,
                 message="the server to be started again")
        assert result_text(host.call("fs_ok", {})) == "called ok"


def test_the_rule_timeout_ends_a_call_the_server_never_answers(workdir):
    spec = {"tools": [tool("never")], "calls": {"never": {"never": True}}}
    config = fs_config(workdir, spec, rules={"never": rule("read_only", "300ms")})
    pin(config)
    with gate_host(config) as host:
        started = time.monotonic()
        result = host.call("fs_never", {})
        assert result.is_error
        assert 'server "fs"' in result_text(result) and "timed out after 300ms" in result_text(result)
        assert time.monotonic() - started < 60


def test_stdin_closing_mid_call_lets_the_call_finish(workdir):
    ledger = workdir / "ledger"
    config = bank(workdir, rules={"pay": {"outcome": "allow"}})
    with RawStdio(agentgate_argv("-config", str(config))) as raw:
        raw.initialize()
        raw.send({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                  "params": {"name": "bank_pay", "arguments": {"to": "val", "amount": 8, "mode": "slow"}}})
        wait_for(lambda: payments(ledger) == 1, 60, message="the payment to reach the server")
        raw.proc.stdin.close()
        assert raw.wait(60) == 0
    db = open_db(workdir / "runs.db")
    try:
        (run,) = run_rows(db)
        assert run[2] == "COMPLETED"
        types = event_types(db, run[0])
        assert types[-1] == "run.finished" and "step.interrupted" not in types
    finally:
        db.close()
    assert payments(ledger) == 1


# ---------------------------------------------------------------- the process group


def test_close_kills_the_servers_descendants(workdir):
    pidfile = workdir / "grandchild.pid"
    spec = {"tools": [tool("a")], "grandchild": str(pidfile)}
    config = fs_config(workdir, spec, rules={"a": rule("read_only")})
    grandchildren = []
    try:
        pin(config)
        grandchildren.append(read_pid(pidfile))
        wait_for(lambda: not pid_alive(grandchildren[0]), 30, message="the grandchild of pin's server to die")

        pidfile.unlink()
        host = gate_host(config)
        host.list_tools()  # servers start once a request needs them
        grandchildren.append(read_pid(pidfile))
        assert pid_alive(grandchildren[1])
        assert host.call_text("fs_a", {}) == "called a"
        host.close()
        wait_for(lambda: not pid_alive(grandchildren[1]), 30, message="the grandchild of the served server to die")
    finally:
        reap(grandchildren)


def test_a_gate_stopped_by_sigterm_kills_the_servers_group(workdir):
    pidfile = workdir / "grandchild.pid"
    config = fs_config(workdir, {"tools": [tool("a")], "grandchild": str(pidfile)}, rules={"a": rule("read_only")})
    pin(config)
    pidfile.unlink()
    grandchild = None
    with RawStdio(agentgate_argv("-config", str(config))) as raw:
        try:
            raw.initialize()
            assert "result" in raw.request("tools/list", {}, timeout=60)
            grandchild = read_pid(pidfile)
            raw.kill(signal.SIGTERM)
            status = raw.wait(60)
            # a polite stop closes the server's whole group, SIGTERM-proof grandchild included
            wait_for(lambda: not pid_alive(grandchild), 30, message="the grandchild to die")
            assert status == 0, raw.stderr_text()
        finally:
            if grandchild:
                reap([grandchild])
