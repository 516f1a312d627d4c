"""Every command README.md shows, exercised (issue 6, item 2).

The README is read, not copied: its code blocks are extracted, every command line in them is
listed and compared with the set this file exercises (a command the README gains and this file
does not know fails `test_every_command_the_readme_shows_is_exercised`), and each test takes
the command it runs from the README text itself.

- `python3 agentgate.py demo` runs and its narration is checked.
- The quickstart runs as a newcomer would, in a temporary HOME: the copy into ~/bin, the
  config at the default path (the README's JSON, with `npx -y` replaced by the locally
  installed filesystem server, since npx needs the network), `chmod 600`, pin, check, the
  host's snippet started by the MCP Python SDK exactly as Claude Desktop / Cursor would start
  it, what the model sees, `runs`, and `approve` with the ids agentgate wrote on its stderr.
- The operator verbs the prose names (`reject RUN -note TEXT`, `cancel RUN`, `show RUN`,
  `verify`, `recheck`) run against a real waiting request.
- What cannot run here is checked for form and for equivalence with what is tested:
  `claude mcp add` (needs the Claude Code CLI, and would change the user's own settings) and
  `bash tests/setup.sh && python3 -m pytest -q -n 3 tests` (needs the network, and runs this suite).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import threading
from contextlib import suppress
from pathlib import Path

from conftest import AGENTGATE, NODE_MODULES, REPO, Host, filesystem_server_argv, wait_for
from kit import result_text, run_to_end, wait_no_process

README = REPO / "README.md"
FS_PACKAGE = "@modelcontextprotocol/server-filesystem"
PLACEHOLDER_HOME = "/home/you"  # the README's JSON spells the user's home this way

# Every command line of the README's code blocks, and the test that exercises it.
EXERCISED = {
    "python3 agentgate.py demo": "test_the_demo_narrates_every_step",
    "bash tests/setup.sh && python3 -m pytest -q -n 3 tests": "test_the_install_and_test_command_is_well_formed",
    "mkdir -p ~/bin && cp agentgate.py ~/bin/agentgate.py": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "python3 ~/bin/agentgate.py pin": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "python3 ~/bin/agentgate.py init": "test_quickstart_from_the_servers_a_host_already_starts",
    "python3 ~/bin/agentgate.py check -accept": "test_quickstart_from_the_servers_a_host_already_starts",
    "python3 ~/bin/agentgate.py pin -diff": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "python3 ~/bin/agentgate.py check": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "claude mcp add -s user gated -- python3 /home/you/bin/agentgate.py": "test_the_host_snippets_agree",
    "python3 ~/bin/agentgate.py runs": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "python3 ~/bin/agentgate.py approve laptop.3f9a0c1d2e4b5a69 -approval 9c0e...":
        "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    'python3 ~/bin/agentgate.py grant bank_pay -if \'{"/amount": {"max": 20}}\' -for 8h -note "errands"':
        "test_the_policy_examples_work_as_written",
    "python3 ~/bin/agentgate.py grants": "test_the_policy_examples_work_as_written",
    "python3 ~/bin/agentgate.py revoke 019a3b4c5d6e7f80": "test_the_policy_examples_work_as_written",
    "python3 ~/bin/agentgate.py login crm":
        "test_oauth_login.py::test_login_keeps_tokens_0600_and_the_gate_serves_the_server",
}
# Commands the prose names in `inline code` (agentgate's verbs, and chmod).
INLINE_EXERCISED = {
    "chmod 600": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "check": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "approve": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "reject RUN -note TEXT": "test_the_operator_verbs_the_prose_names",
    "cancel RUN": "test_the_operator_verbs_the_prose_names",
    "show RUN": "test_the_operator_verbs_the_prose_names",
    "verify": "test_the_operator_verbs_the_prose_names",
    "recheck": "test_the_operator_verbs_the_prose_names",
    "show": "test_the_policy_examples_work_as_written",
    "grant": "test_the_policy_examples_work_as_written",
    "grants": "test_the_policy_examples_work_as_written",
    "revoke": "test_the_policy_examples_work_as_written",
    "approve 3f9a0c1d2e": "test_quickstart_from_the_servers_a_host_already_starts",
    "init": "test_quickstart_from_the_servers_a_host_already_starts",
    "watch": "test_quickstart_from_the_servers_a_host_already_starts",
    "pin": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "runs": "test_quickstart_from_nothing_to_a_gated_filesystem_server",
    "approve laptop.3f9a0c1d2e": "test_quickstart_from_the_servers_a_host_already_starts",
    "login crm": "test_oauth_login.py::test_a_refused_refresh_is_not_served_and_says_to_run_login",
    "login": "test_oauth_login.py::test_login_keeps_tokens_0600_and_the_gate_serves_the_server",
}
AGENTGATE_VERBS = {"serve", "init", "watch", "pin", "check", "runs", "show", "approve", "reject", "cancel", "verify", "recheck", "demo",
                   "grant", "grants", "revoke", "login"}
HOST_SNIPPETS = {"Claude Desktop", "Cursor"}
APPROVAL_HINT = re.compile(r"decide with: (.*) approve (\S+) -approval ([0-9a-f]+)")


# ---------------------------------------------------------------- reading the README


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def code_blocks(text: str) -> list[dict]:
    """Fenced and indented code blocks, in order: {kind, lang, lines, before}, where `before`
    is the last prose line above the block."""
    blocks, lines, i, before = [], text.splitlines(), 0, ""
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+|~~~+)\s*(\S*)", line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].startswith(fence.group(1)):
                end += 1
            blocks.append({"kind": "fenced", "lang": fence.group(2).lower(), "lines": lines[i + 1:end], "before": before})
            i = end + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            blocks.append({"kind": "indented", "lang": "", "lines": body, "before": before})
            continue
        if line.strip():
            before = line.strip()
        i += 1
    return blocks


def is_flow_diagram(block: dict) -> bool:
    """The README's picture of the gate ("record it -> check ... -> record the outcome")."""
    lines = [line.strip() for line in block["lines"] if line.strip()]
    return block["kind"] == "indented" and bool(lines) and all("->" in line and not line.startswith("python") for line in lines)


