"""Issue 29 items 6 and 7: init -from a project's .mcp.json.

The project's servers run in the project's directory, as the host runs them (a relative
argument such as `--repository .` means the project), wherever init is run from; the host
entry is proposed only for a file something was gated from; writing the default config says
what that changes. A proxy or CA variable set where init runs is proposed as inherit_env, by
name: its value is in no file and no output.
"""

from __future__ import annotations

import json

from conftest import AGENTGATE, Host
from kit import SCRIPTED, agentgate, tool, write_spec
from test_init import host_file, no_traceback
from test_init_hosts import gate_dir, home_env, printed_entries

PROXY = "http://user:pw-7c1d@proxy.invalid:3128"


def project(workdir, name: str, servers: dict):
    folder = workdir / name
    folder.mkdir()
    write_spec(folder / "spec.json", {"tools": [tool("add", annotations={"readOnlyHint": True})]})
    return host_file(folder / ".mcp.json", servers)


def test_a_project_server_runs_in_its_project_and_inherits_the_network_variables(workdir):
    home = workdir / "home"
    home.mkdir()
    # the spec is named relative to the project, as `--repository .` is
    mcp = project(workdir, "proj", {"notes": {"command": "python3",
                                              "args": [str(SCRIPTED), "spec.json"]}})
    env = home_env(home, HTTPS_PROXY=PROXY, SSL_CERT_FILE=str(workdir / "ca.pem"))
    done = agentgate("init", "-from", str(mcp), env=env, cwd=home)
    assert done.returncode == 0, done
    no_traceback(done)
    config_path = gate_dir(home) / "config.json"
    config = json.loads(config_path.read_text())
    server = config["servers"][0]
    assert server["cwd"] == str(mcp.parent)
    assert {"HTTPS_PROXY", "SSL_CERT_FILE"} <= set(server["inherit_env"])
    assert "HTTPS_PROXY" in done.stdout and "inherit_env" in done.stdout
    assert PROXY not in done.stdout + done.stderr + config_path.read_text()
    assert f"{config_path} is the default config" in done.stdout, done.stdout
    assert f"Then replace the gated servers in {mcp} " in done.stdout
    assert "A project's file may be shared" in done.stdout

    assert agentgate("check", "-accept", "-yes", env=env, cwd=home).returncode == 0
    entry = printed_entries(done.stdout)[0]
    assert entry["args"][0] == str(AGENTGATE)
    with Host([entry["command"], *entry["args"]], env={"HOME": str(home)}) as gate:
        assert gate.call_text("notes_add", {}) == "called add"

    # a project none of whose servers could be gated is not to be edited
    other = project(workdir, "other", {"gone": {"command": str(workdir / "no-such-server")}})
    done = agentgate("init", "-from", str(other), env=env, cwd=home)
    assert done.returncode == 0, done
    no_traceback(done)
    assert f"replace the gated servers in {other}" not in done.stdout, done.stdout
    assert f"nothing of {other} was gated" in done.stdout, done.stdout


def test_claude_codes_map_for_the_project_runs_in_the_project(workdir):
    home = workdir / "home"
    folder = workdir / "proj"
    folder.mkdir()
    write_spec(folder / "spec.json", {"tools": [tool("add", annotations={"readOnlyHint": True})]})
    notes = {"command": "python3", "args": [str(SCRIPTED), "spec.json"]}
    claude = host_file(home / ".claude.json", {},
                       projects={str(folder): {"mcpServers": {"notes": notes}}})
    done = agentgate("init", "-from", str(claude), env=home_env(home), cwd=folder)
    assert done.returncode == 0, done
    no_traceback(done)
    config = json.loads((gate_dir(home) / "config.json").read_text())
    assert [(s["name"], s["cwd"]) for s in config["servers"]] == [("notes", str(folder))]
