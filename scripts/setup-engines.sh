#!/usr/bin/env bash
# Set up the venv for the LMCache and SGLang integration tests (idempotent).
#   scripts/setup-engines.sh        -> .venv-engines next to this checkout (ENGINES_VENV overrides)
#
# The full lmcache and sglang installs need CUDA packages; this CPU machine installs them with
# --no-deps plus the light dependencies their storage layers import. torch 2.13.0 (CPU) goes in
# first and stays pinned through scripts/constraints.txt, so pip never pulls a CUDA build.
# Versions are pinned: ems/integrations/{lmcache,sglang}.py are written against these. A new venv
# starts as a hard-linked copy of .venv's packages where scripts/setup.sh --test has made it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-lock.sh
source scripts/linked-venv.sh
ROOT="$PWD"
VENV="${ENGINES_VENV:-$ROOT/.venv-engines}"
PY="${PYTHON:-python3}"
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

ENGINES=(lmcache==0.5.6 sglang==0.5.23)
LIGHT_DEPS=(
    aiofile==3.12.3 aiofiles==25.1.0 aiohttp==3.14.5 blake3==1.0.11 cachetools==8.0.1
    cryptography==50.0.2 httpx==0.28.1 ipython==9.18.1 msgspec==0.22.0 numba==0.68.1
    nvtx==0.2.17 orjson==3.13.0 pillow==13.0.0 py-cpuinfo==9.0.0 pybase64==1.5.1
    PyYAML==6.0.3 pyzmq==27.3.0 redis==8.1.0 requests==2.34.2 safetensors==0.8.0
    sortedcontainers==2.4.0 starlette==1.10.0 transformers==5.23.0 triton==3.9.0
)
# What is installed is recorded in a stamp; a second run with the same lists installs nothing
# (emsd too has a stamp of its own: scripts/build-lock.sh).
WANT="$(printf '%s\n' torch==2.13.0 "${ENGINES[@]}" "${LIGHT_DEPS[@]}" | sha256sum | cut -c1-16)"
STAMP="$VENV/.engines-installed"

echo "[setup-engines] venv $VENV"
linked=0
if [[ ! -x "$VENV/bin/python" ]]; then
    if "$ROOT/.venv/bin/python" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "emsd", "pytest")))' 2>/dev/null; then
        # A copy of the test venv's packages (scripts/setup.sh --test): torch 2.13.0, emsd
        # (editable, this tree) and the test tools are there already.
        echo "[setup-engines] its packages linked from .venv"
        make_linked_venv "$ROOT/.venv" "$VENV"
        linked=1
    else
        "$PY" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip install -q --no-compile)  # imports compile what they need
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
    ((linked)) || "${PIP[@]}" --upgrade pip setuptools wheel
    echo "[setup-engines] torch 2.13.0 (CPU)"
    "${PIP[@]}" torch==2.13.0
    echo "[setup-engines] ${ENGINES[*]} (--no-deps) and their light dependencies"
    "${PIP[@]}" --no-deps "${ENGINES[@]}"
    "${PIP[@]}" "${LIGHT_DEPS[@]}"
    # torchvision (pulled in by nothing above, but left over from other installs) fails to
    # register its operators against this torch and breaks SGLang's imports.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision 2>/dev/null || true
    echo "$WANT" > "$STAMP"
fi
if ((linked)); then  # .venv's editable install of this tree came with its packages
    mark_emsd_installed "$VENV"
elif ! emsd_installed "$VENV"; then  # pyproject.toml changed (scripts/build-lock.sh)
    echo "[setup-engines] emsd (editable, with test extras) from $ROOT"
    with_build_lock "${PIP[@]}" -e "$ROOT[test]"
    mark_emsd_installed "$VENV"
fi
# The import check also compiles what the tests import (pip compiled nothing: --no-compile).
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" - <<'PY'
import lmcache.v1.storage_backend.connector  # noqa: F401
import sglang.srt.mem_cache.storage  # noqa: F401
import ems.integrations.lmcache, ems.integrations.sglang  # noqa: F401,E401
print("[setup-engines] lmcache, sglang and ems.integrations import")
PY
