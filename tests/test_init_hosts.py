"""From a person's hosts to gated ones, each on its own (issue 21, items 1, 2, 5, 6, 7, 8, 10, 11).

A home made here holds Claude Desktop's, Claude Code's and Cursor's files. `init` gates each
host on a config of its own (`claude-desktop.json`, `claude-code.json`, `cursor.json`), with
the host's name as its session and one database for all; a header's value written in a host's
file moves into the 0600 config; running init again adds only what is new in a host's file,
leaving every other byte of its config as it was. A destructive tool is proposed to ask, an
idempotent one no repeat window, and each host a hold that fits it. The servers are real: the
demo's fake bank, the scripted server, the SDK's HTTP server with a header it checks.
"""

import hashlib
import json
import os
import shlex
import stat
import sys
from pathlib import Path

from conftest import AGENTGATE, Host, wait_for
from kit import SCRIPTED, agentgate, tool, write_config, write_private, write_spec
from test_http_upstream import sdk_server  # noqa: F401 (fixture)
from test_init import bank_entry, host_file, no_traceback

SECRET = "hdr-5e1f0a-never-printed"


def home_env(home: Path, **extra) -> dict:
    return {"HOME": str(home), "XDG_CONFIG_HOME": None, "AGENTGATE_CONFIG": None, **extra}


def gate_dir(home: Path) -> Path:
    return home / ".config" / "agentgate"


def config_of(home: Path, host: str) -> dict:
    return json.loads((gate_dir(home) / f"{host}.json").read_text())


def scripted_entry(workdir: Path, name: str, tools: list, **spec) -> dict:
    path = write_spec(workdir / f"{name}.spec.json", {"tools": tools, **spec})
    return {"command": sys.executable, "args": [str(SCRIPTED), str(path)]}


def printed_entries(stdout: str) -> list[dict]:
    """Every host entry init printed, in order."""
    entries, at = [], 0
    while (at := stdout.find('{\n  "mcpServers"', at)) >= 0:
        value, end = json.JSONDecoder().raw_decode(stdout, at)
        entries.append(value["mcpServers"]["gated"])
        at = end
    return entries


def three_hosts(workdir: Path, home: Path, url: str) -> dict:
    """Claude Desktop (the bank, a git server), Claude Code (a url server with a bearer header
    written in the file), Cursor (the same bank as Claude Desktop's)."""
    git = scripted_entry(workdir, "git", [tool("git_add", annotations={"destructiveHint": True}),
                                          tool("status", annotations={"readOnlyHint": True})])
    bank = bank_entry(workdir)
    return {
        "desktop": host_file(home / ".config" / "Claude" / "claude_desktop_config.json",
                             {"bank": bank, "git": git}),
        "code": host_file(home / ".claude.json", {"notes": {"type": "http", "url": url,
                                                            "headers": {"X-Api-Key": SECRET}}}),
        "cursor": host_file(home / ".cursor" / "mcp.json", {"bank": bank}),
    }


