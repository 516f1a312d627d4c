"""Smoke tests of the harness itself, against the npm reference servers directly (no agentgate)."""

import signal

import pytest
from mcp.shared.exceptions import MCPError

from conftest import (
    Host,
    RawStdio,
    everything_server_argv,
    filesystem_server_argv,
    pid_alive,
    wait_for,
)

MODES = ["auto", "legacy"]


@pytest.mark.parametrize("mode", MODES)
def test_everything_echo_and_progress(mode):
    with Host(everything_server_argv(), mode=mode) as host:
        assert host.pid and pid_alive(host.pid)
        names = {tool.name for tool in host.list_tools()}
        assert {"echo", "trigger-long-running-operation"} <= names
        assert host.call_text("echo", {"message": "hi there"}) == "Echo: hi there"

        result = host.call("trigger-long-running-operation", {"duration": 0.3, "steps": 3}, progress=True)
        assert not result.is_error
        # the SDK runs progress callbacks as tasks of their own: let the last one land
        wait_for(lambda: len(host.progress) == 3, message="three progress notifications")
        assert [(p.progress, p.total) for p in host.progress] == [(1, 3), (2, 3), (3, 3)]
        wait_for(lambda: "STDIO" in host.stderr_text(), message="server banner on stderr")
        pid = host.pid
    assert not pid_alive(pid)


@pytest.mark.parametrize("mode", MODES)
def test_filesystem_read(mode, workdir):
    (workdir / "note.txt").write_text("hello from the harness\n")
    with Host(filesystem_server_argv(workdir), mode=mode) as host:
        names = {tool.name for tool in host.list_tools()}
        assert {"read_text_file", "list_directory", "write_file"} <= names
        assert host.call_text("read_text_file", {"path": str(workdir / "note.txt")}) == "hello from the harness\n"
        denied = host.call("read_text_file", {"path": "/etc/hostname"})
        assert denied.is_error


def test_timeout_and_cancel_leave_session_usable():
    with Host(everything_server_argv(), mode="legacy") as host:
        with pytest.raises(MCPError) as info:
            host.call("trigger-long-running-operation", {"duration": 60, "steps": 60}, timeout=0.5)
        assert "timed out" in str(info.value)

        pending = host.submit("trigger-long-running-operation", {"duration": 60, "steps": 600}, progress=True)
        wait_for(lambda: pending.progress, message="first progress notification")
        pending.cancel()
        assert host.call_text("echo", {"message": "still here"}) == "Echo: still here"


def test_host_start_failure_is_reported_and_cleaned_up():
    host = Host(["node", "-e", "console.error('boom'); process.exit(3)"])
    with pytest.raises(Exception) as info:
        host.start()
    assert "boom" in "".join(getattr(info.value, "__notes__", []))
    host.close()


def test_raw_stdio_roundtrip_malformed_frame_and_sigkill():
    with RawStdio(everything_server_argv()) as raw:
        init = raw.initialize()
        assert init["result"]["serverInfo"]["name"]
        raw.send(b"{this is not json")
        tools = raw.request("tools/list", {})
        assert any(tool["name"] == "echo" for tool in tools["result"]["tools"])
        reply = raw.request("tools/call", {"name": "echo", "arguments": {"message": "raw"}})
        assert reply["result"]["content"][0]["text"] == "Echo: raw"

        raw.kill(signal.SIGKILL)
        assert raw.wait() == -signal.SIGKILL
        with pytest.raises(EOFError):
            while True:
                raw.recv(timeout=30)
