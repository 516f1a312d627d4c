"""init at its edges (issue 19, items 13 and 14).

A directory's `.mcp.json` (and Claude Code's map for the current project) came with the
directory, perhaps a repository cloned a minute ago: init lists those servers with what they
would run and starts none of them unless -from names their file. `init -write` removes from a
host's file only the servers it gated, keyed by file, map and name; refuses to write over
what the host wrote to its file while init ran; and writes a symbolically linked host file
where the link leads, keeping the link. The servers are real: the demo's fake bank, started
through `sh` so a test can see whether (and when) it was started.
"""

import json
import os
import shlex
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import AGENTGATE, wait_for
from kit import has_raw_controls
from test_init import bank_entry, config_of, host_file, init, no_traceback


def home_env(home: Path) -> dict:
    return {"HOME": str(home), "XDG_CONFIG_HOME": None, "AGENTGATE_CONFIG": None}


def marked_bank(workdir: Path, marker: Path, before: str = "") -> dict:
    """The fake bank, started by a shell that first touches `marker` (and runs `before`)."""
    script = f"touch {shlex.quote(str(marker))}; {before}exec \"$@\""
    return {"command": "sh", "args": ["-c", script, "sh", sys.executable, str(AGENTGATE), "fake-payments"],
            "env": {"FAKE_PAYMENTS_LEDGER": str(workdir / "ledger")}}


def host_config(workdir: Path, host: str) -> dict:
    """The config init writes for one host (issue 21), beside the one -config names."""
    return json.loads((workdir / "gate" / f"{host}.json").read_text())


def line_naming(stdout: str, name: str) -> str:
    return next(line for line in stdout.splitlines() if f": {name}: " in line)


def test_a_directorys_mcp_json_is_listed_with_its_command_line_and_started_only_with_from(workdir):
    home, project = workdir / "home", workdir / "project"
    project.mkdir()
    host_file(home / ".config" / "Claude" / "claude_desktop_config.json", {"bank": bank_entry(workdir)})
    marker = workdir / "MARKER"
    cloned = marked_bank(workdir, marker, before="echo '\x1b]0;owned\x07' >/dev/null; ")
    host_file(project / ".mcp.json", {"cloned": cloned})
    cursor_marker = workdir / "CURSOR-MARKER"
    host_file(project / ".cursor" / "mcp.json", {"cursor-cloned": marked_bank(workdir, cursor_marker)})

    done = init(workdir, env=home_env(home), cwd=project)
    assert done.returncode == 0, done
    no_traceback(done)
    assert not marker.exists() and not cursor_marker.exists()  # nothing of the directory's files ran
    assert "left in Cursor project as it is" in line_naming(done.stdout, "cursor-cloned")
    assert [s["name"] for s in host_config(workdir, "claude-desktop")["servers"]] == ["bank"]
    line = line_naming(done.stdout, "cloned")
    assert "left in Claude Code project as it is" in line and "-from" in line, line
    assert "it would run sh -c 'touch " in line and "fake-payments" in line, line
    assert "\\x1b]0;owned\\x07" in line and not has_raw_controls(done.stdout), line

    named = init(workdir / "named", "-from", str(project / ".mcp.json"), env=home_env(home), cwd=project)
    assert named.returncode == 0, named
    no_traceback(named)
    assert marker.exists()
    (server,) = config_of(workdir / "named")["servers"]
    assert server["name"] == "cloned" and server["command"][:2] == ["sh", "-c"]
    assert server["rules"]["pay"] == {"side_effect": "remote_mutation", "proposed": True}


