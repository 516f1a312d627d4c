"""The client the MCP conformance suite's client scenarios run: a person's setup of agentgate in
front of the scenario's server, driven by an MCP host (the SDK's client over stdio).

    python3 conformance_host.py WORKDIR URL

The suite appends URL and names its scenario in MCP_CONFORMANCE_SCENARIO (and, for some, gives
a pre-registered OAuth client in MCP_CONFORMANCE_CONTEXT). In WORKDIR this writes a config with
one url server named `ref`; for an auth scenario it runs `login ref` with $BROWSER set to a
headless stand-in (conformance_browser.py) that follows the authorization redirect back to
login's loopback port; then it pins, allows every pinned tool under its own name (so the gate
is invisible), serves, lists the tools through a host and calls the scenario's tool. What the
host was answered goes to stderr; the exit status is 1 when any step or the call failed.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import Host, agentgate_argv  # noqa: E402
from kit import agentgate, read_manifest, write_config  # noqa: E402

BROWSER = Path(__file__).resolve().parent / "conformance_browser.py"
SCENARIO = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
CALLS = {"tools_call": ("add_numbers", {"a": 5, "b": 3}), "sse-retry": ("test_reconnection", {})}
AUTH_CALL = ("test-tool", {})


def step(done, what: str) -> None:
    """Stop with what agentgate said when a command failed."""
    if done.returncode != 0:
        sys.exit(f"{what} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")


def main(workdir: Path, url: str) -> None:
    server = {"name": "ref", "url": url, "manifest": "ref.manifest.json", "rules": {}}
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    oauth = {key: context[key] for key in ("client_id", "client_secret") if key in context}
    if oauth:
        server["oauth"] = oauth
    config = write_config(workdir, [server])
    if SCENARIO.startswith("auth/"):
        browser = f"{sys.executable} {BROWSER} %s"
        step(agentgate("login", "ref", "-config", str(config), env={"BROWSER": browser}), "login")
    step(agentgate("pin", "-config", str(config)), "pin")
    tools = read_manifest(workdir / "ref.manifest.json")["tools"]
    server["rules"] = {name: {"side_effect": "read_only", "timeout": "20s", "rename": name}
                       for name in tools}
    config = write_config(workdir, [server])
    with Host(agentgate_argv("-config", str(config)), timeout=60) as host:
        try:
            offered = [entry.name for entry in host.list_tools()]
        except Exception as failure:
            sys.exit(f"tools/list failed: {failure}\nagentgate's stderr:\n{host.stderr_text()}")
        print(f"offered: {offered}", file=sys.stderr)
        auth = SCENARIO.startswith("auth/")
        name, args = AUTH_CALL if auth else CALLS.get(SCENARIO, (None, None))
        if name is None:
            return
        result = host.call(name, args)
        answer = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        print(f"{name} answered: {json.dumps(answer)}", file=sys.stderr)
        if result.is_error:
            sys.exit(f"the call failed; agentgate's stderr:\n{host.stderr_text()}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
