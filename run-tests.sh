#!/usr/bin/env bash
# Run the whole test suite: lint, type check, then every test (unit tests beside each
# package, cross-service tests in tests/). Sets the machine up first if needed.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${YB_VENV:-.venv}
if [ ! -x "$VENV/bin/yb" ]; then
  ./setup.sh
fi
started=$(date +%s)
echo "[test] ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check --quiet .
echo "[test] mypy"
"$VENV/bin/mypy"
echo "[test] pytest"
"$VENV/bin/python" -m pytest "$@"
echo "[test] suite took $(( $(date +%s) - started ))s"
