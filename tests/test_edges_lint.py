"""Names end where they look like they end, and the lint reads what the model reads (issue 19,
items 11 and 12).

Item 11: a name checked with `^...$` and re.match lets a trailing newline through. A server
whose tool is named "pay\\n" must not get it offered as "svc_pay\\n" (and handed on to a notify
program); a config's names (a server's, the session, the status tool, a header) with a
trailing newline are refused with one sentence.
"""

import json

import pytest

from kit import agentgate, check, gate_host, pin, rule, scripted_server, tool, write_config, write_private

PAY_SCHEMA = {"type": "object", "properties": {"to": {"type": "string"}}}


def newline_named(workdir, **rule_fields):
    """A scripted server `svc` whose tools are `pay\\n` (classified) and `balance`, pinned."""
    tools = [tool("pay\n", PAY_SCHEMA, "Pays someone."), tool("balance", None, "Shows the balance.")]
    rules = {"pay\n": rule("read_only", **rule_fields), "balance": rule("read_only")}
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools}, name="svc", rules=rules)])
    pin(config)
    return config


def test_a_tool_named_with_a_trailing_newline_is_refused_not_offered(workdir):
    config = newline_named(workdir)
    done = check(config)
    refused = [line for line in done.stdout.splitlines() if line.startswith("svc: refused pay")]
    assert refused and "svc_pay" in refused[0] and "rename" in refused[0], done.stdout
    assert "\n" not in refused[0]  # the report line shows the name escaped, on one line
    assert "svc: registered balance as svc_balance" in done.stdout, done.stdout
    gate = gate_host(config)
    try:
        offered = [t.name for t in gate.list_tools()]
    finally:
        gate.close()
    assert offered and all("\n" not in name for name in offered), offered
    assert "svc_balance" in offered and not any(name.startswith("svc_pay") for name in offered)


def test_a_rename_with_a_trailing_newline_is_refused(workdir):
    config = newline_named(workdir, rename="pay_out\n")
    done = check(config)
    refused = [line for line in done.stdout.splitlines() if line.startswith("svc: refused pay")]
    assert refused and "rename" in refused[0], done.stdout


def config_refusal(workdir, server_fields=None, **top):
    """What `check` says of a config whose names are changed as given (a scripted server)."""
    server = scripted_server(workdir, {"tools": [tool("balance")]}, name="svc",
                             rules={"balance": rule("read_only")})
    server.update(server_fields or {})
    config = write_config(workdir, [server], **top)
    done = check(config)
    assert done.returncode == 1, done
    said = done.stderr.strip()
    assert "\n" not in said and said.count(". ") == 0, said  # one line, one sentence
    return said


URL_SERVER = {"url": "http://127.0.0.1:9/mcp", "command": None}


@pytest.mark.parametrize("server_fields, top, sentence", [
    ({"name": "svc\n"}, {}, 'servers[0].name "svc " must be 1 to 64 letters'),
    ({}, {"session": "test\n"}, 'session "test " must be 1 to 64 letters'),
    ({}, {"status_tool": "gate_status\n"}, 'status_tool "gate_status " must be 1 to 64 letters'),
    ({**URL_SERVER, "headers": {"X-Key\n": "k"}}, {}, '"X-Key " is not a header name'),
], ids=["server", "session", "status_tool", "header"])
def test_a_config_name_with_a_trailing_newline_is_refused_with_one_sentence(
        workdir, server_fields, top, sentence):
    said = config_refusal(workdir, server_fields, **top)
    assert sentence in said, said


def test_a_schema_naming_its_draft_with_a_trailing_newline_is_refused(workdir):
    schema = {"type": "object", "$schema": "https://json-schema.org/draft/2020-12/schema\n"}
    tools = [tool("odd", schema, "Does odd things."), tool("balance")]
    rules = {"odd": rule("read_only"), "balance": rule("read_only")}
    config = write_config(workdir, [scripted_server(workdir, {"tools": tools}, name="svc", rules=rules)])
    pin(config)
    done = check(config)
    refused = [line for line in done.stdout.splitlines() if line.startswith("svc: refused odd:")]
    assert refused and "could make a validator read outside it" in refused[0], done.stdout
