"""The notify program's bound (issue 30): at most NOTIFY_AT_ONCE programs run at once,
each on a thread of its own; an announcement past them is dropped at once and said so,
never queued and never in a call's way, and a hung program is stopped at its deadline,
which frees its place.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from conftest import pid_alive, wait_for  # noqa: E402

HANG = "import os, sys, time\nopen(sys.argv[1] + '/' + os.environ['AGENTGATE_APPROVAL'], 'w')" \
       ".write(str(os.getpid()))\ntime.sleep(600)\n"


def names(approval: str) -> dict:
    return {"AGENTGATE_APPROVAL": approval, "AGENTGATE_RUN": "r", "AGENTGATE_TOOL": "t",
            "AGENTGATE_COMMAND": "c"}


def test_past_the_bound_an_announcement_is_dropped_at_once_and_a_stop_frees_a_place(
        tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(agentgate, "log", said.append)
    monkeypatch.setattr(agentgate, "NOTIFY_TIMEOUT", 3)
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    notifier = agentgate.Notifier([sys.executable, str(script), str(tmp_path)])
    bound = agentgate.NOTIFY_AT_ONCE
    assert 1 <= bound <= 8
    for i in range(bound):
        notifier.announce(names(f"a{i}"))
    started = time.monotonic()
    notifier.announce(names("past"))
    assert time.monotonic() - started < 1, "a full bound delayed the announcement"
    assert any("approval past is not announced" in line for line in said), said
    pids = [wait_for(lambda i=i: (tmp_path / f"a{i}").exists() and (tmp_path / f"a{i}").read_text(),
                     30, message=f"notify program a{i}") for i in range(bound)]
    assert not (tmp_path / "past").exists()
    wait_for(lambda: all(not pid_alive(int(pid)) for pid in pids), 30,
             message="the hung programs to be stopped")
    wait_for(lambda: sum("was stopped after 3s" in line for line in said) == bound, 30,
             message="each stop on stderr")
    notifier.announce(names("later"))
    later = wait_for(lambda: (tmp_path / "later").exists() and (tmp_path / "later").read_text(),
                     30, message="the program once a place is free")
    os.kill(int(later), 9)