def test_each_host_is_gated_on_its_own_config_and_all_share_one_database(workdir, sdk_server):
    home = workdir / "home"
    sdk = sdk_server()
    three_hosts(workdir, home, sdk.url)
    done = agentgate("init", env=home_env(home), cwd=home)
    assert done.returncode == 0, done
    no_traceback(done)
    assert SECRET not in done.stdout + done.stderr

    gate = gate_dir(home)
    assert sorted(p.name for p in gate.glob("*.json") if ".manifest." not in p.name) == [
        "claude-code.json", "claude-desktop.json", "cursor.json"]
    desktop, code, cursor = (config_of(home, h) for h in ("claude-desktop", "claude-code", "cursor"))
    for host, config in (("claude-desktop", desktop), ("claude-code", code), ("cursor", cursor)):
        assert config["session"] == host and config["database"] == "agentgate.db"
        assert stat.S_IMODE((gate / f"{host}.json").stat().st_mode) == 0o600
    # each host has its own servers: no host is offered another's, and no bank-2
    assert [s["name"] for s in desktop["servers"]] == ["bank", "git"]
    assert [s["name"] for s in code["servers"]] == ["notes"]
    assert [s["name"] for s in cursor["servers"]] == ["bank"]
    # item 1: the header's value moved into the 0600 config, not into a variable nobody sets
    assert code["servers"][0]["headers"] == {"X-Api-Key": SECRET}
    # item 8: a hold that fits each host, by the name it gives itself
    assert desktop["hold"] == {"claude-ai": "50s", "*": "15s"}
    assert code["hold"] == {"claude-code": "10m", "*": "15s"}
    assert cursor["hold"]["*"] == "15s" and len(cursor["hold"]) == 2

    # Each host's printed entry names its own config; Claude Code's line is in the user's scope.
    entries = printed_entries(done.stdout)
    assert [e["args"][-1] for e in entries] == [str(gate / f"{h}.json") for h in ("claude-desktop", "claude-code", "cursor")]
    assert all(e["command"] == sys.executable for e in entries)
    claude = next(line for line in done.stdout.splitlines() if "claude mcp add" in line)
    assert shlex.split(claude.split("or: ", 1)[1]) == [
        "claude", "mcp", "add", "-s", "user", "gated", "--", sys.executable, str(AGENTGATE),
        "-config", str(gate / "claude-code.json")]

    # check, given no config, reads each host's; -accept accepts every host's proposals
    unreviewed = agentgate("check", env=home_env(home), cwd=home)
    assert unreviewed.returncode == 1, unreviewed
    accepted = agentgate("check", "-accept", "-yes", env=home_env(home), cwd=home)
    assert accepted.returncode == 0, accepted
    no_traceback(accepted)
    for host in ("claude-desktop", "claude-code", "cursor"):
        assert f"== {gate / host}.json" in accepted.stdout
        assert "proposed" not in (gate / f"{host}.json").read_text()

    # Claude Code's gate reaches the url server with the header from the config; the other
    # hosts' gates write to the same database, which `runs` finds given no config.
    with Host([entries[1]["command"], *entries[1]["args"]], env={"HOME": str(home)}, name="claude-code") as host:
        whoami = host.call_text("notes_whoami", {})
        assert hashlib.sha256(SECRET.encode()).hexdigest() in whoami
    with Host([entries[2]["command"], *entries[2]["args"]], env={"HOME": str(home)}) as host:
        assert host.call_text("bank_balance", {"account": "A-1"}) == "account A-1 holds 120.00 EUR"
    runs = agentgate("runs", "-json", env=home_env(home), cwd=home)
    assert runs.returncode == 0, runs
    assert sorted(r["run"].split(".")[0] for r in json.loads(runs.stdout)) == ["claude-code", "cursor"]
    assert len(list(gate.glob("*.db"))) == 1


def test_write_moves_a_written_header_out_of_the_hosts_file(workdir, sdk_server):
    sdk = sdk_server()
    source = host_file(workdir / "mcp.json", {"notes": {"url": sdk.url, "headers": {"X-Api-Key": SECRET}}})
    source.chmod(0o644)
    config = workdir / "gate" / "config.json"
    done = agentgate("init", "-from", str(source), "-config", str(config), "-write")
    assert done.returncode == 0, done
    assert SECRET not in done.stdout + done.stderr
    assert SECRET not in source.read_text()  # the world-readable file no longer holds it
    assert json.loads(config.read_text())["servers"][0]["headers"] == {"X-Api-Key": SECRET}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


