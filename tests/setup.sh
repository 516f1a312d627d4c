#!/usr/bin/env bash
# Install what the test suite needs (idempotent): Python packages and the npm servers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -r tests/requirements.txt </dev/null
npm ci --prefix tests --loglevel=error --no-audit --no-fund </dev/null >/dev/null