def test_a_claude_code_project_map_is_listed_and_started_only_with_from(workdir):
    home, project = workdir / "home", workdir / "project"
    project.mkdir()
    marker = workdir / "MARKER"
    claude = host_file(home / ".claude.json", {"bank": bank_entry(workdir)},
                       projects={str(project): {"mcpServers": {"local": marked_bank(workdir, marker)}},
                                 str(workdir / "elsewhere"): {"mcpServers": {"far": bank_entry(workdir)}}})

    done = init(workdir, env=home_env(home), cwd=project)
    assert done.returncode == 0, done
    no_traceback(done)
    assert not marker.exists()
    assert [s["name"] for s in host_config(workdir, "claude-code")["servers"]] == ["bank"]
    line = line_naming(done.stdout, "local")
    assert f"left in Claude Code project {project} as it is" in line, line
    assert f"-from {claude}" in line and "it would run sh -c 'touch " in line, line
    assert ": far: " not in done.stdout  # another directory's map is not this one's

    named = init(workdir / "named", "-from", str(claude), env=home_env(home), cwd=project)
    assert named.returncode == 0, named
    assert marker.exists()
    assert [s["name"] for s in config_of(workdir / "named")["servers"]] == ["bank", "local"]


def test_write_keeps_a_project_server_that_has_the_name_of_a_gated_one(workdir):
    home, project = workdir / "home", workdir / "project"
    project.mkdir()
    old = {"type": "sse", "url": "http://127.0.0.1:9/sse"}
    claude = host_file(home / ".claude.json", {"bank": bank_entry(workdir)},
                       projects={str(project): {"mcpServers": {"bank": old}}})

    done = init(workdir, "-from", str(claude), "-write", env=home_env(home), cwd=project)
    assert done.returncode == 0, done
    no_traceback(done)
    after = json.loads(claude.read_text())
    assert set(after["mcpServers"]) == {"gated"}
    assert after["projects"][str(project)]["mcpServers"] == {"bank": old}
    line = line_naming(done.stdout, "bank")  # as init said
    assert f"left in host project {project} as it is" in line and "SSE" in line, line


def test_write_refuses_when_the_host_changed_its_file_while_init_ran(workdir):
    started, go = workdir / "started", workdir / "go"
    # The bank's shell waits for `go` before serving: init is then between reading the host's
    # file and writing it, pinning.
    slow = marked_bank(workdir, started, before=f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done; ")
    source = host_file(workdir / "claude_desktop_config.json", {"bank": slow})
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(init, workdir, "-from", str(source), "-write")
        try:
            wait_for(started.exists, timeout=60, message="init starts the bank")
            host_wrote = json.dumps({"mcpServers": {"bank": slow, "added": {"command": "true"}},
                                     "globalShortcut": "Ctrl+Space"}, indent=2).encode()
            source.write_bytes(host_wrote)
        finally:
            go.touch()
        done = running.result()
    assert done.returncode == 1, done
    no_traceback(done)
    assert f"{source} changed while init ran, so no host's file was edited" in done.stderr, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert source.read_bytes() == host_wrote
    assert not Path(f"{source}.agentgate-backup").exists()
    entry = json.loads(done.stdout[done.stdout.index('{\n  "mcpServers"'):])["mcpServers"]["gated"]
    assert entry["args"][-2:] == ["-config", str(workdir / "gate" / "config.json")]


def test_write_through_a_linked_host_file_keeps_the_link_and_the_files_mode(workdir):
    real = host_file(workdir / "dotfiles" / "claude_desktop_config.json", {"bank": bank_entry(workdir)},
                     globalShortcut="Ctrl+Space")
    real.chmod(0o640)
    before = real.read_bytes()
    link = workdir / "home" / ".config" / "Claude" / "claude_desktop_config.json"
    link.parent.mkdir(parents=True)
    target = os.path.relpath(real, link.parent)
    link.symlink_to(target)

    done = init(workdir, "-from", str(link), "-write")
    assert done.returncode == 0, done
    no_traceback(done)
    assert link.is_symlink() and os.readlink(link) == target
    after = json.loads(real.read_text())
    assert set(after["mcpServers"]) == {"gated"} and after["globalShortcut"] == "Ctrl+Space"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    backup = Path(f"{link}.agentgate-backup")  # beside the link, the path init was given
    assert not backup.is_symlink() and backup.read_bytes() == before
    assert f"wrote {real}; it was kept as {backup}" in done.stdout
    assert sorted(p.name for p in link.parent.iterdir()) == [link.name, backup.name]
    assert sorted(p.name for p in real.parent.iterdir()) == [real.name]
