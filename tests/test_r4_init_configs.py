"""Issue 29 item 5: after init, which writes one config per host and no config.json, the
commands that need a config work, or say which configs there are and the -config to add.

grant works over every host's config: a tool one host offers is granted in that host's
session; a tool several offer needs -config, and the error names the files. recheck runs on
each config; the gate started with the README's bare entry names the configs it could read.
"""

from __future__ import annotations

import json

from kit import SCRIPTED, agentgate, tool, write_spec
from test_init import bank_entry, host_file, no_traceback
from test_init_hosts import gate_dir, home_env


def two_hosts(workdir, home):
    """Claude Desktop with the bank, Cursor with the bank and a scripted server."""
    spec = write_spec(workdir / "notes.spec.json",
                      {"tools": [tool("add", annotations={"readOnlyHint": True})]})
    notes = {"command": "python3", "args": [str(SCRIPTED), str(spec)]}
    host_file(home / ".config" / "Claude" / "claude_desktop_config.json",
              {"bank": bank_entry(workdir)})
    host_file(home / ".cursor" / "mcp.json", {"bank": bank_entry(workdir), "notes": notes})
    env = home_env(home)
    assert agentgate("init", env=env, cwd=home).returncode == 0
    assert agentgate("check", "-accept", "-yes", env=env, cwd=home).returncode == 0
    return env


def test_grant_recheck_and_serve_after_init_without_config_json(workdir):
    home = workdir / "home"
    env = two_hosts(workdir, home)
    gate = gate_dir(home)
    assert not (gate / "config.json").exists()

    # one host offers notes_add: granted in its session, no -config needed
    done = agentgate("grant", "notes_add", "-yes", "-by", "kim", env=env, cwd=home)
    assert done.returncode == 0, done
    no_traceback(done)
    assert "session        cursor" in done.stdout, done.stdout
    grants = agentgate("grants", "-json", env=env, cwd=home)
    assert grants.returncode == 0, grants
    assert [(g["name"], g["session"]) for g in json.loads(grants.stdout)] == [("notes_add", "cursor")]

    # both offer bank_pay: the grant names the configs and the flag, and grants nothing
    done = agentgate("grant", "bank_pay", "-yes", "-by", "kim", env=env, cwd=home)
    assert done.returncode == 2, done
    assert str(gate / "claude-desktop.json") in done.stderr, done.stderr
    assert str(gate / "cursor.json") in done.stderr and "-config" in done.stderr
    no_traceback(done)
    done = agentgate("grant", "bank_pay", "-yes", "-by", "kim", "-config",
                     str(gate / "claude-desktop.json"), env=env, cwd=home)
    assert done.returncode == 0, done

    # recheck reads each host's config
    done = agentgate("recheck", env=env, cwd=home)
    no_traceback(done)
    assert 'no run of session "cursor"' in done.stderr, done  # nothing called yet
    assert f"== {gate / 'claude-desktop.json'}" in done.stdout
    assert f"== {gate / 'cursor.json'}" in done.stdout
    # -json prints one JSON value: over several configs it asks for one
    done = agentgate("recheck", "-json", env=env, cwd=home)
    no_traceback(done)
    assert done.returncode == 2 and done.stdout == "", done
    assert str(gate / "cursor.json") in done.stderr, done.stderr

    # a gate started with no -config (the README's bare entry) says which to name
    done = agentgate(env=env, cwd=home)
    assert done.returncode == 1, done
    assert "cannot be read" not in done.stderr, done.stderr
    assert str(gate / "cursor.json") in done.stderr and "-config" in done.stderr, done.stderr