def command_lines(text: str) -> list[str]:
    """Every line of every non-JSON code block, except the flow diagram."""
    found = []
    for block in code_blocks(text):
        if block["lang"] == "json" or is_flow_diagram(block):
            continue
        found += [line.strip() for line in block["lines"] if line.strip()]
    return found


def json_blocks(text: str) -> list[tuple[str, object]]:
    """(the prose line above it, parsed value) of each ```json block."""
    return [(b["before"], json.loads("\n".join(b["lines"]))) for b in code_blocks(text) if b["lang"] == "json"]


def inline_commands(text: str) -> list[str]:
    """`inline code` in the prose that is an agentgate verb (with its arguments) or chmod."""
    spans = re.findall(r"`([^`\n]+)`", _without_blocks(text))
    return [s for s in spans if s.split()[0] in AGENTGATE_VERBS | {"chmod"}]


def _without_blocks(text: str) -> str:
    kept, in_fence = [], False
    for line in text.splitlines():
        if re.match(r"^(```|~~~)", line):
            in_fence = not in_fence
            continue
        if not in_fence and not line.startswith("    "):
            kept.append(line)
    return "\n".join(kept)


def readme_command(prefix: str) -> str:
    """The one README command line that starts with `prefix`."""
    lines = command_lines(readme_text())
    found = [line for line in lines if line == prefix] or [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, f"README has {len(found)} command lines starting {prefix!r}: {found}"
    return found[0]


def readme_config() -> dict:
    configs = [value for _, value in json_blocks(readme_text()) if isinstance(value, dict) and "servers" in value]
    assert len(configs) == 1, "README should show exactly one agentgate configuration"
    return configs[0]


def readme_host_snippets() -> dict[str, dict]:
    """Host name (the prose line above the snippet, up to its parenthesis) -> its JSON."""
    return {before.split(" (")[0].rstrip(":"): value for before, value in json_blocks(readme_text())
            if isinstance(value, dict) and "mcpServers" in value}


def readme_model_tools() -> list[str]:
    """The tool names the README says the model sees."""
    match = re.search(r"\*\*What the model sees\.\*\*(.*?)\.\s", readme_text(), re.S)
    assert match, "README has no 'What the model sees.' paragraph"
    return re.findall(r"`([A-Za-z0-9_]+)`", match.group(1))


def readme_default_config_path() -> str:
    match = re.search(r"configuration\*\* at `([^`]+)` \(the default place", readme_text())
    assert match, "README does not name the default configuration path"
    return match.group(1)


# ---------------------------------------------------------------- running commands as a person would


def person_env(home: Path) -> dict:
    """A login-like environment whose HOME and XDG_CONFIG_HOME are temporary directories."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "TMPDIR": str(home.parent / "tmp"), "LANG": "C.UTF-8"}
    for name in ("USER", "LOGNAME", "PYENV_ROOT"):
        if name in os.environ:
            env[name] = os.environ[name]
    (home.parent / "tmp").mkdir(exist_ok=True)
    return env


def sh(command: str, env: dict, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run one README line with bash, as typed at a prompt (so ~ expands)."""
    return run_to_end(["bash", "-c", command], env, cwd, timeout)


def ok(command: str, env: dict, cwd: Path) -> str:
    done = sh(command, env, cwd)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def on_terminal(command: str, env: dict, cwd: Path, reply: str = "yes", timeout: float = 120) -> tuple[int, str, bool]:
    """Run one README line with bash on a pseudo-terminal, as a person pastes it; if it asks to
    "type yes", type `reply`. Returns (exit status, everything shown, whether it asked)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(["bash", "-c", command], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                start_new_session=True)
    finally:
        os.close(slave)
    shown, asked = b"", False
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                raise AssertionError(f"{command!r} showed nothing for {timeout}s:\n{shown.decode(errors='replace')}")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command and its children closed the terminal
                break
            if not data:
                break
            shown += data
            if not asked and b"type yes" in shown:
                asked = True
                os.write(master, reply.encode() + b"\n")
        return proc.wait(timeout), shown.decode(errors="replace").replace("\r\n", "\n"), asked
    finally:
        os.close(master)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------- the list of commands


def test_every_command_the_readme_shows_is_exercised():
    text = readme_text()
    blocks = code_blocks(text)
    assert sum(is_flow_diagram(b) for b in blocks) == 1, "expected exactly one flow diagram block"
    commands = command_lines(text)
    assert len(commands) == len(set(commands)), f"a command line is repeated: {commands}"
    unknown = [c for c in commands if c not in EXERCISED]
    gone = [c for c in EXERCISED if c not in commands]
    assert not unknown, f"README shows commands no test exercises: {unknown}"
    assert not gone, f"tests exercise commands the README no longer shows: {gone}"
    inline = set(inline_commands(text))
    assert inline == set(INLINE_EXERCISED), (
        f"inline commands not exercised: {sorted(inline - set(INLINE_EXERCISED))}; "
        f"exercised but gone: {sorted(set(INLINE_EXERCISED) - inline)}")
    # Every JSON block is the configuration, a host's snippet, or a server's rules (the Policy
    # section), and both hosts are shown.
    for before, value in json_blocks(text):
        assert isinstance(value, dict) and ("servers" in value or "mcpServers" in value or
                                            before.endswith("`rules`:")), f"unknown JSON block after {before!r}"
    readme_config()
    assert set(readme_host_snippets()) == HOST_SNIPPETS


# ---------------------------------------------------------------- the demo


def _run_piped(argv, env, cwd) -> tuple[int, bytes]:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env, cwd=cwd, timeout=170, start_new_session=True)
    return proc.returncode, proc.stdout


def _run_on_a_tty(argv, env, cwd) -> tuple[int, bytes]:
    """Run with stdout (and stderr) on a pseudo-terminal; return its status and every byte written."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                start_new_session=True)
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 170)
            if not ready:
                raise AssertionError("the demo wrote nothing to its terminal for 170 s")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(60), b"".join(chunks)
    finally:
        os.close(master)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


