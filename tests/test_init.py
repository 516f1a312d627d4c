"""From the setup a person already has to a gated one: `init` and `check -accept` (issue 12).

init reads the hosts' configurations (or the file named with -from), writes a starter config
(0600) with their servers, pins them, and proposes a rule per tool from the server's own
hints; nothing is offered until `check -accept` marks the proposals reviewed. It prints the
one host entry that replaces the gated servers, and edits a host's file only with -write,
keeping a backup. A secret in a server's env is written to the 0600 config and printed
nowhere. The servers here are real: the demo's fake bank and the npm filesystem server.
"""

import json
import os
import re
import stat
import sys
from pathlib import Path

from conftest import AGENTGATE, Host, filesystem_server_argv
from kit import agentgate
from test_http_upstream import sdk_server  # noqa: F401 (fixture)

SECRET = "tok-91c2e7-do-not-print"


def bank_entry(workdir: Path) -> dict:
    return {"command": sys.executable, "args": [str(AGENTGATE), "fake-payments"],
            "env": {"FAKE_PAYMENTS_LEDGER": str(workdir / "ledger"), "BANK_TOKEN": SECRET}}


def fs_entry(root: Path) -> dict:
    argv = filesystem_server_argv(root)
    return {"command": argv[0], "args": argv[1:]}


def host_file(path: Path, servers: dict, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, "mcpServers": servers}, indent=2))
    return path


def init(workdir: Path, *args: str, env: dict | None = None, cwd=None):
    return agentgate("init", "-config", str(workdir / "gate" / "config.json"), *args, env=env, cwd=cwd)


def config_of(workdir: Path) -> dict:
    return json.loads((workdir / "gate" / "config.json").read_text())


def no_traceback(done) -> None:
    assert "Traceback" not in done.stdout + done.stderr, done


def test_init_gates_a_claude_desktop_config_and_nothing_is_offered_until_accepted(workdir):
    sandbox = workdir / "sandbox"
    sandbox.mkdir()
    (sandbox / "note.txt").write_text("hello from the sandbox")
    source = host_file(workdir / "claude_desktop_config.json",
                       {"bank": bank_entry(workdir), "files": fs_entry(sandbox)})
    done = init(workdir, "-from", str(source))
    assert done.returncode == 0, done
    no_traceback(done)
    assert SECRET not in done.stdout + done.stderr

    path = workdir / "gate" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    config = config_of(workdir)
    bank, files = config["servers"]
    assert bank["name"] == "bank" and bank["command"] == [sys.executable, str(AGENTGATE), "fake-payments"]
    assert sorted(bank["env"]) == sorted([f"FAKE_PAYMENTS_LEDGER={workdir / 'ledger'}", f"BANK_TOKEN={SECRET}"])
    # a rule per tool, from its own hints, each marked as a proposal
    assert bank["rules"] == {"balance": {"side_effect": "read_only", "proposed": True},
                             "pay": {"side_effect": "remote_mutation", "proposed": True},
                             "refund": {"side_effect": "remote_mutation", "proposed": True}}
    assert files["rules"]["read_text_file"] == {"side_effect": "read_only", "proposed": True}
    # issue 21: a destructive proposal asks, and an idempotent tool is proposed no repeat window
    assert files["rules"]["write_file"] == {"side_effect": "destructive", "outcome": "require_approval",
                                            "repeat_window": "0s", "proposed": True}
    assert len(files["rules"]) >= 10
    for server in (bank, files):
        manifest = path.parent / server["manifest"]
        assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
        assert set(json.loads(manifest.read_text())["tools"]) == set(server["rules"])
    assert "balance" in done.stdout and "readOnly" in done.stdout

    # The host entry init prints starts agentgate on this config.
    entry = json.loads(done.stdout[done.stdout.index('{\n  "mcpServers"'):])["mcpServers"]["gated"]
    assert entry["args"][-2:] == ["-config", str(path)]

    unreviewed = agentgate("check", "-config", str(path))
    assert unreviewed.returncode == 1, unreviewed
    assert "bank: unreviewed balance" in unreviewed.stdout
    assert not re.search(r"^[\w-]+: registered ", unreviewed.stdout, re.M), unreviewed.stdout
    assert "check -accept" in unreviewed.stderr
    no_traceback(unreviewed)

    accepted = agentgate("check", "-accept", "-yes", "-config", str(path))
    assert accepted.returncode == 0, accepted
    assert "bank/balance (read_only)" in accepted.stdout
    assert "bank: registered balance as bank_balance (read_only)" in accepted.stdout
    assert "proposed" not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = agentgate("check", "-accept", "-yes", "-config", str(path))
    assert "no proposed rule to accept" in again.stdout

    host = Host([entry["command"], *entry["args"]]).start()
    try:
        assert host.call_text("bank_balance", {"account": "A-1"}) == "account A-1 holds 120.00 EUR"
        read = host.call_text("files_read_text_file", {"path": str(sandbox / "note.txt")})
        assert read == "hello from the sandbox"  # the server's own text, as it sent it
    finally:
        host.close()


