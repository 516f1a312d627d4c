"""One interpreter in every printed command (issue 29 item 11): run under a python that lacks
the mcp package while the venv the README installs it in has it, init's operator command and
host entry name that venv's python, as the gate's own log would, and login's hint says the
venv has it instead of telling the person to create it; a venv without the package is told to
install it, not to be created again.

The interpreter without mcp is this one started with -S (no site-packages); the venv is a
directory in a private HOME whose python is this interpreter.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from conftest import AGENTGATE
from kit import bank_server, write_config


def venv(home, with_mcp):
    python = home / ".agentgate-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    site = home / ".agentgate-venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if with_mcp:
        (site / "mcp").mkdir()
    return python


def bare(*args, home):
    """agentgate under this interpreter without its site-packages, so without mcp."""
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "XDG_CONFIG_HOME": str(home / ".config")}
    return subprocess.run([sys.executable, "-S", str(AGENTGATE), *args], env=env, cwd=home,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_init_names_the_venv_that_has_mcp(workdir):
    python = venv(workdir, with_mcp=True)
    host = workdir / "host.json"
    argv = bank_server(workdir)["command"]
    host.write_text(json.dumps({"mcpServers": {"bank": {"command": argv[0], "args": argv[1:]}}}))
    config = workdir / "gate" / "config.json"
    done = bare("init", "-from", str(host), "-config", str(config), home=workdir)
    assert done.returncode == 0, done
    (accept,) = [line.strip() for line in done.stdout.splitlines()
                 if line.strip().endswith("check -accept")]
    assert shlex.split(accept)[0] == str(python), accept
    entry = json.loads(done.stdout[done.stdout.index('{\n  "mcpServers"'):])
    assert entry["mcpServers"]["gated"]["command"] == str(python), entry


def url_config(workdir):
    return write_config(workdir, [{"name": "crm", "url": "http://127.0.0.1:9/mcp",
                                   "manifest": "crm.manifest.json", "rules": {}}])


def test_login_names_the_venv_that_has_mcp(workdir):
    python = venv(workdir, with_mcp=True)
    done = bare("login", "crm", "-config", str(url_config(workdir)), home=workdir)
    assert done.returncode == 1, done
    assert "~/.agentgate-venv/bin/python has it: run agentgate with that" in done.stderr, done.stderr
    assert "python3 -m venv" not in done.stderr and python.exists()


def test_login_does_not_ask_to_create_a_venv_that_exists(workdir):
    venv(workdir, with_mcp=False)
    done = bare("login", "crm", "-config", str(url_config(workdir)), home=workdir)
    assert done.returncode == 1, done
    assert "~/.agentgate-venv/bin/pip install mcp" in done.stderr, done.stderr
    assert "python3 -m venv" not in done.stderr, done.stderr