NARRATION = [
    "model sees: account household holds",
    "PENDING_APPROVAL",
    "paid 950.00 to landlord",
    "INTERRUPTED",
    "model sees (isError): REJECTED",
    "model sees (isError): DUPLICATE",
    "through the gate the server made 1 payment",
    "without the gate the server made 2 payments",
    "every process the demo started has exited",
]


def test_the_demo_narrates_every_step(tmp_path):
    argv = shlex.split(readme_command("python3 agentgate.py demo"))
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "AGENTGATE_CONFIG")}
    runs = {
        # (how stdout is connected, NO_COLOR): the output must carry no ESC byte in any of these
        "piped, NO_COLOR": (_run_piped, {"NO_COLOR": "1"}),
        "tty, NO_COLOR": (_run_on_a_tty, {"NO_COLOR": "1"}),
        "piped, colour allowed": (_run_piped, {}),
    }
    results, threads = {}, []
    for i, (name, (runner, extra)) in enumerate(runs.items()):
        tmp = tmp_path / f"tmp{i}"  # the demo's temporary directory lands here, so it can be watched
        tmp.mkdir()
        env = {**base, **extra, "TMPDIR": str(tmp)}

        def go(name=name, runner=runner, env=env):
            try:
                results[name] = runner(argv, env, REPO)
            except BaseException as exc:  # reported below
                results[name] = exc

        threads.append(threading.Thread(target=go))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    for name, result in results.items():
        if isinstance(result, BaseException):
            raise result
    assert set(results) == set(runs), "a demo run did not finish"
    for name, (status, output) in results.items():
        text = output.decode("utf-8", "replace")
        assert status == 0, f"demo ({name}) exited {status}:\n{text}"
        assert b"\x1b" not in output, f"demo ({name}) wrote an escape sequence:\n{text}"
        at = 0
        for phrase in NARRATION:
            found = text.find(phrase, at)
            assert found >= 0, f"demo ({name}): {phrase!r} missing (or out of order) in:\n{text}"
            at = found + len(phrase)
    wait_no_process(tmp_path)


# ---------------------------------------------------------------- the quickstart


