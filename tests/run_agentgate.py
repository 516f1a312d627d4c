"""Runs agentgate.py exactly as `python3 agentgate.py ARGS` does, but from its cached bytecode.

    python3 tests/run_agentgate.py ARGS

Python compiles a script it is given by path on every start and caches the bytecode only of
modules it imports: for agentgate.py that is about 0.1 s of CPU a start, and the suite starts
agentgate thousands of times. This runs it as `python3 -m agentgate` would: the same file as
__main__, its path as sys.argv[0] and its directory as sys.path[0], so what agentgate sees
(its own path in the hints it prints and the configs it writes, the modules it finds) is what
it sees when run by path. Tests that need the script itself (the README's commands) run it so.
"""

import runpy
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)
runpy.run_module("agentgate", run_name="__main__", alter_sys=True)