def test_init_again_adds_the_new_servers_and_changes_no_other_byte(workdir):
    home = workdir / "home"
    desktop = home / ".config" / "Claude" / "claude_desktop_config.json"
    host_file(desktop, {"bank": bank_entry(workdir)})
    first = agentgate("init", env=home_env(home), cwd=home)
    assert first.returncode == 0, first
    path = gate_dir(home) / "claude-desktop.json"
    # pin, given no config, reads each host's (there is no config.json)
    diff = agentgate("pin", "-diff", env=home_env(home), cwd=home)
    assert diff.returncode == 0 and f"== {path}" in diff.stdout and "server bank: as pinned" in diff.stdout, diff
    # The person edits the config: a rule of their own, their own layout.
    raw = json.loads(path.read_text())
    raw["servers"][0]["rules"]["pay"] = {"side_effect": "remote_mutation", "timeout": "20s"}
    raw["repeat_window"] = "5m"
    edited = json.dumps(raw, indent=3) + "\n\n"
    write_private(path, edited)
    bank_manifest = (gate_dir(home) / raw["servers"][0]["manifest"]).read_bytes()

    # Nothing new: nothing changes.
    same = agentgate("init", env=home_env(home), cwd=home)
    assert same.returncode == 0, same
    assert "nothing was added" in same.stdout and path.read_text() == edited

    # A server added in the host's file is added to the host's config, as a proposal.
    git = scripted_entry(workdir, "git", [tool("git_add"), tool("log", annotations={"readOnlyHint": True})])
    host_file(desktop, {"bank": bank_entry(workdir), "git": git})
    again = agentgate("init", env=home_env(home), cwd=home)
    assert again.returncode == 0, again
    no_traceback(again)
    after = path.read_text()
    k = next(i for i, (a, b) in enumerate(zip(edited, after)) if a != b)
    inserted = after[k:len(after) - (len(edited) - k)]
    assert after == edited[:k] + inserted + edited[k:]  # every byte the person wrote is there
    servers = json.loads(after)["servers"]
    assert servers[0] == raw["servers"][0] and [s["name"] for s in servers] == ["bank", "git"]
    assert servers[1]["rules"] == {"git_add": {"side_effect": "remote_mutation", "proposed": True},
                                   "log": {"side_effect": "read_only", "proposed": True}}
    assert f"added to {path} (0600): git" in again.stdout
    assert "server bank:" not in again.stdout  # the bank is not pinned again
    assert (gate_dir(home) / raw["servers"][0]["manifest"]).read_bytes() == bank_manifest
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_destructive_proposal_asks_and_an_idempotent_one_has_no_repeat_window(workdir):
    spec = [tool("drop", annotations={"destructiveHint": True}),
            tool("put", annotations={"idempotentHint": True}),
            tool("get", annotations={"readOnlyHint": True, "idempotentHint": True})]
    source = host_file(workdir / "mcp.json", {"store": scripted_entry(workdir, "store", spec)})
    config = workdir / "gate" / "config.json"
    done = agentgate("init", "-from", str(source), "-config", str(config))
    assert done.returncode == 0, done
    rules = json.loads(config.read_text())["servers"][0]["rules"]
    assert rules == {
        "drop": {"side_effect": "destructive", "outcome": "require_approval", "proposed": True},
        "put": {"side_effect": "remote_mutation", "repeat_window": "0s", "proposed": True},
        "get": {"side_effect": "read_only", "proposed": True}}
    assert agentgate("check", "-accept", "-yes", "-config", str(config)).returncode == 0
    write_private(config, json.dumps({**json.loads(config.read_text()), "hold": "0s"}))  # answer at once
    with Host([sys.executable, str(AGENTGATE), "-config", str(config)]) as host:
        dropped = host.call("store_drop", {})
        assert dropped.content[0].text.startswith("PENDING_APPROVAL:"), dropped
        # an idempotent tool's ordinary repeat, after it executed, is not refused as a duplicate
        assert host.call_text("store_put", {"k": "v"}).startswith("PENDING_APPROVAL:")
        waiting = json.loads(agentgate("runs", "-json", "-config", str(config)).stdout)[0]
        approved = agentgate("approve", waiting["run"], "-approval", waiting["pending_approval"], "-yes",
                             "-config", str(config))
        assert approved.returncode == 0, approved
        assert host.call_text("store_put", {"k": "v"}) == "called put"
        assert host.call_text("store_put", {"k": "v"}).startswith("PENDING_APPROVAL:")


def test_a_duplicate_tells_the_operator_which_rule_to_change(workdir):
    spec = [tool("send")]
    entry = {"name": "mail", "command": [sys.executable, str(SCRIPTED), str(write_spec(workdir / "mail.spec.json", {"tools": spec}))],
             "manifest": "mail.manifest.json", "rules": {"send": {"side_effect": "remote_mutation", "outcome": "allow"}}}
    config = write_config(workdir, [entry])
    assert agentgate("pin", "-config", str(config)).returncode == 0
    host = Host([sys.executable, str(AGENTGATE), "-config", str(config)]).start()
    try:
        assert host.call_text("mail_send", {"to": "a"}) == "called send"
        again = host.call("mail_send", {"to": "a"})
        assert again.content[0].text.startswith("DUPLICATE:")
        # the model is told nothing of the config; the operator's stderr says what to change
        assert "repeat_window" not in again.content[0].text
    finally:
        host.close()
    stderr = host.stderr_text()
    line = next(line for line in stderr.splitlines() if "refused as a duplicate" in line)
    assert '"repeat_window": "0s"' in line and "send of server mail" in line and str(config) in line, line
    run = json.loads(agentgate("runs", "-json", "-config", str(config)).stdout)[0]["run"]
    shown = agentgate("show", run, "-config", str(config))
    assert shown.returncode == 0, shown
    assert "repeats" in shown.stdout and '"repeat_window": "0s"' in shown.stdout, shown.stdout