def test_init_finds_the_hosts_configs_of_this_user_and_gates_a_server_once(workdir):
    home = workdir / "home"
    project = workdir / "project"
    project.mkdir(parents=True)
    bank = bank_entry(workdir)
    host_file(home / ".config" / "Claude" / "claude_desktop_config.json",
              {"bank": bank, "my bank!": bank_entry(workdir / "sub")})
    host_file(home / ".cursor" / "mcp.json", {"bank": bank})  # the same server: gated once
    other = dict(bank, env={"FAKE_PAYMENTS_LEDGER": str(workdir / "other-ledger")})
    host_file(home / ".claude.json", {"bank": other}, projects={str(project): {"mcpServers": {}}})
    # a project's own server is listed, not started (issue 19: tests/test_edges_init.py)
    host_file(project / ".mcp.json", {"project bank": bank_entry(workdir / "project-sub")})
    env = {"HOME": str(home), "XDG_CONFIG_HOME": None, "AGENTGATE_CONFIG": None}
    done = init(workdir, env=env, cwd=project)
    assert done.returncode == 0, done
    no_traceback(done)
    for place in ("claude_desktop_config.json", ".claude.json", ".mcp.json", "mcp.json"):
        assert place in done.stdout
    # issue 21: each host is gated on its own config, beside the one -config names
    def names(host):
        return [s["name"] for s in json.loads((workdir / "gate" / f"{host}.json").read_text())["servers"]]
    # a name agentgate cannot use is made usable
    assert names("claude-desktop") == ["bank", "my-bank"]
    assert names("cursor") == ["bank"] and names("claude-code") == ["bank"]
    assert not (workdir / "gate" / "config.json").exists()
    assert "left in Claude Code project as it is: project bank:" in done.stdout


def test_odd_host_configs_are_answered_in_one_sentence_and_write_nothing_they_should_not(workdir):
    none = host_file(workdir / "none.json", {})
    done = init(workdir, "-from", str(none))
    assert done.returncode == 1 and "no server could be gated" in done.stderr, done
    assert not (workdir / "gate" / "config.json").exists()

    broken = workdir / "broken.json"
    broken.write_text('{"mcpServers": {"a": 1,}')
    done = init(workdir, "-from", str(broken))
    assert done.returncode == 1 and "broken.json is not usable JSON" in done.stderr, done
    no_traceback(done)

    missing = init(workdir, "-from", str(workdir / "nowhere.json"))
    assert missing.returncode == 1 and "cannot be read" in missing.stderr, missing

    odd = host_file(workdir / "odd.json", {
        "bank": bank_entry(workdir),
        "old": {"type": "sse", "url": "http://127.0.0.1:9/sse"},
        "off": dict(bank_entry(workdir), disabled=True),
        "gate": {"command": sys.executable, "args": [str(AGENTGATE), "-config", "x.json"]},
        "nothing": {"args": ["x"]},
        "dead": {"command": str(workdir / "no-such-server")},
    })
    done = init(workdir, "-from", str(odd))
    assert done.returncode == 0, done
    no_traceback(done)
    assert [s["name"] for s in config_of(workdir)["servers"]] == ["bank"]
    for name, why in (("old", "SSE"), ("off", "disabled"), ("gate", "agentgate itself"),
                      ("nothing", "neither a command nor a url"), ("dead", "could not be pinned")):
        line = next(line for line in done.stdout.splitlines() if f": {name}: " in line)
        assert "not gated" in line and why in line, line

    # issue 21: init run again adds what is new, and here nothing is
    before = (workdir / "gate" / "config.json").read_bytes()
    again = init(workdir, "-from", str(odd))
    assert again.returncode == 0 and "nothing was added" in again.stdout, again
    assert (workdir / "gate" / "config.json").read_bytes() == before


