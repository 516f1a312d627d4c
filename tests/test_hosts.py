"""Host compatibility, end to end over stdio (issue 6, item 3).

Every host here starts agentgate itself, as a real host does, in front of the bundled fake
payment server:
- the TypeScript SDK's client (npm @modelcontextprotocol/sdk), driven by tests/ts_client.mjs;
- the MCP Python SDK's client (conftest.Host) in its default mode, which probes
  `server/discover` and falls back to `initialize`, and in legacy mode;
- a bare JSON-RPC peer (conftest.RawStdio) for what the SDKs hide: the answer to the probe and
  the version each handshake negotiates;
- progress notifications while a payment waits for an operator, for both SDK clients.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

import mcp_types
import pytest
from mcp_types.version import LATEST_HANDSHAKE_VERSION, LATEST_MODERN_VERSION

from conftest import REPO, RawStdio, agentgate_argv, wait_for
from kit import agentgate, bank, gate_host, payments, result_text, wait_no_process

TS_CLIENT = REPO / "tests" / "ts_client.mjs"
HANDSHAKE_VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]
NEWEST = "2025-11-25"  # what agentgate answers a version it does not know
APPROVAL_HINT = re.compile(r"approve (\S+) -approval ([0-9a-f]+)")
RENT = {"to": "landlord", "amount": 950}


def bank_config(workdir: Path, **top) -> Path:
    """The fake bank with balance read_only and pay remote_mutation (no refund), pinned."""
    return bank(workdir, rules={"refund": None}, **top)


def approval_hint(stderr_text, finished, timeout: float = 60):
    """(run id, approval id) of the first approval agentgate's stderr names (waits for it;
    fails at once if the caller `finished()` without one)."""
    def hint():
        match = APPROVAL_HINT.search(stderr_text())
        if match is None and finished():
            raise AssertionError(f"the call ended before an approval was opened:\n{stderr_text()[-3000:]}")
        return match
    match = wait_for(hint, timeout, message="agentgate to open an approval")
    return match.group(1), match.group(2)


def approve(config: Path, run_id: str, approval_id: str) -> None:
    done = agentgate("approve", run_id, "-approval", approval_id, "-config", str(config))
    assert done.returncode == 0, f"approve exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert f"approval {approval_id}: approved" in done.stdout


# ---------------------------------------------------------------- the TypeScript SDK client


class NodeHost:
    """tests/ts_client.mjs in its own session; its stderr (and agentgate's) goes to a file."""

    def __init__(self, workdir: Path, config: Path, *flags: str):
        node = shutil.which("node")
        assert node, "node is not on PATH: run `bash tests/setup.sh`"
        self.stderr_path = workdir / f"ts-client-{os.urandom(4).hex()}.stderr"
        argv = [node, str(TS_CLIENT), *flags, "-timeout", "120000", "--", *agentgate_argv("-config", str(config))]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         cwd=workdir, start_new_session=True)

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def finish(self, timeout: float = 120) -> dict:
        """Wait for the client; its one JSON line (exit status 0 required)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            self.kill()
        assert self.proc.returncode == 0, f"ts_client exited {self.proc.returncode}:\n{self.stderr_text()}"
        lines = out.decode().splitlines()
        assert len(lines) == 1, f"ts_client printed {lines!r}"
        return json.loads(lines[0])

    def kill(self) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def ts_text(result: dict) -> str:
    return "\n".join(block["text"] for block in result["content"] if block.get("type") == "text")


def test_the_typescript_sdk_client_lists_and_calls_through_the_gate(workdir):
    config = bank_config(workdir)
    client = NodeHost(workdir, config, "-tool", "bank_balance", "-args", json.dumps({"account": "A-1"}), "-expect-ok")
    try:
        out = client.finish()
    finally:
        client.kill()
    assert out["serverInfo"]["name"] == "gated-tools"
    assert out["protocolVersion"] == NEWEST  # the TS SDK proposes 2025-11-25, which agentgate speaks
    assert out["tools"] == ["bank_balance", "bank_pay", "gate_status"]
    assert not out["result"].get("isError")
    assert ts_text(out["result"]) == "account A-1 holds 120.00 EUR"
    assert out["progressCount"] == 0
    wait_no_process(workdir)


# ---------------------------------------------------------------- the MCP Python SDK client


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_the_python_sdk_client_connects_and_calls_through_the_gate(workdir, mode):
    config = bank_config(workdir)
    with gate_host(config, mode=mode) as host:  # start() returns only once the handshake completed
        assert host.client.server_info.name == "gated-tools"
        # auto: the probe is answered, so the SDK speaks the 2026-07-28 revision (issue 31)
        era = LATEST_MODERN_VERSION if mode == "auto" else LATEST_HANDSHAKE_VERSION
        assert LATEST_MODERN_VERSION == "2026-07-28" and LATEST_HANDSHAKE_VERSION == NEWEST
        assert host.client.protocol_version == era
        assert [t.name for t in host.list_tools()] == ["bank_balance", "bank_pay", "gate_status"]
        result = host.call("bank_balance", {"account": "A-1"})
        assert not result.is_error
        assert result_text(result) == "account A-1 holds 120.00 EUR"
    wait_no_process(workdir)


def sdk_discover_probe(ident) -> dict:
    """The `server/discover` request the Python SDK sends first in auto mode, built by its own types."""
    params = mcp_types.RequestParams(_meta={
        mcp_types.PROTOCOL_VERSION_META_KEY: LATEST_MODERN_VERSION,
        mcp_types.CLIENT_INFO_META_KEY: {"name": "mcp", "version": "0"},
        mcp_types.CLIENT_CAPABILITIES_META_KEY: {},
    })
    request = mcp_types.DiscoverRequest(params=params).model_dump(by_alias=True, mode="json", exclude_none=True)
    return {"jsonrpc": "2.0", "id": ident, **request}


def test_the_auto_mode_probe_is_answered_at_once_and_the_sdk_speaks_the_new_revision(workdir):
    config = bank_config(workdir)
    with RawStdio(agentgate_argv("-config", str(config))) as raw:
        # What the SDK does in auto mode, on the wire: the probe first, and nothing else until
        # it is answered. agentgate answers it by itself, before any server is started.
        raw.send(sdk_discover_probe(0))
        first = raw.recv(60)
        assert first.get("id") == 0 and "error" not in first, first
        discovered = first["result"]
        assert discovered["supportedVersions"] == [LATEST_MODERN_VERSION]
        assert discovered["capabilities"] == {
            "tools": {"listChanged": True}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
        assert discovered["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "gated-tools"
        assert discovered["resultType"] == "complete"
        assert raw.skipped == []
    # The SDK in auto mode adopts it and calls as before.
    with gate_host(config, mode="auto") as host:
        assert host.client.protocol_version == LATEST_MODERN_VERSION
        assert host.client.server_info.name == "gated-tools"
        assert host.call_text("bank_balance", {"account": "A-1"}) == "account A-1 holds 120.00 EUR"
    wait_no_process(workdir)


def test_every_handshake_version_is_echoed_and_an_unknown_one_gets_the_newest(workdir):
    config = bank_config(workdir)
    for asked in [*HANDSHAKE_VERSIONS, "2099-01-01"]:
        with RawStdio(agentgate_argv("-config", str(config))) as raw:
            result = raw.initialize(asked)["result"]
            expected = asked if asked in HANDSHAKE_VERSIONS else NEWEST
            assert result["protocolVersion"] == expected, f"asked {asked}"
            assert result["serverInfo"]["name"] == "gated-tools"
            tools = raw.request("tools/list", {}, timeout=60)["result"]["tools"]
            assert [t["name"] for t in tools] == ["bank_balance", "bank_pay", "gate_status"], f"asked {asked}"
            assert raw.skipped == []
    wait_no_process(workdir)


# ---------------------------------------------------------------- progress while a payment waits


def test_progress_reaches_the_python_sdk_client_while_a_payment_waits(workdir):
    config = bank_config(workdir, hold="20s")
    ledger = workdir / "ledger"
    with gate_host(config) as host:
        pending = host.submit("bank_pay", RENT, progress=True)
        run_id, approval_id = approval_hint(host.stderr_text, pending.done)
        wait_for(lambda: len(pending.progress) >= 2, 60, message="two progress notifications")
        assert not pending.done()  # still held: the operator has not decided
        assert payments(ledger) == 0
        approve(config, run_id, approval_id)
        result = pending.result()
        assert not result.is_error, result_text(result)
        assert result_text(result) == "paid 950.00 to landlord"
        assert payments(ledger) == 1
        values = [p.progress for p in pending.progress]
        assert values == sorted(values) and len(set(values)) == len(values), values
        assert all(p.total == 20 for p in pending.progress), pending.progress
    assert payments(ledger) == 1
    wait_no_process(workdir)


def test_progress_reaches_the_typescript_sdk_client_while_a_payment_waits(workdir):
    config = bank_config(workdir, hold="20s")
    ledger = workdir / "ledger"
    client = NodeHost(workdir, config, "-tool", "bank_pay", "-args", json.dumps(RENT), "-progress", "-expect-ok")
    try:
        run_id, approval_id = approval_hint(client.stderr_text, lambda: client.proc.poll() is not None)
        # ts_client.mjs notes each progress notification on its stderr as it arrives.
        wait_for(lambda: client.stderr_text().count("ts_client: progress") >= 2, 60,
                 message="two progress notifications at the TS client")
        assert client.proc.poll() is None
        assert payments(ledger) == 0
        approve(config, run_id, approval_id)
        out = client.finish()
    finally:
        client.kill()
    assert out["progressCount"] >= 2
    assert not out["result"].get("isError"), out["result"]
    assert ts_text(out["result"]) == "paid 950.00 to landlord"
    assert payments(ledger) == 1
    wait_no_process(workdir)
