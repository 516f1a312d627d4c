"""Test harness: drive agentgate (or any stdio MCP server) the way a real host does.

`Host` wraps the official MCP Python SDK client behind a synchronous API; `RawStdio`
speaks raw newline-delimited JSON-RPC for malformed-frame and crash tests.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
from mcp import Client, types
from mcp.client.stdio import StdioServerParameters, stdio_client

REPO = Path(__file__).resolve().parent.parent
AGENTGATE = REPO / "agentgate.py"
RUN_AGENTGATE = REPO / "tests" / "run_agentgate.py"  # agentgate.py from its cached bytecode
NODE_MODULES = REPO / "tests" / "node_modules"

DEFAULT_TIMEOUT = 120.0  # generous: the CI machine is a loaded 2-core box
_SCRATCH = Path(tempfile.mkdtemp(prefix="agentgate-tests-"))
atexit.register(shutil.rmtree, _SCRATCH, True)
_LIVE: set = set()  # open Host/RawStdio objects, closed after each test by _close_leftovers
_counter = itertools.count()


# ---------------------------------------------------------------- server argv helpers


def _bin_js(package: str) -> str:
    """Absolute path of the JS file named by an installed npm package's `bin`."""
    pkg_dir = NODE_MODULES / package
    try:
        meta = json.loads((pkg_dir / "package.json").read_text())
    except FileNotFoundError:
        raise RuntimeError(f"{pkg_dir} is missing: run `bash tests/setup.sh`") from None
    bin_ = meta["bin"]
    rel = bin_ if isinstance(bin_, str) else next(iter(bin_.values()))
    return str((pkg_dir / rel).resolve())


def filesystem_server_argv(root: str | os.PathLike) -> list[str]:
    """argv of the reference filesystem server, allowed to touch `root` only."""
    return ["node", _bin_js("@modelcontextprotocol/server-filesystem"), str(root)]


def everything_server_argv() -> list[str]:
    """argv of the reference "everything" server on stdio (its first argument picks the transport)."""
    return ["node", _bin_js("@modelcontextprotocol/server-everything"), "stdio"]


def agentgate_argv(*args: str) -> list[str]:
    """argv that runs agentgate.py with this Python (as its path would, see run_agentgate.py)."""
    return [sys.executable, str(RUN_AGENTGATE), *args]


def fake_argv() -> list[str]:
    """argv of the fake payment server with the tests' modes (tests/fake_modes.py)."""
    return [sys.executable, str(REPO / "tests" / "fake_modes.py"), "fake-payments"]


# ---------------------------------------------------------------- small utilities