class Quickstart:
    """A person's machine in `root`: HOME with ~/bin/agentgate.py, the README's config at the
    default path (fronting the locally installed filesystem server on ~/sandbox), pinned."""

    def __init__(self, root: Path):
        self.home = root / "home"
        self.home.mkdir()
        self.sandbox = self.home / "sandbox"
        self.sandbox.mkdir()
        self.env = person_env(self.home)

        ok(readme_command("mkdir -p ~/bin && cp agentgate.py"), self.env, REPO)
        installed = self.home / "bin" / "agentgate.py"
        assert installed.read_bytes() == AGENTGATE.read_bytes()

        config = readme_config()
        (server,) = config["servers"]
        # The README starts the server with npx (which fetches it from the network); here the
        # same package runs from tests/node_modules, as npx would run its bin, on the same root.
        npx, flag, package, *roots = server["command"]
        assert (npx, flag, package) == ("npx", "-y", FS_PACKAGE)
        assert roots == [f"{PLACEHOLDER_HOME}/sandbox"]
        assert json.loads((NODE_MODULES / FS_PACKAGE / "package.json").read_text())["name"] == FS_PACKAGE
        server["command"] = filesystem_server_argv(self.sandbox)
        self.config = config
        self.rules = dict(server["rules"])

        default = readme_default_config_path()
        assert default == "~/.config/agentgate/config.json"
        self.config_path = self.home / default.removeprefix("~/")
        assert self.config_path == Path(self.env["XDG_CONFIG_HOME"]) / "agentgate" / "config.json"
        self.config_path.parent.mkdir(parents=True)
        self.config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
        ok(f"chmod 600 {shlex.quote(str(self.config_path))}", self.env, self.home)  # as the prose says
        assert self.config_path.stat().st_mode & 0o777 == 0o600

        self.pin_output = ok(readme_command("python3 ~/bin/agentgate.py pin"), self.env, self.home)

    def host(self) -> Host:
        """agentgate started as the Claude Desktop / Cursor snippet says, by the Python SDK client."""
        snippets = readme_host_snippets()
        (entry,) = snippets["Claude Desktop"]["mcpServers"].values()
        argv = [entry["command"], *[arg.replace(PLACEHOLDER_HOME, str(self.home)) for arg in entry["args"]]]
        env = {"HOME": self.env["HOME"], "XDG_CONFIG_HOME": self.env["XDG_CONFIG_HOME"]}
        return Host(argv, env=env, cwd=self.home).start()

    def operator(self, verb_line: str) -> str:
        return operator_line(self.env, self.home, verb_line)


def wait_hint(host: Host, call, seen: int = 0):
    """(invocation, run id, approval id) of approval hint number `seen` on agentgate's stderr,
    which `call` (still waiting for the operator) opened."""
    def next_hint():
        hints = APPROVAL_HINT.findall(host.stderr_text())
        if len(hints) > seen:
            return hints[seen]
        if call.done():
            raise AssertionError(f"the call answered before any approval was opened: {call.result()!r}")
        return None
    return wait_for(next_hint, 60, message="agentgate to name an approval on its stderr")


def test_the_filesystem_server_has_the_tools_the_readme_names(tmp_path):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    with Host(filesystem_server_argv(sandbox)) as direct:
        names = {t.name for t in direct.list_tools()}
    (server,) = readme_config()["servers"]
    assert {"read_text_file", "list_directory", "write_file"} <= names
    assert set(server["rules"]) <= names, f"README classifies tools the server lacks: {set(server['rules']) - names}"
    for name in readme_model_tools():
        if name != readme_config().get("status_tool", "gate_status"):
            assert name.removeprefix(f"{server['name']}_") in names, name


