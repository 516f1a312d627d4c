"""Issue 28, items 6, 7 and 8: a refused token file hides only its server; init writes an
OAuth server into its host's config so the `login` it prints works; login's loopback port is
not held up by an idle connection.

The OAuth server is tests/test_oauth_login.py's (the SDK's own, with its authorization
server); the plain one is tests/test_r4_http_transport.py's Bank.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import wait_for  # noqa: E402
from kit import DEADLINE, agentgate, bank_server, gate_host, pin, rule, said, write_config  # noqa: E402
from test_oauth_login import browser_env, oauth_server  # noqa: E402,F401
from test_r4_http_transport import Bank  # noqa: E402

IDLE_BROWSER = f"""#!{sys.executable}
# A local program holds a connection to login's port open, saying nothing; then the person
# consents, and the browser follows the redirect there.
import socket, sys, urllib.parse, urllib.request
query = urllib.parse.parse_qs(urllib.parse.urlsplit(sys.argv[1]).query)
port = urllib.parse.urlsplit(query["redirect_uri"][0]).port
idle = socket.create_connection(("127.0.0.1", port))
with urllib.request.urlopen(sys.argv[1], timeout=60) as answer:
    answer.read()
idle.close()
"""


def test_a_token_file_others_may_read_hides_only_its_server(workdir):
    crm = Bank(None)
    try:
        config = write_config(workdir, [
            bank_server(workdir),
            {"name": "crm", "url": crm.url, "manifest": "crm.manifest.json",
             "rules": {"pay": rule("remote_mutation")}}])
        pin(config)
        tokens = workdir / "agentgate.crm.tokens.json"
        tokens.write_text(json.dumps({"config": str(config), "url": crm.url,
                                      "tokens": {"access_token": "never-sent", "token_type": "Bearer"}}))
        tokens.chmod(0o640)
        checked = agentgate("check", "-config", str(config))
        assert "chmod 600" in checked.stdout + checked.stderr, checked
        gate = gate_host(config)
        offered = {t.name for t in gate.list_tools()}
        assert "bank_balance" in offered and "crm_pay" not in offered, offered
        text, error = said(gate.call("bank_balance", {"account": "A-1"}))
        assert not error, text
        wait_for(lambda: "chmod 600" in gate.stderr_text(), DEADLINE, message="the gate to say why crm is not served")
        gate.close()
        assert "never-sent" not in gate.stderr_text() + checked.stdout + checked.stderr
        assert not any(a and "never-sent" in a for a in crm.authorizations)
    finally:
        crm.close()


def test_init_writes_an_oauth_server_so_the_login_it_prints_works(workdir, oauth_server):
    server = oauth_server()
    source = workdir / "mcp.json"
    source.write_text(json.dumps({"mcpServers": {"bank": {"url": server.url}}}))
    config = workdir / "gate" / "config.json"
    done = agentgate("init", "-from", str(source), "-config", str(config))
    assert done.returncode == 0, done
    (line,) = [line for line in done.stdout.splitlines() if "asks for OAuth" in line]
    command = line.split("you run: ", 1)[1].split(", then pin", 1)[0]
    assert [s["name"] for s in json.loads(config.read_text())["servers"]] == ["bank"]
    argv = shlex.split(command)
    assert argv[2:] == ["login", "bank"] or argv[-2:] == ["login", "bank"], argv
    logged = agentgate(*argv[2:], env=browser_env(workdir))
    assert logged.returncode == 0, logged
    assert "authorized with server bank" in logged.stdout, logged.stdout
    assert pin(Path(config)).returncode == 0


def test_an_idle_local_connection_does_not_hold_login_up(workdir, oauth_server):
    server = oauth_server()
    config = write_config(workdir, [{"name": "bank", "url": server.url, "manifest": "bank.manifest.json",
                                     "rules": {"balance": rule("read_only")}}])
    browser = workdir / "browser"
    browser.write_text(IDLE_BROWSER)
    browser.chmod(0o700)
    done = agentgate("login", "bank", "-config", str(config), env={"BROWSER": str(browser)})
    assert done.returncode == 0, done
    assert (workdir / "agentgate.bank.tokens.json").exists()
