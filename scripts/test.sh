#!/usr/bin/env bash
# Install everything the tests need, then run them: lint, types, the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
echo "[test] ruff"
.venv/bin/ruff check emsd ems tests benchmarks
echo "[test] mypy"
.venv/bin/mypy emsd ems
echo "[test] pytest"
exec .venv/bin/python -m pytest -q "$@"
