"""Issue 29 item 2: a stdio server that exits while the gate serves is started again.

While it is down, stderr and the status tool say so and a call to it fails known, with
nothing sent; once it is started again, connected and listed against its pin, it serves.
The server's start is held failing by a file its wrapper looks for, so "down" lasts as long
as the test needs, whatever the machine's load.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from conftest import agentgate_argv, everything_server_argv, pid_alive, wait_for
from kit import (
    BALANCE,
    DEADLINE,
    PAY,
    allow,
    approvals,
    bank_server,
    count,
    host,
    pin,
    rule,
    said,
    upstream_pids,
    write_config,
    write_spec,
    SCRIPTED,
    tool,
)

# Exits at once while $HOLD exists, else runs the server it is given.
HELD = ["sh", "-c", 'if [ -e "$HOLD" ]; then exit 3; fi; exec "$@"', "held"]


def held(server: dict, hold: Path) -> dict:
    return {**server, "command": HELD + server["command"],
            "env": [*server.get("env", []), f"HOLD={hold}"]}


def status(gate) -> str:
    text, _ = said(gate.call("gate_status", {}))
    return text


def kill(gate, marker: str) -> None:
    pid = upstream_pids(gate.pid, marker)[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), DEADLINE, message="the server to die")


def test_a_killed_server_is_down_then_started_again(workdir):
    hold = workdir / "hold"
    config = write_config(workdir, [held(bank_server(workdir, rules={"pay": allow()}), hold)])
    pin(config)
    gate = host(config)
    try:
        assert said(gate.call(BALANCE, {"account": "x"})) == ("account x holds 120.00 EUR", False)
        assert "is down" not in status(gate)
        hold.touch()
        kill(gate, "fake-payments")
        wait_for(lambda: "server bank exited (killed by signal 9)" in gate.stderr_text(),
                 DEADLINE, message="stderr to say the server exited")

        text, is_error = said(gate.call(PAY, {"to": "kim", "amount": 3}))
        assert is_error and "nothing was sent" in text, text
        assert "is being started again" in text, text
        assert not text.startswith(("UNKNOWN_OUTCOME", "INTERRUPTED")), text
        assert approvals(workdir) == [] and count(workdir) == 0
        down = status(gate)
        assert "Server bank is down: the server stopped" in down, down
        assert "next try in" in down, down
        wait_for(lambda: "server bank could not be started again" in gate.stderr_text(),
                 DEADLINE, message="a start to fail while held")
        assert "HOLD" not in gate.stderr_text()  # what the server is given is not shown

        hold.unlink()
        wait_for(lambda: "server bank was started again" in gate.stderr_text(), 3 * DEADLINE,
                 message="the server to be started again")
        assert said(gate.call(PAY, {"to": "lee", "amount": 2})) == ("paid 2.00 to lee", False)
        assert "is down" not in status(gate)
        assert count(workdir) == 1
    finally:
        gate.close()


def test_the_everything_server_killed_serves_again(workdir):
    server = {"name": "every", "command": everything_server_argv(),
              "manifest": "every.manifest.json", "rules": {"echo": rule("read_only")}}
    config = write_config(workdir, [server])
    pin(config)
    gate = host(config)
    try:
        kill(gate, "server-everything")
        wait_for(lambda: "server every exited" in gate.stderr_text(), DEADLINE,
                 message="stderr to say the server exited")
        wait_for(lambda: "server every was started again" in gate.stderr_text(),
                 3 * DEADLINE, message="the server to be started again")
        assert said(gate.call("every_echo", {"message": "hi"})) == ("Echo: hi", False)
    finally:
        gate.close()


def test_a_server_started_again_with_a_changed_tool_does_not_offer_it(workdir):
    spec = workdir / "spec.json"
    write_spec(spec, {"tools": [tool("a"), tool("b")]})
    server = {"name": "fs", "command": ["python3", str(SCRIPTED), str(spec)],
              "manifest": "fs.manifest.json",
              "rules": {"a": rule("read_only"), "b": rule("read_only")}}
    config = write_config(workdir, [server])
    pin(config)
    gate = host(config)
    try:
        assert said(gate.call("fs_b", {})) == ("called b", False)
        write_spec(spec, {"tools": [tool("a"), tool("b", description="now something else")]})
        kill(gate, str(spec))
        wait_for(lambda: "server fs was started again" in gate.stderr_text(), 3 * DEADLINE,
                 message="the server to be started again")
        assert "not offered now: fs_b" in gate.stderr_text()
        assert said(gate.call("fs_a", {})) == ("called a", False)
        text, is_error = said(gate.call("fs_b", {}))
        assert is_error and "presents this tool differently" in text, text
    finally:
        gate.close()