def test_a_hold_set_per_host_waits_for_that_host_only(workdir):
    spec = [tool("send")]
    entry = {"name": "mail", "command": [sys.executable, str(SCRIPTED), str(write_spec(workdir / "mail.spec.json", {"tools": spec}))],
             "manifest": "mail.manifest.json", "rules": {"send": {"side_effect": "remote_mutation"}}}
    config = write_config(workdir, [entry], hold={"patient-host": "10m", "*": "0s"})
    assert agentgate("pin", "-config", str(config)).returncode == 0
    argv = [sys.executable, str(AGENTGATE), "-config", str(config)]
    with Host(argv, name="hasty-host") as host:  # "*": not held at all
        assert host.call("mail_send", {"to": "a"}).content[0].text.startswith("PENDING_APPROVAL:")
    with Host(argv, name="patient-host") as host:
        call = host.submit("mail_send", {"to": "b"}, progress=True)
        # held: the host is told how long it has waited, and the operator approves meanwhile
        wait_for(lambda: call.progress, 60, message="progress while the call is held")
        runs = json.loads(agentgate("runs", "-json", "-config", str(config)).stdout)
        waiting = runs[0]  # newest first: the held call's
        assert waiting["status"] == "WAITING_FOR_APPROVAL" and len(runs) == 2
        approved = agentgate("approve", waiting["run"], "-approval", waiting["pending_approval"], "-yes",
                             "-config", str(config))
        assert approved.returncode == 0, approved
        assert call.result().content[0].text == "called send"


def test_a_tool_named_after_its_server_is_not_prefixed_twice(workdir):
    spec = [tool("git_add"), tool("git-log"), tool("status"), tool("git_rm")]
    entry = {"name": "git", "command": [sys.executable, str(SCRIPTED), str(write_spec(workdir / "git.spec.json", {"tools": spec}))],
             "manifest": "git.manifest.json",
             "rules": {name: {"side_effect": "read_only"} for name in ("git_add", "git-log", "status")}
             | {"git_rm": {"side_effect": "read_only", "rename": "remove_file"}}}
    config = write_config(workdir, [entry])
    assert agentgate("pin", "-config", str(config)).returncode == 0
    with Host([sys.executable, str(AGENTGATE), "-config", str(config)]) as host:
        names = sorted(t.name for t in host.list_tools())
    assert names == ["gate_status", "git-log", "git_add", "git_status", "remove_file"]


def fake_npx(bindir: Path) -> Path:
    """An `npx` that runs the fake bank instead of fetching a package (no network here)."""
    bindir.mkdir(parents=True, exist_ok=True)
    npx = bindir / "npx"
    npx.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(AGENTGATE))} fake-payments\n")
    npx.chmod(0o755)
    return npx


def test_init_says_npx_may_download_and_asks_once_for_all_it_needs(workdir):
    bindir = workdir / "bin"
    fake_npx(bindir)
    # the mcp package made missing, as on a Python without it: no url server needs it
    fake = workdir / "fake"
    (fake / "mcp").mkdir(parents=True)
    (fake / "mcp" / "__init__.py").write_text('raise ImportError("this mcp is not installed")\n')
    # a `python3` on PATH that is not the interpreter running init: printed commands must not use it
    (bindir / "python3").symlink_to("/bin/false")
    source = host_file(workdir / "mcp.json", {
        "files": {"command": "npx", "args": ["-y", "@example/some-server"],
                  "env": {"FAKE_PAYMENTS_LEDGER": str(workdir / "ledger")}},
        "crm": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer ${CRM_TOKEN}"}},
        "wiki": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Key": "${WIKI_KEY}"}},
    })
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(fake), "CRM_TOKEN": None, "WIKI_KEY": None}
    config = workdir / "gate" / "config.json"
    done = agentgate("init", "-from", str(source), "-config", str(config), env=env)
    assert done.returncode == 0, done
    no_traceback(done)
    lines = done.stdout.splitlines()
    npx = next(i for i, line in enumerate(lines) if "npx may download" in line)
    pinned = next(i for i, line in enumerate(lines) if line.startswith("server files:") and "pinned" in line)
    assert lines[npx].startswith("server files:") and npx < pinned
    # one line names every variable; a url server needs no package (only login uses mcp)
    (needs,) = [line for line in lines if "init needs" in line]
    assert "CRM_TOKEN, WIKI_KEY" in needs and "mcp package" not in needs, needs
    for name in ("crm", "wiki"):
        line = next(line for line in lines if f": {name}: " in line)
        assert "needs" in line, line
    # every command printed runs with the interpreter that ran init
    (accept,) = [line.strip() for line in lines if line.strip().endswith("check -accept")]
    assert shlex.split(accept)[:2] == [sys.executable, str(AGENTGATE)], accept
    assert [s["name"] for s in json.loads(config.read_text())["servers"]] == ["files"]
