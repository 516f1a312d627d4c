"""An oversized answer is matched by its own id wherever the id stands (issue 28, item 16).

Specification: section 1's promise (the id read from a refused frame is only ever its own
top-level one) and SPEC "Upstream servers": an answer larger than the gate reads fails only the
request it answers, at once, with a clear answer; it is never left to wait out the call's
timeout, which would make a mutating call's outcome unknown although the server answered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import expect, gate_host, rule, said, tool  # noqa: E402
from test_hostile_upstream import MiB, hostile_server, hostiles, pinned  # noqa: E402,F401

BIG = json.dumps({"jsonrpc": "2.0", "result": {"content": [{"type": "text", "text": (
    'x\\"id\\":3,' * 1000) + "\\\\"}], "id": 4}, "x": "id", "id": 77}).encode()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 4096, len(BIG)])
def test_the_id_after_a_result_is_read_from_pieces_of_any_size(size):
    reading = agentgate.FrameId()
    for start in range(0, len(BIG), size):
        reading.feed(BIG[start:start + size])
    assert reading.ident == 77


@pytest.mark.parametrize("frame, ident", [
    (b'{"jsonrpc":"2.0","result":{"content":[]},"id":5}', 5),
    (b'{"result":{"id":3},"id":-2,"jsonrpc":"2.0"}', -2),
    (b'{"result":{"id":3},"jsonrpc":"2.0"}', None),
    (b'{"result":"\\\\","x":"id","id":6}', 6),
    (b'{"result":"\\",\\"id\\":9}', None),
    (b'[{"result":1},{"id":7}]', None),
])
def test_only_the_top_level_id_is_read_wherever_it_stands(frame, ident):
    reading = agentgate.FrameId()
    reading.feed(frame)
    assert reading.ident == ident


def test_an_oversized_answer_with_its_id_last_fails_its_call_at_once(hostiles):
    workdir = hostiles
    spec = {"tools": [tool("pay"), tool("look")],
            "calls": {"pay": {"big": {"bytes": 18 * MiB, "kind": "last"}, "text": "late"}}}
    config = pinned(workdir, hostile_server(workdir, "h", spec, {
        "pay": rule("remote_mutation", timeout="1h", outcome="allow"),
        "look": rule("read_only", "1h")}))
    with gate_host(config, timeout=120) as host:
        # The call's timeout is an hour: only the answer read as its own ends the wait.
        text = expect(host.call("h_pay", {"n": 1}), "UNRECORDED")
        assert "answered this request, so it executed" in text, text
        assert "larger than 16777216 bytes" in text, text
        assert said(host.call("h_look", {})) == ("called look", False)