def test_write_replaces_the_gated_servers_in_the_host_file_and_keeps_a_backup(workdir):
    source = host_file(workdir / "claude_desktop_config.json",
                       {"bank": bank_entry(workdir), "old": {"type": "sse", "url": "http://127.0.0.1:9/sse"}},
                       globalShortcut="Ctrl+Space")
    source.chmod(0o640)
    before = source.read_bytes()
    done = init(workdir, "-from", str(source), "-write")
    assert done.returncode == 0, done
    assert SECRET not in done.stdout + done.stderr
    backup = Path(f"{source}.agentgate-backup")
    assert backup.read_bytes() == before
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    assert stat.S_IMODE(source.stat().st_mode) == 0o640
    after = json.loads(source.read_text())
    assert after["globalShortcut"] == "Ctrl+Space"
    assert set(after["mcpServers"]) == {"old", "gated"}  # what was not gated stays as it was
    assert after["mcpServers"]["old"] == {"type": "sse", "url": "http://127.0.0.1:9/sse"}
    gated = after["mcpServers"]["gated"]
    assert gated["args"][-2:] == ["-config", str(workdir / "gate" / "config.json")]
    assert SECRET not in source.read_text()  # the secret moved into the 0600 config

    # A second init keeps the first backup.
    again = agentgate("init", "-from", str(source), "-config", str(workdir / "second.json"), "-write")
    assert again.returncode == 1 and "no server could be gated" in again.stderr, again
    assert backup.read_bytes() == before


def test_a_url_server_is_gated_with_its_headers_read_from_the_environment(workdir, sdk_server):
    sdk = sdk_server()
    source = host_file(workdir / "mcp.json", {
        "remote": {"type": "http", "url": sdk.url, "headers": {"X-Api-Key": "${REMOTE_KEY}"}},
        "written": {"url": sdk.url, "headers": {"X-Api-Key": SECRET}},
        "nowhere": {"url": "http://127.0.0.1:9/mcp"},
    })
    done = init(workdir, "-from", str(source), env={"REMOTE_KEY": "key-from-the-environment"})
    assert done.returncode == 0, done
    no_traceback(done)
    assert SECRET not in done.stdout + done.stderr
    remote, written = config_of(workdir)["servers"]
    assert remote["url"] == sdk.url and remote["headers"] == {"X-Api-Key": "${REMOTE_KEY}"}
    assert remote["rules"]["balance"] == {"side_effect": "read_only", "proposed": True}
    # issue 21: a value written in the host's file moves into the 0600 config, as env does
    assert written["headers"] == {"X-Api-Key": SECRET}
    assert stat.S_IMODE((workdir / "gate" / "config.json").stat().st_mode) == 0o600
    nowhere = next(line for line in done.stdout.splitlines() if ": nowhere: " in line)
    assert "could not be pinned" in nowhere, nowhere


def test_accepting_keeps_every_hand_written_rule_as_it_was(workdir):
    source = host_file(workdir / "claude_desktop_config.json", {"bank": bank_entry(workdir)})
    assert init(workdir, "-from", str(source)).returncode == 0
    path = workdir / "gate" / "config.json"
    raw = json.loads(path.read_text())
    pay = {"side_effect": "remote_mutation", "timeout": "20s",
           "when": [{"if": {"/amount": {"min": "0.01", "max": "50.00"}}, "outcome": "allow",
                     "reason": "a small payment, written by hand and long enough to need lines"}],
           "limits": [{"sum": "/amount", "max": "100.00", "per": "24h"}]}
    raw["servers"][0]["rules"]["pay"] = pay
    path.write_text(json.dumps(raw))
    accepted = agentgate("check", "-accept", "-yes", "-config", str(path))
    assert accepted.returncode == 0, accepted
    after = json.loads(path.read_text())
    assert after["servers"][0]["rules"] == {"balance": {"side_effect": "read_only"}, "pay": pay,
                                            "refund": {"side_effect": "remote_mutation"}}
    assert {k: v for k, v in after.items() if k != "servers"} == {k: v for k, v in raw.items() if k != "servers"}
    assert "bank: registered pay as bank_pay (remote_mutation)" in accepted.stdout
    # a short rule stays on one line, a long one is laid out
    lines = [line.strip() for line in path.read_text().splitlines()]
    assert '"balance": {"side_effect":"read_only"},' in lines
    assert '"reason": "a small payment, written by hand and long enough to need lines"' in lines