def wait_for(predicate: Callable[[], Any], timeout: float = 30, interval: float = 0.02, message: str | None = None):
    """Poll `predicate` until it returns something truthy (which is returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        time.sleep(interval)


def _stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (state first, then ppid, pgrp, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def children(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError):
                if int(_stat(int(entry.name))[1]) == pid and pid_alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


def _scratch(kind: str) -> Path:
    return _SCRATCH / f"{kind}-{next(_counter)}.stderr"


def _kill_group(pid: int | None) -> None:
    """SIGKILL the process group led by `pid` (our children run in their own session) and wait it out."""
    if pid is None:
        return
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    # A killed process is gone only once its threads leave the kernel: one in an fsync (the
    # gate's SQLite commits and checkpoints, a server's synced record) waits for a disk that
    # other suites on this machine keep busy, so this waits as long as a call may.
    wait_for(lambda: not pid_alive(pid), DEFAULT_TIMEOUT, message=f"pid {pid} to die")


# ---------------------------------------------------------------- Host: the SDK client, synchronously


class Progress(NamedTuple):
    """One `notifications/progress` received for a call."""

    progress: float
    total: float | None
    message: str | None


class Call:
    """A tool call in flight (see `Host.submit`); `.progress` fills as notifications arrive."""

    def __init__(self, future: concurrent.futures.Future, progress: list[Progress], deadline: float):
        self.future, self.progress, self._deadline = future, progress, deadline

    def result(self, timeout: float | None = None):
        """The CallToolResult (or the SDK's exception, e.g. MCPError); cancels the call on timeout."""
        try:
            return self.future.result(self._deadline if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            self.cancel()
            raise TimeoutError("tool call got no answer in time") from None

    def cancel(self) -> None:
        """Cancel the caller's await; the SDK then sends notifications/cancelled for the request."""
        self.future.cancel()

    def done(self) -> bool:
        return self.future.done()


class Host:
    """An MCP host: spawns `argv` through the SDK's stdio transport and talks to it with `mcp.Client`.

    The client lives on a private asyncio loop in a background thread, so tests stay synchronous.
    `env` is merged over the SDK's minimal inherited environment (HOME, PATH, USER, ...), as for
    any SDK host. The child's stderr goes to a file (`stderr_text()`); `pid` is the child's pid.
    """

    def __init__(self, argv, env: dict | None = None, cwd=None, mode: str = "auto", timeout: float = DEFAULT_TIMEOUT,
                 name: str | None = None):
        self.argv, self.env, self.cwd, self.mode, self.timeout = list(argv), env, cwd, mode, timeout
        self.name = name  # the clientInfo name given in initialize; None: the SDK's default ("mcp")
        self.stderr_path = _scratch("host")
        self.client: Client | None = None
        self.pid: int | None = None
        self.progress: list[Progress] = []  # progress of the last `call()`
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Host:
        """Spawn the server and complete the handshake (raises what the SDK raised, stderr in a note)."""
        self._errlog = open(self.stderr_path, "w")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-host", daemon=True)
        self._thread.start()
        self._stop = asyncio.Event()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        _LIVE.add(self)
        try:
            self.client = ready.result(self.timeout)
        except BaseException as exc:
            self.close()
            exc.add_note(f"server stderr:\n{self.stderr_text()}")
            raise
        self.pid = self._find_pid()
        return self

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        # One task owns the Client: anyio scopes must be entered and left by the same task.
        params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=self.env, cwd=self.cwd)
        try:
            info = {} if self.name is None else {"client_info": types.Implementation(name=self.name, version="1")}
            async with Client(stdio_client(params, errlog=self._errlog), mode=self.mode, **info) as client:
                ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def _find_pid(self) -> int | None:
        """Our child whose stderr is our errlog file."""
        for pid in children(os.getpid()):
            with suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/2") == os.path.realpath(self.stderr_path):
                    return pid
        return None

    def __enter__(self) -> Host:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, fn: Callable[[Client], Any], timeout: float | None = None):
        """Run `await fn(client)` on the host's loop and return its result (for anything not wrapped here)."""

        async def go():
            return await fn(self.client)

        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(timeout or self.timeout)

    def list_tools(self, cache_mode: str = "use") -> list:
        """All tools, following pagination cursors."""

        async def go(client: Client):
            tools, cursor = [], None
            while True:
                page = await client.list_tools(cursor=cursor, cache_mode=cache_mode)
                tools += page.tools
                cursor = page.next_cursor
                if not cursor:
                    return tools

        return self.run(go)

    def submit(self, name: str, args: dict | None = None, progress: bool = False, timeout: float | None = None) -> Call:
        """Start a tools/call without waiting. `timeout` is the SDK's read timeout (MCPError on expiry)."""
        events: list[Progress] = []

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            events.append(Progress(value, total, message))

        coro = self.client.call_tool(
            name, args or {}, read_timeout_seconds=timeout, progress_callback=on_progress if progress else None
        )
        deadline = self.timeout if timeout is None else timeout + 30
        return Call(asyncio.run_coroutine_threadsafe(coro, self._loop), events, deadline)

    def call(self, name: str, args: dict | None = None, progress: bool = False, timeout: float | None = None):
        """Call a tool and return the CallToolResult; its progress notifications land in `self.progress`."""
        pending = self.submit(name, args, progress, timeout)
        self.progress = pending.progress
        return pending.result()

    def call_text(self, name: str, args: dict | None = None, **kw) -> str:
        """Newline-joined text of the result's text content blocks."""
        result = self.call(name, args, **kw)
        return "\n".join(block.text for block in result.content if block.type == "text")

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def close(self) -> None:
        """Shut the client down (SDK: close stdin, SIGTERM, SIGKILL) and make sure the child is gone."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        if self.pid is None:
            self.pid = self._find_pid()
        loop.call_soon_threadsafe(self._stop.set)
        with suppress(BaseException):
            self._main.result(30)
        if not self._main.done():
            self._main.cancel()
        _kill_group(self.pid)

        async def cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with suppress(BaseException):
            asyncio.run_coroutine_threadsafe(cancel_rest(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            loop.close()
        self._errlog.close()
        _LIVE.discard(self)


# ---------------------------------------------------------------- RawStdio: bytes on the wire


class RawStdio:
    """A bare stdio peer: `argv` runs with piped stdin/stdout (bytes), stderr to a file, own session.

    `env` is merged over os.environ. Messages skipped while waiting in `request()` go to `.skipped`.
    """

    def __init__(self, argv, env: dict | None = None, cwd=None):
        self.stderr_path = _scratch("raw")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=cwd,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.skipped: list[dict] = []
        self._lines: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        threading.Thread(target=self._pump, name="raw-stdout", daemon=True).start()
        _LIVE.add(self)

    def _pump(self) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                self._lines.put(line)
        self._lines.put(None)

    def __enter__(self) -> RawStdio:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, message: dict | bytes, newline: bool = True) -> None:
        """Write a JSON object (or raw bytes, sent verbatim) followed by a newline."""
        data = message if isinstance(message, bytes) else json.dumps(message).encode()
        self.proc.stdin.write(data + (b"\n" if newline else b""))
        self.proc.stdin.flush()

    def recv(self, timeout: float = 30) -> dict:
        """Next stdout line, parsed. TimeoutError if none, EOFError once stdout is closed."""
        try:
            line = self._lines.get(timeout=max(timeout, 0))
        except queue.Empty:
            raise TimeoutError(f"no stdout line within {timeout}s; stderr:\n{self.stderr_text()[-2000:]}") from None
        if line is None:
            self._lines.put(None)
            raise EOFError("server closed stdout")
        try:
            return json.loads(line)
        except ValueError:
            raise AssertionError(f"non-JSON line on stdout: {line!r}") from None

    def request(self, method: str, params: dict | None = None, id: Any = None, timeout: float = 30) -> dict:
        """Send a request and return its response (whole JSON-RPC object); other messages go to `.skipped`."""
        rid = next(self._ids) if id is None else id
        message = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return self.response(rid, timeout)

    def response(self, rid: Any, timeout: float = 30) -> dict:
        """The response with this id (also one skipped earlier); other messages go to `.skipped`."""
        for i, message in enumerate(self.skipped):
            if message.get("id") == rid and "method" not in message:
                return self.skipped.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(deadline - time.monotonic())
            if reply.get("id") == rid and "method" not in reply:
                return reply
            self.skipped.append(reply)

    def initialize(self, protocol_version: str = "2025-11-25") -> dict:
        """Legacy handshake: initialize + notifications/initialized; returns the initialize response."""
        reply = self.request(
            "initialize",
            {"protocolVersion": protocol_version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
        )
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return reply

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the server process only (not its children)."""
        with suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 30) -> int:
        """Wait for the server to exit; returns its exit status (negative: killed by that signal)."""
        return self.proc.wait(timeout)

    def stderr_text(self) -> str:
        """Everything the server wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def close(self, timeout: float = 10) -> int | None:
        """Close stdin, give the server `timeout` s to exit, then SIGKILL its process group."""
        with suppress(OSError):
            self.proc.stdin.close()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout)
        _LIVE.discard(self)
        return self.proc.returncode


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh private (0700) directory for this test."""
    path = tmp_path / "work"
    path.mkdir()
    path.chmod(0o700)
    return path


@pytest.fixture(autouse=True)
def _close_leftovers():
    """Close any Host/RawStdio a test left open, so no child outlives its test."""
    yield
    for peer in list(_LIVE):
        peer.close()
