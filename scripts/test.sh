#!/usr/bin/env bash
# Install everything the tests need, then run them: lint, types, the test suite, then the
# engine tests in venvs of their own: real vLLM engines (scripts/test-vllm.sh) and the
# LMCache and SGLang backends (scripts/test-engines.sh). EMS_SKIP_ENGINES=1 leaves those out.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
ENGINES=1
[[ "${EMS_SKIP_ENGINES:-0}" == 1 || "${EMS_SKIP_VLLM:-0}" == 1 ]] && ENGINES=0
if ((ENGINES)); then
    # The engine venvs install (mostly downloads) while the main suite runs.
    setup_log=$(mktemp)
    (scripts/setup-vllm.sh && scripts/setup-lmcache-vllm.sh && scripts/setup-mooncake-vllm.sh \
        && scripts/setup-engines.sh) >"$setup_log" 2>&1 &
    setup_pid=$!
fi
echo "[test] ruff"
.venv/bin/ruff check emsd ems tests benchmarks
echo "[test] mypy"
.venv/bin/mypy emsd ems
echo "[test] pytest"
.venv/bin/python -m pytest -q --durations=15 "$@"
if ((ENGINES)); then
    if ! wait "$setup_pid"; then
        cat "$setup_log" >&2
        echo "[test] setting up the engine venvs failed" >&2
        exit 1
    fi
    scripts/test-vllm.sh
    scripts/test-engines.sh
fi
