"""A server that cannot be served hides only itself, and `check` says what every tool decides
(issue 20 item 5; issue 21 items 1, 4 and 9).

- A url server that is down, one whose header names a variable that is not set, a command
  that exits while it starts and a server that registers no tool are each left out, with one
  line on stderr saying why; the other servers and the status tool are served, and the status
  tool tells the model how many are not (never which, nor why).
- With no server served, the status tool alone is offered.
- `check` lists every server (served, or why not) and each tool's effective decision (allow,
  ask, deny, refused, unreviewed, or why it is not offered), marks a proposed read whose
  description speaks of secrets, and exits 1 while anything is refused or unreviewed or a
  server is not served.
- A JSON typo in the config, a manifest or a host's file is named by its line and column.

Everything runs through the real commands: pin, check, init, and the gate under the SDK host.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import everything_server_argv
from kit import (
    agentgate as run_agentgate,
    bank_server,
    check,
    gate_host,
    pin,
    rule,
    scripted_server,
    tool,
    write_config,
    write_private,
    write_spec,
)
from test_http_upstream import sdk_server, url_server  # noqa: F401 (fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

TOKEN = "t0ken-of-the-keyed-server"
PAY_WHEN = {"when": [{"if": {"/amount": {"max": "5"}}, "outcome": "allow", "reason": "small"}]}


def lines_with(text: str, fragment: str) -> list[str]:
    return [line for line in text.splitlines() if fragment in line]


def bank_and_four_that_fail(workdir, sdk):
    """The fake bank, a url server that is down, one whose header names a variable that is
    not set, a command that exits while it starts, and one that registers no tool: all pinned
    while they worked. Returns the config."""
    reads = {"balance": rule("read_only")}
    servers = [
        bank_server(workdir, rules={"pay": PAY_WHEN}),
        url_server(sdk.url, reads, name="notes", manifest="notes.manifest.json"),
        url_server(sdk.url, reads, name="keyed", manifest="keyed.manifest.json",
                   headers={"X-Api-Key": "${KEYED_TOKEN}"}),
        scripted_server(workdir, {"tools": [tool("ping")]}, name="quits",
                        rules={"ping": rule("read_only")}),
        scripted_server(workdir, {"tools": []}, name="empty"),
    ]
    config = write_config(workdir, servers)
    pin(config, env={"KEYED_TOKEN": TOKEN})
    sdk.stop()  # down from now on
    write_spec(workdir / "quits.spec.json", {"list": "die", "list_stderr": "no licence today\n"})
    return config


def test_servers_that_cannot_be_served_hide_only_themselves(workdir, sdk_server):
    config = bank_and_four_that_fail(workdir, sdk_server())
    with gate_host(config) as host:  # the host's environment has no KEYED_TOKEN
        names = [t.name for t in host.list_tools()]
        assert names == ["bank_balance", "bank_pay", "bank_refund", "gate_status"]
        assert host.call_text("bank_balance", {"account": "a"}) == "account a holds 120.00 EUR"
        assert host.call_text("bank_pay", {"to": "bo", "amount": 2}) == "paid 2.00 to bo"
        status = host.call_text("gate_status", {})
        stderr = host.stderr_text()
    assert status.startswith("GATE_STATUS: no request in this session is waiting"), status
    assert "4 of the servers behind this gate could not be served" in status, status
    for private in ("notes", "keyed", "quits", "empty", "127.0.0.1", "KEYED_TOKEN", "mcp"):
        assert private not in status, (private, status)
    # One line on stderr for each server not served, saying why.
    unserved = lines_with(stderr, "not served:")
    assert len(unserved) == 4, stderr
    for line, fragments in zip(unserved, (
            ('server "notes"', "connect"),
            ('server "keyed".headers.X-Api-Key', "KEYED_TOKEN", "not set"),
            ('server "quits"', "list tools", "no licence today"),
            ('server "empty": no tool registered',))):
        assert all(fragment in line for fragment in fragments), (fragments, line)
    assert TOKEN not in stderr


def test_check_lists_every_server_and_each_tools_decision(workdir, sdk_server):
    config = bank_and_four_that_fail(workdir, sdk_server())
    done = check(config, env={"KEYED_TOKEN": None})
    assert done.returncode == 1, done
    out = done.stdout
    assert 'server "bank" is served: 3 tool(s) offered' in out
    assert "bank: registered balance as bank_balance (read_only) -> allow" in out.splitlines()
    assert "bank: registered pay as bank_pay (remote_mutation) -> ask; 1 when entry may decide " \
           "otherwise; repeat window 10m0s" in out.splitlines()
    assert "bank: registered refund as bank_refund (destructive) -> deny; repeat window 10m0s" in \
        out.splitlines()
    assert lines_with(out, 'server "notes" is not served: connect:'), out
    assert lines_with(out, 'server "keyed" is not served: server "keyed".headers.X-Api-Key '
                           'names the environment variable KEYED_TOKEN, which is not set'), out
    assert lines_with(out, 'server "quits" is not served: list tools:'), out
    assert 'server "empty" is not served: no tool registered; it offered none when it was ' \
           'pinned' in out
    # Every server is listed though the first ones failed, in the config's order.
    order = [out.index(f'server "{name}" is') for name in ("bank", "notes", "keyed", "quits", "empty")]
    assert order == sorted(order)
    unserved = lines_with(done.stderr, "not served:")
    assert len(unserved) == 4 and "Traceback" not in done.stderr, done.stderr


def test_with_no_server_served_the_status_tool_alone_is_offered(workdir):
    config = write_config(workdir, [scripted_server(workdir, {"tools": [tool("a")]}, rules={})])
    pin(config)
    with gate_host(config) as host:
        assert [t.name for t in host.list_tools()] == ["gate_status"]
        status = host.call_text("gate_status", {})
        stderr = host.stderr_text()
    assert "1 of the servers behind this gate could not be served" in status, status
    assert lines_with(stderr, 'not served: server "fs": no tool registered'), stderr


def test_a_server_added_but_not_pinned_yet_hides_only_itself(workdir):
    config = write_config(workdir, [bank_server(workdir)])
    pin(config)
    added = scripted_server(workdir, {"tools": [tool("a")]}, name="added", rules={"a": rule("read_only")})
    config = write_config(workdir, [bank_server(workdir), added])
    done = check(config)
    assert done.returncode == 1, done
    assert 'server "bank" is served: 3 tool(s) offered' in done.stdout
    assert lines_with(done.stdout, 'server "added" is not served: manifest '), done.stdout
    assert lines_with(done.stderr, "added.manifest.json does not exist; run pin"), done.stderr
    with gate_host(config) as host:
        assert [t.name for t in host.list_tools()] == ["bank_balance", "bank_pay", "bank_refund",
                                                       "gate_status"]


def test_a_config_that_is_wrong_still_stops_the_gate(workdir):
    # A tool renamed as the status tool is the config's own contradiction, not one server's.
    config = write_config(workdir, [bank_server(workdir, rules={"balance": {"rename": "gate_status"}}),
                                    scripted_server(workdir, {"tools": [tool("a")]},
                                                    rules={"a": rule("read_only")})])
    pin(config)
    done = check(config)
    assert done.returncode == 1 and "the status tool's name" in done.stderr, done
    assert "is served" not in done.stdout


def test_check_shows_decisions_and_fails_while_anything_is_refused_or_unreviewed(workdir):
    tools = [tool("get-env", description="Returns all environment variables.",
                  annotations={"readOnlyHint": True}),
             tool("echo", description="Echoes its input.", annotations={"readOnlyHint": True}),
             tool("wipe", description="Removes everything.", annotations={"destructiveHint": True}),
             tool("later", description="Something for later.")]
    proposed = {"get-env": {"side_effect": "read_only", "proposed": True},
                "echo": {"side_effect": "read_only", "proposed": True},
                "wipe": {"side_effect": "destructive", "outcome": "require_approval",
                         "proposed": True}}
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools}, name="every",
                                                    rules=proposed)])
    pin(config)
    done = check(config)
    assert done.returncode == 1, done
    lines = done.stdout.splitlines()
    at = lines.index("every: unreviewed get-env: proposed read_only -> would allow once accepted")
    assert lines[at + 1] == "    review: a read that may return secrets"
    at = lines.index("every: unreviewed echo: proposed read_only -> would allow once accepted")
    assert not lines[at + 1].startswith("    review:")  # a read that speaks of no secret
    assert "every: unreviewed wipe: proposed destructive -> would ask once accepted; repeat window " \
           "10m0s" in lines
    assert "every: unclassified later: no rule" in lines
    assert lines_with(done.stderr, "3 tool(s) unreviewed: read their proposed rules, then run "
                                   "check -accept"), done.stderr

    accepted = run_agentgate("check", "-accept", "-yes", "-config", str(config))
    assert accepted.returncode == 0, accepted
    lines = accepted.stdout.splitlines()
    assert 'server "every" is served: 3 tool(s) offered' in lines
    assert lines_with(accepted.stdout, "registered get-env as every_get-env (read_only) [no timeout set: "
                                       "the default 1m0s applies] -> allow"), accepted.stdout
    assert lines_with(accepted.stdout, "registered wipe as every_wipe (destructive) [no timeout set: "
                                       "the default 1m0s applies] -> ask; repeat window 10m0s")

    # A tool refused (its schema changed since the pin) fails check; the others still show.
    changed = [dict(tools[1], inputSchema={"type": "object", "properties": {"x": {"type": "string"}}}),
               *tools[:1], *tools[2:]]
    write_spec(workdir / "every.spec.json", {"tools": changed})
    done = check(config)
    assert done.returncode == 1, done
    assert lines_with(done.stdout, "every: refused echo: "), done.stdout
    assert lines_with(done.stdout, "as every_get-env (read_only) [no timeout set: the default 1m0s "
                                   "applies] -> allow"), done.stdout
    assert lines_with(done.stderr, "1 tool(s) refused"), done.stderr


def test_inits_proposal_of_the_everything_servers_get_env_stands_out(workdir):
    # The real reference server, proposed by init as a person would meet it: get-env ("Returns
    # all environment variables") is proposed read_only, and check marks it for review.
    argv = everything_server_argv()
    host = workdir / "host.json"
    host.write_text(json.dumps({"mcpServers": {"everything": {"command": argv[0], "args": argv[1:]}}}))
    config = workdir / "gate" / "config.json"
    done = run_agentgate("init", "-from", str(host), "-config", str(config))
    assert done.returncode == 0, done
    done = check(config)
    assert done.returncode == 1, done
    lines = done.stdout.splitlines()
    at = lines.index("everything: unreviewed get-env: proposed read_only -> would allow once accepted")
    assert lines[at + 1] == "    review: a read that may return secrets"
    assert sum(line.startswith("    review:") for line in lines) == 1, done.stdout
    assert lines_with(done.stderr, 'not served: server "everything": no tool registered; its rules '
                                   'are proposals nobody reviewed'), done.stderr


def test_no_operator_and_limits_show_in_the_decision(workdir):
    limits = {"limits": [{"calls": 2, "per": "1h"}]}
    config = write_config(workdir, [bank_server(workdir, rules={"balance": limits})],
                          operator="none")
    pin(config)
    done = check(config)
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert "bank: registered balance as bank_balance (read_only) -> allow; 1 limit may decide " \
           "otherwise" in lines
    assert "bank: registered pay as bank_pay (remote_mutation) -> deny; no operator is at hand to " \
           "ask; repeat window 10m0s" in lines


def test_a_json_typo_is_named_by_its_line_and_column(workdir):
    config = write_config(workdir, [bank_server(workdir)])
    pin(config)
    text = config.read_text()
    assert text.splitlines()[2] == '  "session": "test",'
    write_private(config, text.replace('"session": "test",', '"session": "test",,', 1))
    done = check(config)
    assert done.returncode == 1 and "is not usable JSON: not valid JSON at line 3 column 21" in \
        done.stderr, done

    config = write_config(workdir, [bank_server(workdir)])
    manifest = workdir / "bank.manifest.json"
    write_private(manifest, manifest.read_text().replace('"tools": {', '"tools": {{', 1))
    done = check(config)
    assert done.returncode == 1, done
    assert lines_with(done.stderr, "bank.manifest.json is not usable JSON: not valid JSON at line"), \
        done.stderr

    broken = workdir / "host.json"
    broken.write_text('{"mcpServers": {\n  "a": 1,\n}}')
    done = run_agentgate("init", "-from", str(broken), "-config", str(workdir / "gate" / "config.json"))
    assert done.returncode == 1, done
    assert "host.json is not usable JSON: not valid JSON at line 3 column 1" in done.stderr, done


def test_a_frames_reason_keeps_the_anchors_words():
    # The place is for a file a person edits; a host's broken frame keeps the reference's reason.
    try:
        agentgate.parse(b'{"a": 1,}')
    except agentgate.CanonicalError as err:
        assert str(err) == "not valid JSON" and err.placed() == "not valid JSON at line 1 column 9"
    else:
        raise AssertionError("parsed")