def test_quickstart_from_nothing_to_a_gated_filesystem_server(tmp_path):
    qs = Quickstart(tmp_path)
    assert (qs.config_path.parent / "fs.manifest.json").exists()
    for tool in qs.rules:
        assert re.search(rf"^\s*{tool}\s", qs.pin_output, re.M), f"pin did not list {tool}:\n{qs.pin_output}"

    same = ok(readme_command("python3 ~/bin/agentgate.py pin -diff"), qs.env, qs.home)
    assert same.splitlines()[0] == "server fs: as pinned", same
    checked = ok(readme_command("python3 ~/bin/agentgate.py check"), qs.env, qs.home)
    for tool in qs.rules:
        assert f"registered {tool} as fs_{tool}" in checked, f"check does not register {tool}:\n{checked}"

    (qs.sandbox / "hello.txt").write_text("hello from the sandbox\n")
    with Host(filesystem_server_argv(qs.sandbox)) as direct:
        straight = direct.call("read_text_file", {"path": str(qs.sandbox / "hello.txt")})

    with qs.host() as host:
        assert host.client.server_info.name == "gated-tools"
        listed = [t.name for t in host.list_tools()]
        assert sorted(listed) == sorted(readme_model_tools()), f"offered {listed}\n{host.stderr_text()}"

        # A read answers as the server answered (issue 20: its text blocks and its structured
        # content beside them, as it sent them; before, the JSON of the structured content
        # replaced the text).
        read = host.call("fs_read_text_file", {"path": str(qs.sandbox / "hello.txt")})
        assert not read.is_error
        assert read.structured_content == straight.structured_content
        assert result_text(read) == result_text(straight)
        assert "hello from the sandbox\n" in result_text(read)

        # A write waits for the operator (the README's config keeps the default 15 s hold).
        target = qs.sandbox / "note.txt"
        write = {"path": str(target), "content": "written through the gate\n"}
        pending = host.submit("fs_write_file", write)
        invocation, run_id, approval_id = wait_hint(host, pending)
        # The hint on stderr is the README's approve line, with this run's ids.
        example = readme_command("python3 ~/bin/agentgate.py approve ")
        _, example_run, _, example_approval = example.rsplit(" ", 3)
        assert invocation == f"python3 {qs.home}/bin/agentgate.py"
        assert re.fullmatch(r"laptop\.[0-9a-f]{16}", run_id) and re.fullmatch(r"laptop\.[0-9a-f]{16}", example_run)
        assert re.fullmatch(r"[0-9a-f]+\.\.\.", example_approval) and re.fullmatch(r"[0-9a-f]{32}", approval_id)

        listing = ok(readme_command("python3 ~/bin/agentgate.py runs"), qs.env, qs.home)
        row = [line for line in listing.splitlines() if line.startswith(run_id)]
        assert row and "WAITING_FOR_APPROVAL" in row[0] and approval_id in row[0] and "fs_write_file" in row[0], listing

        first = pending.result()
        text = result_text(first)
        # an error: write_file has an output schema, now offered, which the gate's own
        # answers cannot meet, and a host refuses a result without structured content
        assert text.startswith("PENDING_APPROVAL:") and first.is_error, text
        assert approval_id in text and "same arguments" in text
        assert not target.exists()

        # The README's approve line, pasted into a terminal with this run's ids.
        approve_line = example.replace(example_run, run_id).replace(example_approval, approval_id)
        status, shown, asked = on_terminal(approve_line, qs.env, qs.home)
        assert status == 0, f"{approve_line!r} exited {status}:\n{shown}"
        # approve prints the request in full: server, tool, every argument with its size, the
        # question and the policy's reason.
        for needed in ("server", " fs", "write_file", "question", "reason",
                       f'path = "{target}"   ({len(str(target))} bytes)', "content = "):
            assert needed in shown, f"{needed!r} not in:\n{shown}"
        assert f"approval {approval_id}: approved" in shown

        # Then the model's identical call runs it, once.
        done = host.call("fs_write_file", write)
        assert not done.is_error, result_text(done)
        assert target.read_text() == "written through the gate\n"
        again = host.call("fs_write_file", write)
        assert again.is_error and result_text(again).startswith("DUPLICATE:")

    # The README says naming the approval with -approval is the operator's confirmation, so
    # its approve line decides without a prompt (the form without -approval asks: see the
    # reject line in test_operator_commands_from_the_prose).
    assert not asked, f"the README's approve line asked to type yes:\n{shown}"

    assert (qs.config_path.parent / "agentgate.db").exists()  # relative to the config's directory
    wait_no_process(tmp_path)


