"""agentgate's command line: help, pin, check, and reading files only this user can change.

Ported from the reference suite (agentrt-tests.md):
- cli_test.go TestCLI_HelpStatesTheScope, TestCLI_PinAndCheck -> the tests below.
  Difference on purpose: agentgate finds its config at $AGENTGATE_CONFIG or the XDG path when
  -config is missing, so `pin` with no arguments and no config file is an error (exit 1), not a
  usage error; an unknown flag is the usage error (exit 2).
- file_test.go TestReadOwned_RefusesAFileOthersCanWrite -> test_manifest_readable_only_if_nobody_else_can_write
  and test_config_others_can_write_is_refused.
N/A here:
- file_test.go TestReadRules_*: agentgate has no separate rules file (rules live in the config,
  whose field checks belong to the config tests).
- cli_test.go TestProcess_* and recheck_test.go: restart, crash and recheck behaviour across
  processes belongs to later work (approvals collected, rules across calls, recheck).
"""

import json
import os
import re
import stat

import pytest

from kit import SESSION, agentgate, bank, bank_server, check, pin, write_config


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_help_states_the_scope():
    done = agentgate("-h")
    assert done.returncode == 0
    usage = normalised(done.stderr)
    for fragment in (
        "governs only the calls that go through it.",
        "one person who is both the host's user and the operator; it does not separate them",
        "can approve its own request with the operator command or by editing the database.",
        "it reads nothing of the conversation.",
        "refuses a deliberate identical repeat",
        "The pin covers what a server presents, not what it does.",
        "-config FILE",
    ):
        assert fragment in usage, f"usage lacks {fragment!r}:\n{done.stderr}"
    assert done.stdout == ""


def test_pin_without_a_config_fails_and_an_unknown_flag_is_a_usage_error(tmp_path):
    env = {"AGENTGATE_CONFIG": None, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    done = agentgate("pin", env=env)
    assert done.returncode == 1, done.stderr
    assert "error:" in done.stderr and str(tmp_path / "xdg" / "agentgate" / "config.json") in done.stderr
    assert "Traceback" not in done.stderr

    done = agentgate("pin", "-nope", env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr

    done = agentgate("no-such-command", env=env)
    assert done.returncode == 2, done.stderr


def test_pin_and_check(workdir):
    config = write_config(workdir, [bank_server(workdir, rules={"refund": None})])
    first = pin(config)
    manifest = workdir / "bank.manifest.json"
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    assert "3 tools pinned" in first.stdout

    again = pin(config)  # pinning again rewrites the manifest, still private
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    lines = again.stdout.splitlines()
    assert "3 tools pinned" in lines[0] and str(manifest) in lines[0]
    by_tool = {line.split()[0]: line for line in lines[1:-1]}
    assert set(by_tool) == {"balance", "pay", "refund"}
    assert "readOnly" in by_tool["balance"]
    assert "claims nothing" in by_tool["pay"]  # destructiveHint false is a claim of nothing
    assert "no annotations" in by_tool["refund"]
    assert "Read the balance of an account." in by_tool["balance"]

    done = check(config)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "registered balance as bank_balance (read_only)" in out
    assert "registered pay as bank_pay (remote_mutation)" in out
    assert "unclassified refund: no rule" in out
    assert "status tool: gate_status" in out
    assert f"session: {SESSION}" in out
    assert f"database: {workdir / 'runs.db'}" in out

    empty = write_config(workdir, [bank_server(workdir, rules={"balance": None, "pay": None, "refund": None})],
                         name="empty.json")
    done = check(empty)
    assert done.returncode == 1
    assert "no tool registered" in done.stderr
    # the report up to the failure is still printed
    assert "unclassified balance: no rule" in done.stdout


@pytest.mark.parametrize("mode, readable", [
    (0o600, True), (0o644, True), (0o444, True),
    (0o620, False), (0o602, False), (0o666, False),
])
def test_manifest_readable_only_if_nobody_else_can_write(workdir, mode, readable):
    config = bank(workdir)
    manifest = workdir / "bank.manifest.json"
    manifest.chmod(mode)
    done = check(config)
    if readable:
        assert done.returncode == 0, done.stderr
        assert "registered balance as bank_balance" in done.stdout
    else:
        assert done.returncode == 1
        assert str(manifest) in done.stderr
        assert stat.filemode(stat.S_IFREG | mode) in done.stderr  # e.g. -rw--w----
        assert "manifest" in done.stderr


def test_manifest_that_is_a_directory_is_refused(workdir):
    config = write_config(workdir, [bank_server(workdir, manifest="bank.d")])
    (workdir / "bank.d").mkdir()
    done = check(config)
    assert done.returncode == 1
    assert "not a regular file" in done.stderr


def test_config_others_can_write_is_refused(workdir):
    config = write_config(workdir, [bank_server(workdir)])
    os.chmod(config, 0o666)
    done = check(config)
    assert done.returncode == 1
    assert str(config) in done.stderr and "-rw-rw-rw-" in done.stderr
    assert "Traceback" not in done.stderr


def test_pin_writes_what_the_server_presents(workdir):
    config = bank(workdir)
    manifest = json.loads((workdir / "bank.manifest.json").read_text())
    assert manifest["server"] == "bank" and manifest["pinned_at"]
    assert sorted(manifest["tools"]) == ["balance", "pay", "refund"]
    assert manifest["tools"]["balance"]["annotations"] == {"readOnlyHint": True}
    assert "annotations" not in manifest["tools"]["refund"]
    assert config.exists()


def test_version_prints_the_version_and_nothing_else():
    for flag in ("-version", "--version"):
        done = agentgate(flag)
        assert done.returncode == 0 and done.stderr == "", done
        assert re.fullmatch(r"agentgate \d+\.\d+\.\d+\n", done.stdout), done.stdout
