#!/usr/bin/env bash
# Set up the engines venv (scripts/setup-engines.sh; EMS_ENGINE_VENVS_READY=1 skips it), then
# run the LMCache and SGLang integration tests in it against real emsd daemons. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ "${EMS_ENGINE_VENVS_READY:-0}" == 1 ]] || scripts/setup-engines.sh  # test.sh sets it up first
VENV="${ENGINES_VENV:-$PWD/.venv-engines}"
echo "[test-engines] pytest tests/engines"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines "$@"