def test_quickstart_from_the_servers_a_host_already_starts(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    sandbox = home / "sandbox"
    sandbox.mkdir()
    (sandbox / "hello.txt").write_text("hello from the sandbox\n")
    env = person_env(home)
    ok(readme_command("mkdir -p ~/bin && cp agentgate.py"), env, REPO)
    # Claude Desktop's own place on Linux, with the filesystem server as a person has it (run
    # from tests/node_modules, as npx would run it).
    argv = filesystem_server_argv(sandbox)
    desktop = Path(env["XDG_CONFIG_HOME"]) / "Claude" / "claude_desktop_config.json"
    desktop.parent.mkdir(parents=True)
    desktop.write_text(json.dumps({"mcpServers": {"filesystem": {"command": argv[0], "args": argv[1:]}}}))

    out = ok(readme_command("python3 ~/bin/agentgate.py init"), env, home)
    # issue 21: each host is gated on a config of its own, beside the default one
    config_path = (home / readme_default_config_path().removeprefix("~/")).parent / "claude-desktop.json"
    assert config_path.stat().st_mode & 0o777 == 0o600
    assert str(desktop) in out and "read_text_file" in out
    entry = json.loads(out[out.index('{\n  "mcpServers"'):])["mcpServers"]["gated"]
    assert entry["args"] == [f"{home}/bin/agentgate.py", "-config", str(config_path)]

    unreviewed = sh("python3 ~/bin/agentgate.py check", env, home)
    assert unreviewed.returncode == 1 and \
        "unreviewed read_text_file: proposed read_only -> would allow once accepted" in unreviewed.stdout, \
        unreviewed
    # It prints what it accepts and asks for a typed yes, at the terminal a person pastes it in.
    status, accepted, asked = on_terminal(readme_command("python3 ~/bin/agentgate.py check -accept"),
                                          env, home)
    assert status == 0 and asked, accepted
    assert "filesystem/read_text_file (read_only): would allow" in accepted
    assert "registered read_text_file as filesystem_read_text_file (read_only)" in accepted
    assert re.search(r"registered create_directory as filesystem_create_directory \(remote_mutation\)"
                     r".* -> ask; repeat window 0s", accepted), accepted

    host_env = {"HOME": env["HOME"], "XDG_CONFIG_HOME": env["XDG_CONFIG_HOME"]}
    with Host([entry["command"], *entry["args"]], env=host_env, cwd=home) as host:
        read = host.call("filesystem_read_text_file", {"path": str(sandbox / "hello.txt")})
        assert "hello from the sandbox" in json.dumps(read.structured_content) + result_text(read)
        # The README's shortened approve lines, with this run's own first characters.
        for n, example in enumerate(("approve 3f9a0c1d2e", "approve laptop.3f9a0c1d2e")):
            target = sandbox / f"made-{n}"
            call = host.submit("filesystem_create_directory", {"path": str(target)})
            _, run_id, _ = wait_hint(host, call, n)
            session, hex_id = run_id.split(".")
            if n == 0:  # `watch`, typed as the README names it, shows it waiting
                assert f"run {run_id}" in watched_line(env, home, run_id)
            # Runs and approvals made the same minute share their first characters, and a prefix
            # several share is refused (issue 19): as few as tell this run apart, at least 6.
            line = example.replace("3f9a0c1d2e", unique_prefix(env, home, run_id)).replace(
                "laptop", session) + " -yes"
            decided = operator_line(env, home, line)
            assert f"run {run_id}:" in decided, decided
            result = call.result()
            if result_text(result).startswith("PENDING_APPROVAL:"):
                result = host.call("filesystem_create_directory", {"path": str(target)})
            assert not result.is_error, result_text(result)
            assert target.is_dir()
    wait_no_process(tmp_path)


def watched_line(env: dict, home: Path, run_id: str) -> str:
    """The line `watch` writes (not at a terminal) when `run_id` waits; then it is stopped."""
    proc = subprocess.Popen(["bash", "-c", "exec python3 ~/bin/agentgate.py watch"], env=env, cwd=home,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        return wait_for(lambda: next((line for line in list(lines) if run_id in line), None), 60,
                        message="watch to show the run waiting")
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        reader.join(60)


def unique_prefix(env: dict, home: Path, run_id: str) -> str:
    """The shortest prefix (at least 6 characters) of a run's part after its session that
    starts no other run's and no approval of another run."""
    others = []
    for run in json.loads(operator_line(env, home, "runs -json")):
        shown = json.loads(operator_line(env, home, f"show {run['run']} -json"))
        if run["run"] != run_id:
            others += [run["run"].split(".", 1)[1]] + [a["id"] for a in shown["approvals"]]
    hex_id = run_id.split(".", 1)[1]
    return hex_id[:max([6] + [len(os.path.commonprefix([hex_id, other])) + 1 for other in others])]


def operator_line(env: dict, home: Path, verb_line: str) -> str:
    """An operator command, typed the way the README types them (python3 ~/bin/agentgate.py ...)."""
    return ok(f"python3 ~/bin/agentgate.py {verb_line}", env, home)


def settled(host: Host, call, name: str, content: str, qs: Quickstart):
    """The answer to a held write once the operator acted: the held call's own, or, if the hold
    ran out first on a slow machine, that of the model's identical call after it."""
    result = call.result()
    if result_text(result).startswith("PENDING_APPROVAL:"):
        result = host.call("fs_write_file", {"path": str(qs.sandbox / name), "content": content})
    return result


def test_the_operator_verbs_the_prose_names(tmp_path):
    qs = Quickstart(tmp_path)
    with qs.host() as host:
        assert "fs_write_file" in [t.name for t in host.list_tools()], host.stderr_text()
        # reject RUN -note TEXT: the model sees the note.
        rejected = host.submit("fs_write_file", {"path": str(qs.sandbox / "a.txt"), "content": "a"})
        _, run_a, _ = wait_hint(host, rejected, 0)
        # Typed at a terminal: without -approval it shows the request and asks to type yes.
        reject_line = f"python3 ~/bin/agentgate.py reject {run_a} -note {shlex.quote('not in the sandbox root, please')}"
        status, shown, asked = on_terminal(reject_line, qs.env, qs.home)
        assert status == 0 and asked and "rejected" in shown, shown
        text = result_text(settled(host, rejected, "a.txt", "a", qs))
        assert text.startswith("REJECTED:") and "not in the sandbox root, please" in text, text

        # show RUN: the run with its steps and events.
        shown = qs.operator(f"show {run_a}")
        assert run_a in shown and "approval.decided" in shown, shown

        # cancel RUN ends a run that waits.
        cancelled = host.submit("fs_write_file", {"path": str(qs.sandbox / "b.txt"), "content": "b"})
        _, run_b, _ = wait_hint(host, cancelled, 1)
        out = qs.operator(f"cancel {run_b}")
        assert f"run {run_b}: CANCELLED" in out, out
        result = settled(host, cancelled, "b.txt", "b", qs)
        assert result.is_error and "cancelled" in result_text(result), result_text(result)
        assert not (qs.sandbox / "a.txt").exists() and not (qs.sandbox / "b.txt").exists()

    # verify walks the chain and prints its head; recheck compares decisions with today's policy.
    verified = qs.operator("verify")
    assert re.search(r"^head: seq \d+ [0-9a-f]{64}$", verified, re.M) and "intact" in verified, verified
    qs.operator("recheck")
    wait_no_process(tmp_path)


# ---------------------------------------------------------------- what cannot run here


def test_the_host_snippets_agree():
    """`claude mcp add` needs the Claude Code CLI (and would change the user's settings), so it
    is not run: its server name, command and arguments must be those of the JSON snippets,
    which the quickstart test starts exactly as written."""
    snippets = readme_host_snippets()
    entries = {host: value["mcpServers"] for host, value in snippets.items()}
    assert entries["Claude Desktop"] == entries["Cursor"]
    ((name, entry),) = entries["Claude Desktop"].items()
    assert set(entry) == {"command", "args"}
    assert isinstance(entry["command"], str) and all(isinstance(a, str) for a in entry["args"])

    line = readme_command("claude mcp add ")
    words = shlex.split(line)
    assert words[:3] == ["claude", "mcp", "add"]
    split = words.index("--")
    # issue 21: in the user's scope, so every project's sessions have it, as init prints it
    assert words[3:split] == ["-s", "user", name], "claude mcp add names the server as the JSON does"
    assert words[split + 1:] == [entry["command"], *entry["args"]]
    # The argument is the file the quickstart copied to ~/bin.
    assert entry["args"] == [f"{PLACEHOLDER_HOME}/bin/agentgate.py"]
    assert readme_command("mkdir -p ~/bin && cp agentgate.py ").endswith("~/bin/agentgate.py")


def test_the_install_and_test_command_is_well_formed():
    """`bash tests/setup.sh && python3 -m pytest -q -n 3 tests` installs from the network and runs
    this very suite, so it is not run here: setup.sh must be valid bash that installs the
    Python requirements and the npm packages, and `tests` must be the suite's directory."""
    line = readme_command("bash tests/setup.sh")
    first, second = [shlex.split(part) for part in line.split("&&")]
    assert first == ["bash", "tests/setup.sh"]
    assert second == ["python3", "-m", "pytest", "-q", "-n", "3", "tests"]
    setup = REPO / first[1]
    syntax = subprocess.run(["bash", "-n", str(setup)], capture_output=True, text=True, timeout=60)
    assert syntax.returncode == 0, syntax.stderr
    script = setup.read_text()
    assert "tests/requirements.txt" in script and "npm ci --prefix tests" in script
    requirements = (REPO / "tests" / "requirements.txt").read_text()
    assert re.search(r"^mcp==", requirements, re.M) and re.search(r"^pytest==", requirements, re.M)
    npm = json.loads((REPO / "tests" / "package.json").read_text())["dependencies"]
    assert {"@modelcontextprotocol/sdk", FS_PACKAGE} <= set(npm)
    assert (REPO / second[-1] / "conftest.py").exists()


# ---------------------------------------------------------------- the Policy section


def readme_rules(server: str) -> dict:
    """The rules block the Policy section gives for `server` ("filesystem", "payment", "mail")."""
    found = [value for before, value in json_blocks(readme_text()) if before.endswith("`rules`:") and server in before]
    assert len(found) == 1, f"README should show one rules block for the {server} server"
    return found[0]


def test_the_policy_examples_work_as_written(tmp_path):
    """The Policy section's three rule blocks, run as written: the filesystem server reaching the
    whole home but writing only under ~/sandbox (symbolic links and `..` included), the
    payment rules with the bundled fake bank, and the mail rules through `check`; then the
    section's grant, grants and revoke lines, typed at a terminal."""
    qs = Quickstart(tmp_path)
    home = qs.home
    projects = home / "projects"
    sandbox = projects / "drafts"
    outside = projects / "outside"
    sandbox.mkdir(parents=True)
    outside.mkdir()
    (sandbox / "link").symlink_to(outside)
    # The filesystem server may reach all of ~/projects; the rules alone keep writes in its drafts.
    fs = {**qs.config["servers"][0], "command": filesystem_server_argv(projects), "rules": readme_rules("filesystem")}
    bank = {"name": "bank", "command": ["python3", str(home / "bin" / "agentgate.py"), "fake-payments"],
            "env": [f"FAKE_PAYMENTS_LEDGER={tmp_path / 'ledger'}"], "manifest": "bank.manifest.json",
            "default_timeout": "30s", "rules": readme_rules("payment")}
    mail_spec = tmp_path / "mail.spec.json"
    mail_spec.write_text(json.dumps({"tools": [{"name": "send_email", "description": "Send an email.", "inputSchema": {
        "type": "object", "required": ["to", "body"],
        "properties": {"to": {"type": "string"}, "body": {"type": "string"}}}}]}))
    mail = {"name": "mail", "command": ["python3", str(REPO / "tests" / "scripted_server.py"), str(mail_spec)],
            "manifest": "mail.manifest.json", "default_timeout": "30s", "rules": readme_rules("mail")}
    qs.config_path.write_text(json.dumps({**qs.config, "hold": "0s", "servers": [fs, bank, mail]}), encoding="utf-8")
    qs.operator("pin")
    checked = qs.operator("check")
    for line in ("registered write_file as fs_write_file (destructive)",
                 'when[0]: if /path lies under ["' + str(sandbox) + '"] -> allow',
                 "when[1]: if /amount is at least 1000 -> deny",
                 "limits[1]: at most 5 calls to bank_pay per 1h0m0s, then deny",
                 "when[0]: if /to matches", "on mon-fri from 08:00-19:00 (Europe/Paris)",
                 "limits[0]: at most 10 calls to mail_send_email per 1h0m0s, then deny"):
        assert line in checked, f"{line!r} not in:\n{checked}"

    def write(host, path, content="x"):
        return result_text(host.call("fs_write_file", {"path": str(path), "content": content}))
    with qs.host() as host:
        assert not write(host, sandbox / "a.txt", "inside").startswith(("DENIED", "PENDING"))
        assert (sandbox / "a.txt").read_text() == "inside"
        (projects / "drafts2").mkdir()
        for escape in (projects / "notes.txt", f"{sandbox}/../escape.txt", sandbox / "link" / "x.txt",
                       projects / "drafts2" / "x.txt", "drafts/relative.txt"):
            answer = write(host, escape)
            assert answer.startswith("DENIED:"), (escape, answer)
            assert str(tmp_path) not in answer  # the model is told no path of the policy
        assert not (projects / "notes.txt").exists() and not (projects / "escape.txt").exists()
        assert not (outside / "x.txt").exists() and not (projects / "drafts2" / "x.txt").exists()
        moved = host.call("fs_move_file", {"source": str(sandbox / "a.txt"), "destination": str(sandbox / "b.txt")})
        assert not moved.is_error and (sandbox / "b.txt").exists(), result_text(moved)
        away = result_text(host.call("fs_move_file", {"source": str(sandbox / "b.txt"),
                                                       "destination": str(projects / "b.txt")}))
        assert away.startswith("DENIED:") and (sandbox / "b.txt").exists(), away

        def pay(to, amount):
            return result_text(host.call("bank_pay", {"to": to, "amount": amount}))
        assert pay("landlord", 20) == "paid 20.00 to landlord"
        assert pay("landlord", 1000).startswith("DENIED: The policy does not allow this request: payments of 1000 or more")
        assert pay("bob", 5).startswith("PENDING_APPROVAL:")

        # The section's grant line, typed at a terminal: printed in full, asked, granted.
        status, shown, asked = on_terminal(readme_command("python3 ~/bin/agentgate.py grant "), qs.env, home)
        assert status == 0 and asked, shown
        grant_id = re.search(r"grant ([0-9a-f]{16}): in force", shown).group(1)
        assert "/amount is at most 20" in shown and "errands" in shown and f"grant {grant_id}: in force" in shown
        assert pay("bob", 6) == "paid 6.00 to bob"  # asked before, now covered by the grant
        assert pay("bob", 30).startswith("PENDING_APPROVAL:")
        listed = ok(readme_command("python3 ~/bin/agentgate.py grants"), qs.env, home)
        assert grant_id in listed and "in force" in listed and "errands" not in listed.split(grant_id)[0]
        example = readme_command("python3 ~/bin/agentgate.py revoke ")
        ok(example.replace(example.rsplit(" ", 1)[1], grant_id), qs.env, home)
        assert pay("bob", 7).startswith("PENDING_APPROVAL:")
        # show names the grant for the call it let through.
        paid = [r["run"] for r in json.loads(qs.operator("runs -json"))
                if r["tool"] == "bank_pay" and r["status"] == "COMPLETED"]
        shown = [qs.operator(f"show {run_id}") for run_id in paid]
        assert len(paid) == 2 and sum(f"ran under grant {grant_id}" in text for text in shown) == 1
    assert len((tmp_path / "ledger").read_text().splitlines()) == 2
    wait_no_process(tmp_path)
