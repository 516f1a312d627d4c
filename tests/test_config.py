"""The configuration file, the files it trusts, the reach check and the policy identity.

Specification: reference section 13 and 3.5, SPEC "Configuration". Ported from the reference
suite: proxy/config_test.go (TestConfig_RefusesUnknownFields, _RefusesAnUnsafeSessionName,
_DefaultsAndRelativePaths, _RefusesFilesOthersCanWrite, _RefusesWhatCouldReadTwoWays,
_RefusesAServerThatReachesTheProxysFiles, _ReachCheckReadsCommonSpellings), proxy's
TestConfig_PolicyIDCoversWhatThePolicyDecidesFrom, mcp/file_test.go's
TestReadOwned_RefusesAFileOthersCanWrite, and mcp/transport_test.go's
TestServer_RejectsMalformedEnv. Not ported here: TestProxy_StatusToolNameClashRefused and the
manifest half of _RefusesFilesOthersCanWrite (they need a loaded server: gate tests), and
TestReadRules_* (agentgate keeps rules inside the config; their refusals are covered below).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402

ConfigError = agentgate.ConfigError
SECOND = 10**9

MINIMAL = {
    "database": "runs.db",
    "session": "s",
    "servers": [{"name": "bank", "command": ["x"], "manifest": "m.json",
                 "rules": {"pay": {"side_effect": "remote_mutation"}}}],
}


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.chmod(0o600)
    path.write_text(text)
    path.chmod(mode)
    return path


def write_config(directory: Path, doc, mode: int = 0o600, name: str = "config.json") -> Path:
    """A config file (and an empty pinned manifest beside it, as pin would leave it)."""
    text = doc if isinstance(doc, str) else json.dumps(doc)
    write(directory / "m.json", '{"server":"bank","tools":{}}')
    return write(directory / name, text, mode)


def variant(change) -> dict:
    doc = copy.deepcopy(MINIMAL)
    change(doc)
    return doc


def refused(path: Path) -> str:
    """The ConfigError message load_config gives for `path` (a failure if it loads)."""
    with pytest.raises(ConfigError) as caught:
        agentgate.load_config(str(path))
    return str(caught.value)


def assert_one_sentence_naming(message: str, *names: str) -> None:
    assert "\n" not in message, message
    assert not re.search(r"[.!?]\s+[A-Z]", message), f"more than one sentence: {message}"
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"


# ---------------------------------------------------------------- TestConfig_RefusesUnknownFields


def test_the_minimal_config_loads(workdir):
    config = agentgate.load_config(str(write_config(workdir, MINIMAL)))
    assert isinstance(config, agentgate.Config)
    assert config.session == "s"
    assert [s.name for s in config.servers] == ["bank"]
    assert config.servers[0].command == ["x"]
    assert config.servers[0].rules["pay"].side_effect == "remote_mutation"


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(hold_for="1s"), "hold_for"),
        (lambda d: d["servers"][0].update(manifets="m.json"), "manifets"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(denny=["memo"]), "denny"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(tiemout="1s"), "tiemout"),
        (lambda d: d.update(policy={"read_only": "maybe"}), "read_only"),
        (lambda d: d.update(policy={"remote_mutation": "abort"}), "remote_mutation"),
        (lambda d: d.update(policy={"reed_only": "allow"}), "reed_only"),
        (lambda d: d.update(hold=15), "hold"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(outcome="ask"), "outcome"),
    ],
)
def test_unknown_fields_and_values_are_refused_naming_the_field(workdir, change, field):
    message = refused(write_config(workdir, variant(change)))
    assert_one_sentence_naming(message, field)


def test_trailing_data_after_the_configuration_is_refused(workdir):
    message = refused(write_config(workdir, json.dumps(MINIMAL) + " {}"))
    assert_one_sentence_naming(message, str(workdir / "config.json"))


def test_a_duration_given_as_a_number_says_what_a_duration_is(workdir):
    message = refused(write_config(workdir, variant(lambda d: d.update(hold=15))))
    assert '"15s"' in message


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.pop("database"), "database"),
        (lambda d: d.pop("session"), "session"),
        (lambda d: d.update(servers=[]), "servers"),
        (lambda d: d["servers"][0].pop("manifest"), "manifest"),
        (lambda d: d["servers"][0].pop("command"), "command"),
        (lambda d: d["servers"][0].update(command="x"), "command"),
        (lambda d: d["servers"][0].update(command=[]), "command"),
        (lambda d: d["servers"][0].update(name="bad name"), "name"),
        (lambda d: d["servers"].append(copy.deepcopy(d["servers"][0])), "bank"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(side_effect="read"), "side_effect"),
        (lambda d: d["servers"][0]["rules"]["pay"].pop("side_effect"), "side_effect"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(timeout="5"), "timeout"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(timeout=5), "timeout"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(deny="memo"), "deny"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(fixed=["memo"]), "fixed"),
        (lambda d: d["servers"][0]["rules"]["pay"].update(repeat_window="1d"), "repeat_window"),
        (lambda d: d["servers"][0].update(env=["NOEQUALS"]), "env"),
        (lambda d: d["servers"][0].update(env=["=v"]), "env"),
        (lambda d: d["servers"][0].update(inherit_env=["A=B"]), "inherit_env"),
        (lambda d: d["servers"][0].update(inherit_env=[""]), "inherit_env"),
        (lambda d: d["servers"][0].update(skip_path_check="yes"), "skip_path_check"),
        (lambda d: d["servers"][0].update(connect_timeout="soon"), "connect_timeout"),
        (lambda d: d.update(hold="-1s"), "hold"),
        (lambda d: d.update(repeat_window="10"), "repeat_window"),
        (lambda d: d.update(approval_ttl=86400), "approval_ttl"),
        (lambda d: d.update(grant_ttl="1 day"), "grant_ttl"),
        (lambda d: d.update(max_pending=-1), "max_pending"),
        (lambda d: d.update(max_pending=1.5), "max_pending"),
        (lambda d: d.update(max_pending="5"), "max_pending"),
        (lambda d: d.update(status_tool="gate status"), "status_tool"),
        (lambda d: d.update(policy=["allow"]), "policy"),
    ],
)
def test_each_refusal_is_one_sentence_naming_its_field(workdir, change, field):
    message = refused(write_config(workdir, variant(change)))
    assert_one_sentence_naming(message, field)


def test_the_whole_document_must_be_an_object(workdir):
    refused(write_config(workdir, "[]"))


# ---------------------------------------------------------------- TestConfig_RefusesAnUnsafeSessionName


@pytest.mark.parametrize("session", ["", "a b", "../x", "a.b", "x;rm", "\u00e9", "a" * 65, "a\nb"])
def test_an_unsafe_session_name_is_refused(workdir, session):
    message = refused(write_config(workdir, variant(lambda d: d.update(session=session))))
    assert_one_sentence_naming(message, "session")


@pytest.mark.parametrize("session", ["a", "A-z_09", "a" * 64])
def test_a_safe_session_name_is_accepted(workdir, session):
    config = agentgate.load_config(str(write_config(workdir, variant(lambda d: d.update(session=session)))))
    assert config.session == session


# ---------------------------------------------------------------- TestConfig_DefaultsAndRelativePaths


def test_defaults_and_paths_relative_to_the_configs_directory(workdir, tmp_path, monkeypatch):
    config_dir = workdir / "conf"
    path = write_config(config_dir, MINIMAL)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative paths must not follow the working directory
    config = agentgate.load_config(os.path.relpath(path))
    assert config.database in (str(config_dir / "runs.db"), os.path.realpath(config_dir / "runs.db"))
    manifest = config.servers[0].manifest
    assert os.path.isabs(manifest) and manifest.endswith("/m.json")
    assert os.path.dirname(manifest) in (str(config_dir), os.path.realpath(config_dir))
    assert config.hold == 15 * SECOND
    assert config.repeat_window == 600 * SECOND
    assert config.max_pending == 5
    assert config.approval_ttl == 86400 * SECOND
    assert config.grant_ttl == 86400 * SECOND
    assert config.lease_ttl == 30 * SECOND
    assert config.status_tool == "gate_status"
    assert config.policy == {"read_only": "allow", "local_mutation": "allow",
                             "remote_mutation": "require_approval", "destructive": "deny"}
    for value in (config.hold, config.repeat_window, config.approval_ttl, config.grant_ttl, config.lease_ttl):
        assert type(value) is int  # integer nanoseconds


def test_durations_are_read_as_go_durations_into_nanoseconds(workdir):
    doc = variant(lambda d: d.update(hold="0", repeat_window="1h30m", approval_ttl="0s", grant_ttl="1s500ms",
                                     lease_ttl="3s", max_pending=0))
    doc["servers"][0]["rules"]["pay"]["timeout"] = "300ms"
    config = agentgate.load_config(str(write_config(workdir, doc)))
    assert config.hold == 0
    assert config.repeat_window == 5400 * SECOND
    assert config.approval_ttl == 0
    assert config.grant_ttl == 1500 * 10**6
    assert config.lease_ttl == 3 * SECOND
    assert config.max_pending == 5  # 0 means the default
    assert config.servers[0].rules["pay"].timeout == 300 * 10**6


def test_an_absolute_database_path_is_kept(workdir):
    target = workdir / "elsewhere" / "gate.db"
    config = agentgate.load_config(str(write_config(workdir / "c", variant(lambda d: d.update(database=str(target))))))
    assert config.database == str(target)


def test_a_policy_overlays_the_default(workdir):
    config = agentgate.load_config(str(write_config(workdir, variant(lambda d: d.update(policy={"read_only": "deny"})))))
    assert config.policy == {"read_only": "deny", "local_mutation": "allow",
                             "remote_mutation": "require_approval", "destructive": "deny"}


# ---------------------------------------------------------------- where the config comes from


def test_config_path_prefers_the_flag(monkeypatch):
    monkeypatch.setenv("AGENTGATE_CONFIG", "/env/config.json")
    monkeypatch.setenv("XDG_CONFIG_HOME", "/xdg")
    assert agentgate.config_path("/given.json") == "/given.json"


def test_config_path_then_the_environment(monkeypatch):
    monkeypatch.setenv("AGENTGATE_CONFIG", "/env/config.json")
    monkeypatch.setenv("XDG_CONFIG_HOME", "/xdg")
    assert agentgate.config_path(None) == "/env/config.json"
    assert agentgate.config_path("") == "/env/config.json"


def test_config_path_then_xdg(monkeypatch):
    monkeypatch.delenv("AGENTGATE_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", "/xdg")
    assert agentgate.config_path(None) == "/xdg/agentgate/config.json"


def test_config_path_then_home(monkeypatch, workdir):
    monkeypatch.delenv("AGENTGATE_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(workdir))
    assert agentgate.config_path(None) == str(workdir / ".config" / "agentgate" / "config.json")


# ---------------------------------------------------------------- TestConfig_RefusesFilesOthersCanWrite


def test_a_config_others_can_write_is_refused_naming_its_path(workdir):
    path = write_config(workdir, MINIMAL, mode=0o666)
    message = refused(path)
    assert_one_sentence_naming(message, str(path), "-rw-rw-rw-")


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_config_its_group_or_others_can_write_is_refused(workdir, mode):
    refused(write_config(workdir, MINIMAL, mode=mode))


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o400])
def test_a_config_only_its_owner_can_write_is_accepted(workdir, mode):
    agentgate.load_config(str(write_config(workdir, MINIMAL, mode=mode)))


def test_a_missing_config_is_refused_naming_its_path(workdir):
    message = refused(workdir / "absent.json")
    assert str(workdir / "absent.json") in message


def test_a_config_that_is_a_symbolic_link_is_refused(workdir):
    real = write_config(workdir, MINIMAL)
    link = workdir / "link.json"
    link.symlink_to(real)
    assert "symbolic link" in refused(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_config_owned_by_another_user_is_refused(workdir):
    path = write_config(workdir, MINIMAL)
    os.chown(path, 4242, -1)
    message = refused(path)
    assert "4242" in message and str(path) in message


def test_a_database_that_is_a_symbolic_link_is_refused(workdir):
    real = write(workdir / "real.db", "")
    link = workdir / "runs.db"
    link.symlink_to(real)
    with pytest.raises(ConfigError) as caught:
        agentgate.check_database_path(str(link))
    assert "symbolic link" in str(caught.value)
    assert str(link) in str(caught.value)


def test_a_database_others_can_write_is_refused(workdir):
    path = write(workdir / "runs.db", "", 0o646)
    with pytest.raises(ConfigError) as caught:
        agentgate.check_database_path(str(path))
    assert_one_sentence_naming(str(caught.value), "database", str(path), "-rw-r--rw-")


def test_a_database_that_is_not_a_regular_file_is_refused(workdir):
    (workdir / "runs.db").mkdir()
    with pytest.raises(ConfigError) as caught:
        agentgate.check_database_path(str(workdir / "runs.db"))
    assert "not a regular file" in str(caught.value)


def test_a_missing_or_private_database_is_fine(workdir):
    agentgate.check_database_path(str(workdir / "runs.db"))
    agentgate.check_database_path(str(write(workdir / "runs.db", "", 0o600)))
    agentgate.check_database_path(str(write(workdir / "runs.db", "", 0o644)))


# ---------------------------------------------------------------- TestReadOwned_RefusesAFileOthersCanWrite


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o444])
def test_read_owned_reads_a_file_only_its_owner_can_write(workdir, mode):
    path = write(workdir / "m.json", '{"tools":{}}', mode)
    assert agentgate.read_owned(str(path), "manifest") == b'{"tools":{}}'


@pytest.mark.parametrize("mode, shown", [(0o620, "-rw--w----"), (0o602, "-rw-----w-"), (0o666, "-rw-rw-rw-")])
def test_read_owned_refuses_a_file_others_can_write(workdir, mode, shown):
    path = write(workdir / "m.json", "{}", mode)
    with pytest.raises(ConfigError) as caught:
        agentgate.read_owned(str(path), "manifest")
    assert_one_sentence_naming(str(caught.value), "manifest", str(path), shown)


def test_read_owned_refuses_a_directory(workdir):
    with pytest.raises(ConfigError) as caught:
        agentgate.read_owned(str(workdir), "manifest")
    assert "not a regular file" in str(caught.value)


def test_read_owned_refuses_a_symbolic_link(workdir):
    real = write(workdir / "real.json", "{}")
    (workdir / "m.json").symlink_to(real)
    with pytest.raises(ConfigError) as caught:
        agentgate.read_owned(str(workdir / "m.json"), "manifest")
    assert "symbolic link" in str(caught.value)


# ---------------------------------------------------------------- TestConfig_RefusesWhatCouldReadTwoWays


def test_a_repeated_key_is_refused(workdir):
    text = '{"session":"a","session":"b","database":"runs.db","servers":[]}'
    assert 'duplicate key "session"' in refused(write_config(workdir, text))


def test_a_repeated_key_inside_a_rule_is_refused(workdir):
    text = json.dumps(MINIMAL).replace('"side_effect": "remote_mutation"',
                                       '"side_effect": "read_only", "side_effect": "remote_mutation"')
    assert 'duplicate key "side_effect"' in refused(write_config(workdir, text))


def test_a_repeated_key_spelled_with_an_escape_is_refused(workdir):
    text = json.dumps(MINIMAL)[:-1] + ', "s\\u0065ssion": "other"}'
    assert 'duplicate key "session"' in refused(write_config(workdir, text))


def test_a_lease_ttl_under_3s_is_refused_and_3s_is_the_shortest(workdir):
    message = refused(write_config(workdir, variant(lambda d: d.update(lease_ttl="1s"))))
    assert_one_sentence_naming(message, "lease_ttl", "1s", "3s")
    config = agentgate.load_config(str(write_config(workdir, variant(lambda d: d.update(lease_ttl="3s")))))
    assert config.lease_ttl == 3 * SECOND


def test_a_number_past_the_bound_is_refused(workdir):
    text = json.dumps(MINIMAL)[:-1] + ', "max_pending": 1e-10000000}'
    assert "not usable JSON" in refused(write_config(workdir, text))


def test_a_manifest_with_a_repeated_key_is_refused(workdir):
    config = agentgate.load_config(str(write_config(workdir, MINIMAL)))
    write(workdir / "m.json", '{"server":"bank","server":"bank","tools":{}}')
    with pytest.raises((agentgate.LoadError, ConfigError)) as caught:
        agentgate.read_manifest(config.servers[0])
    assert "duplicate key" in str(caught.value)


# ---------------------------------------------------------------- the reach check

# The gate's own files: <home>/proxy/{config.json, runs.db (not yet created), m.json}; a
# sandbox the servers may use: <home>/sandbox.


@pytest.fixture
def home(workdir, monkeypatch):
    (workdir / "proxy").mkdir()
    (workdir / "sandbox").mkdir()
    monkeypatch.setenv("HOME", str(workdir))
    return workdir


def reach_config(directory: Path, args, skip=False, name="config.json"):
    server = {"name": "fs", "command": ["server", *args], "manifest": "m.json", "rules": {}}
    if skip:
        server["skip_path_check"] = True
    doc = {"database": "runs.db", "session": "s", "servers": [server]}
    return agentgate.load_config(str(write_config(directory, doc, name=name)))


def reach_refused(directory: Path, args) -> str:
    config = reach_config(directory, args)
    with pytest.raises(ConfigError) as caught:
        agentgate.check_reach(config)
    message = str(caught.value)
    assert_one_sentence_naming(message, "skip_path_check", '"fs"')
    return message


def reach_allowed(directory: Path, args, skip=False) -> None:
    agentgate.check_reach(reach_config(directory, args, skip))


def test_a_server_that_reaches_the_gates_files_is_refused(home):
    proxy = home / "proxy"
    (home / "link").symlink_to(proxy)
    for args in ([str(proxy)], [str(proxy) + "/"], [str(home / "link")], [f"--root={proxy}"], [str(home)],
                 [str(proxy / "runs.db")], [str(proxy / "m.json")], [str(proxy / "config.json")], ["/"]):
        message = reach_refused(proxy, args)
        assert args[0] in message


def test_the_refusal_names_the_argument_and_what_it_reaches(home):
    proxy = home / "proxy"
    message = reach_refused(proxy, ["--verbose", f"--root={proxy}"])
    assert f'"--root={proxy}"' in message
    assert str(proxy) in message


def test_an_existing_database_is_protected_through_any_link(home):
    proxy = home / "proxy"
    write(proxy / "runs.db", "")
    (home / "sandbox" / "db-link").symlink_to(proxy / "runs.db")
    (home / "sandbox" / "hard.db").hardlink_to(proxy / "runs.db")
    reach_refused(proxy, [str(home / "sandbox" / "db-link")])
    reach_refused(proxy, [str(home / "sandbox" / "hard.db")])


def test_a_server_pointed_elsewhere_is_accepted(home):
    reach_allowed(home / "proxy", [str(home / "sandbox"), "--flag", "not-a-path"])


def test_skip_path_check_accepts_a_server_that_reaches_the_gates_files(home):
    reach_allowed(home / "proxy", [str(home / "proxy")], skip=True)


def test_a_command_with_no_arguments_is_not_checked(home):
    reach_allowed(home / "proxy", [])


@pytest.mark.parametrize("spelling", ["~", "~/", "~/proxy", "~/proxy/runs.db", "-r{dir}", "--root:{dir}",
                                      "file://{dir}", "file://{dir}/", "--root=file://{dir}", "file:{dir}",
                                      "--root=~/proxy"])
def test_the_reach_check_reads_common_spellings(home, spelling):
    reach_refused(home / "proxy", [spelling.format(dir=home / "proxy")])


@pytest.mark.parametrize("relative", [".", "./", "proxy", "proxy/runs.db", "./proxy/m.json", "--root=."])
def test_relative_arguments_are_read_from_the_servers_directory(home, relative):
    # A server runs in the user's home (never in the config's directory), so a relative
    # argument is read from there: "." is the home, above the gate's files.
    reach_refused(home / "proxy", [relative])


@pytest.mark.parametrize("relative", ["runs.db", "m.json", "config.json"])
def test_a_relative_name_of_a_gate_file_is_not_the_gate_file(home, relative):
    # The same names, read from the home the server runs in, are other files.
    reach_allowed(home / "proxy", [relative])


def test_a_configured_cwd_is_reach_checked(home):
    for cwd in (".", str(home / "proxy"), "~"):
        server = {"name": "fs", "command": ["server"], "cwd": cwd, "manifest": "m.json", "rules": {}}
        doc = {"database": "runs.db", "session": "s", "servers": [server]}
        config = agentgate.load_config(str(write_config(home / "proxy", doc)))
        with pytest.raises(ConfigError) as caught:
            agentgate.check_reach(config)
        assert_one_sentence_naming(str(caught.value), "cwd", '"fs"')
    server = {"name": "fs", "command": ["server"], "cwd": str(home / "sandbox"), "manifest": "m.json", "rules": {}}
    doc = {"database": "runs.db", "session": "s", "servers": [server]}
    agentgate.check_reach(agentgate.load_config(str(write_config(home / "proxy", doc))))


def test_a_percent_encoded_file_url_is_read_as_its_path(home):
    # A file: URL's path is percent-decoded ("my proxy" is written my%20proxy in a URL).
    proxy = home / "my proxy"
    proxy.mkdir()
    reach_refused(proxy, [f"file://{home}/my%20proxy"])


def test_an_upper_case_spelling_is_refused_on_a_case_insensitive_filesystem(home):
    proxy = home / "proxy"
    upper = Path(str(proxy).upper())
    if not upper.exists() or not os.path.samefile(upper, proxy):
        pytest.skip("this filesystem is case-sensitive")
    reach_refused(proxy, [str(upper)])


@pytest.mark.parametrize(
    "args",
    [["{sandbox}"], ["~/sandbox"], ["-r{sandbox}", "--root:{sandbox}", "file://{sandbox}"],
     ["--flag", "not-a-path", "-v", "-p8080", "--port=8080", "http://localhost:8080/x", "a:b", "--", "-", "~nobody"]],
)
def test_the_reach_check_accepts_what_reaches_elsewhere(home, args):
    reach_allowed(home / "proxy", [a.format(sandbox=home / "sandbox") for a in args])


# ---------------------------------------------------------------- TestConfig_PolicyIDCoversWhatThePolicyDecidesFrom


POLICY_BASE = {
    "database": "runs.db",
    "session": "s",
    "servers": [{"name": "bank", "command": ["node", "bank.js"], "manifest": "m.json", "default_timeout": "5s",
                 "rules": {"balance": {"side_effect": "read_only"},
                           "pay": {"side_effect": "remote_mutation", "description": "Pay someone."},
                           "refund": {"side_effect": "remote_mutation"}}}],
}


def policy_id(workdir: Path, change=None, name="base") -> str:
    doc = copy.deepcopy(POLICY_BASE)
    if change:
        change(doc)
    return agentgate.load_config(str(write_config(workdir, doc, name=f"{name}.json"))).policy_id()


def pay(doc) -> dict:
    return doc["servers"][0]["rules"]["pay"]


def test_the_policy_id_names_its_form(workdir):
    assert re.fullmatch(r"agentgate/sha256:[0-9a-f]{64}", policy_id(workdir))


def test_the_policy_id_is_stable(workdir):
    assert policy_id(workdir, name="one") == policy_id(workdir, name="two")


@pytest.mark.parametrize(
    "change",
    [
        lambda d: pay(d).update(description="Pay anyone at all."),
        lambda d: pay(d).update(timeout="1m"),
        lambda d: pay(d).update(deny=["memo"]),
        lambda d: pay(d).update(repeat_window="1m"),
        lambda d: pay(d).update(allow_hint_mismatch=True),
        lambda d: d.update(hold="5s"),
        lambda d: d.update(session="other"),
        lambda d: d.update(repeat_window="1m"),
        lambda d: d.update(max_pending=2),
        lambda d: d.update(approval_ttl="1h", grant_ttl="2h", lease_ttl="10s"),
        lambda d: d.update(database="other.db"),
        lambda d: d.update(status_tool="bank_status"),
        lambda d: d["servers"][0].update(command=["python3", "other.py", "--flag"]),
        lambda d: d["servers"][0].update(default_timeout="1m", connect_timeout="1s"),
        lambda d: d["servers"][0].update(env=["A=b"], inherit_env=["LANG"], skip_path_check=True),
        lambda d: d.update(policy={"read_only": "allow"}),
        lambda d: d.update(policy={"read_only": "allow", "local_mutation": "allow",
                                   "remote_mutation": "require_approval", "destructive": "deny"}),
    ],
)
def test_the_policy_id_ignores_what_the_policy_does_not_decide_from(workdir, change):
    assert policy_id(workdir, change, "changed") == policy_id(workdir)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(policy={"read_only": "deny"}),
        lambda d: pay(d).update(side_effect="local_mutation"),
        lambda d: pay(d).update(outcome="allow"),
        lambda d: pay(d).update(rename="pay"),
        lambda d: pay(d).update(fixed={"memo": "x"}),
        lambda d: d["servers"][0].update(name="bank2"),
        lambda d: d["servers"][0]["rules"].pop("refund"),
    ],
)
def test_the_policy_id_covers_what_the_policy_decides_from(workdir, change):
    assert policy_id(workdir, change, "changed") != policy_id(workdir)


def test_the_policy_id_tells_fixed_values_apart_by_literal(workdir):
    ten = policy_id(workdir, lambda d: pay(d).update(fixed={"amount": 10}), "ten")
    assert ten != policy_id(workdir)
    text = json.dumps(POLICY_BASE).replace('"description": "Pay someone."',
                                           '"description": "Pay someone.", "fixed": {"amount": 10.0}')
    ten_point_zero = agentgate.load_config(str(write_config(workdir, text, name="tenpoint.json"))).policy_id()
    assert ten_point_zero != ten


def test_the_policy_id_does_not_depend_on_the_order_of_servers_or_rules(workdir):
    second = {"name": "files", "command": ["fs"], "manifest": "f.json",
              "rules": {"read": {"side_effect": "read_only"}, "write": {"side_effect": "local_mutation"}}}
    forward = policy_id(workdir, lambda d: d["servers"].append(copy.deepcopy(second)), "forward")

    def backward(doc):
        rules = doc["servers"][0]["rules"]
        doc["servers"][0]["rules"] = dict(reversed(list(rules.items())))
        doc["servers"].insert(0, copy.deepcopy(second))

    assert policy_id(workdir, backward, "backward") == forward


def test_a_config_path_naming_a_directory_is_refused(workdir):
    message = refused(workdir)
    assert "not a regular file" in message and str(workdir) in message
