"""The host's requests run on kept request threads (HostServer._hand): a thread that finished
one request takes the next, so no request waits for a thread to start (tests/bench.py measures
what that costs), and one idle for IDLE_THREAD seconds ends, so a thread lives only while there
is work. No work handed over is lost or run twice."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import wait_for  # noqa: E402


def host():
    return agentgate.HostServer(None, None, None)


def test_sequential_requests_share_one_thread():
    server, ran, done = host(), [], threading.Semaphore(0)

    def work():
        ran.append(threading.get_ident())
        done.release()
    for _ in range(20):
        server._hand(work)
        assert done.acquire(timeout=30)
        # The thread counts itself idle just after the work returns.
        wait_for(lambda: server.idle == 1, 30, message="the thread idle again")
    assert len(ran) == 20 and len(set(ran)) == 1, set(ran)


def test_every_request_runs_once_and_idle_threads_end(monkeypatch):
    monkeypatch.setattr(agentgate, "IDLE_THREAD", 0.2)
    server, lock, ran = host(), threading.Lock(), []
    gate = threading.Event()

    def work(n):
        def run():
            gate.wait(30)
            with lock:
                ran.append(n)
        return run
    before = threading.active_count()
    for n in range(40):
        server._hand(work(n))
    gate.set()
    wait_for(lambda: len(ran) == 40, 30, message="every request run")
    assert sorted(ran) == list(range(40))
    # Idle past IDLE_THREAD, every request thread ends, and a new request still runs.
    wait_for(lambda: threading.active_count() <= before, 30, message="idle threads ending")
    assert server.idle == 0
    server._hand(work(40))
    wait_for(lambda: 40 in ran, 30, message="a request after the threads ended")
