"""The review `check` gives a person (issue 29 item 10), on the real reference server
`server-everything` as init proposes it:

- one line per tool, never twice; a proposal reads as what it is ("proposed: would ask once
  accepted"), never as accepted; the effective settings a person relies on are on it: the
  decision, the class, the repeat window (init's "0s" for an idempotent tool is visible), and
  below the tools the hold and what notify runs.
- `check -accept` prints each rule it accepts and accepts nothing without a typed yes or
  `-yes`; with `-yes` it accepts them all.
"""

from __future__ import annotations

import json
import re

from conftest import everything_server_argv
from kit import agentgate, check


def proposed(workdir):
    argv = everything_server_argv()
    host = workdir / "host.json"
    host.write_text(json.dumps({"mcpServers": {"everything": {"command": argv[0],
                                                              "args": argv[1:]}}}))
    config = workdir / "gate" / "config.json"
    done = agentgate("init", "-from", str(host), "-config", str(config))
    assert done.returncode == 0, done
    return config


def test_check_is_one_line_per_tool_with_its_settings(workdir):
    config = proposed(workdir)
    rules = json.loads(config.read_text())["servers"][0]["rules"]
    done = check(config)
    assert done.returncode == 1, done
    lines = done.stdout.splitlines()
    for tool, rule in rules.items():
        mine = [line for line in lines if re.search(rf"\b{re.escape(tool)}\b", line)]
        assert len(mine) == 1, (tool, done.stdout)
        (line,) = mine
        word = "allow" if rule["side_effect"] == "read_only" else "ask"
        assert line.startswith(f"everything: unreviewed {tool}: proposed {rule['side_effect']} "
                               f"-> would {word} once accepted"), line
        if rule["side_effect"] != "read_only":
            assert line.endswith(f"; repeat window {rule.get('repeat_window', '10m0s')}"), line
    assert any(rule.get("repeat_window") == "0s" for rule in rules.values()), rules
    assert "accepted, " not in done.stdout and "unreviewed (" not in done.stdout
    assert "hold: a call that asks waits " in done.stdout, done.stdout
    assert "notify: nothing is run" in lines, done.stdout


def test_check_accept_prints_what_it_accepts_and_waits_for_a_yes(workdir):
    config = proposed(workdir)
    before = config.read_bytes()
    refused = agentgate("check", "-accept", "-config", str(config))
    assert refused.returncode != 0, refused
    assert "  everything/get-env (read_only): would allow" in refused.stdout.splitlines()
    assert "add -yes" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert config.read_bytes() == before  # nothing accepted
    accepted = agentgate("check", "-accept", "-yes", "-config", str(config))
    assert accepted.returncode == 0, accepted
    assert re.search(r"^accepted \d+ proposed rule\(s\)$", accepted.stdout, re.M), accepted.stdout
    assert re.search(r"^everything: registered get-env as everything_get-env \(read_only\).* -> "
                     r"allow$", accepted.stdout, re.M), accepted.stdout
    assert not any(rule.get("proposed") for rule in
                   json.loads(config.read_text())["servers"][0]["rules"].values())
