#!/usr/bin/env bash
# Install the systems that benchmarks/peers/ runs emsd against (idempotent: a second
# run only checks what is there, in a few seconds). Each part is optional for the
# benchmark, which reports a system it cannot find as missing, so a failed part here
# warns and the others go on.
#
#   Redis and memcached      Debian's redis-server and memcached; redis-py with hiredis
#                            and pymemcache in the project venv (.venv, or $EMS_VENV)
#   Mooncake Store           mooncake-transfer-engine-non-cuda 0.3.13.post1 (the plain
#                            mooncake-transfer-engine wheel is a CUDA build and fails to
#                            import without libcuda) in .venv-bench-mooncake
#   LMCache's lmcache_server lmcache in .venv-bench-lmcache: it pins numpy<=2.2.6, so it
#                            gets a venv of its own; torch 2.13.0 (CPU, from local disk)
#                            goes in first and PIP_CONSTRAINT holds it there, else pip
#                            would pull a multi-GB CUDA build
#
# The third-party venvs go in $BENCH_VENV_DIR (default: the repository root, where
# .gitignore covers .venv-bench-*). The benchmark finds them through the same variable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${EMS_VENV:-.venv}"
DIR="${BENCH_VENV_DIR:-$PWD}"
MOONCAKE_VERSION=0.3.13.post1
LMCACHE_VERSION=0.5.6
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"  # torch==2.13.0 on every install
failed=()

pip_in() {  # pip_in VENV ARGS...: quiet, minus the machine's "index location is ignored" notices
    local venv=$1
    shift
    "$venv/bin/python" -m pip install -q "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}
has() {  # has VENV NAME VERSION: NAME is installed in VENV at VERSION (a prefix)
    [[ "$("$1/bin/python" -m pip show "$2" 2>/dev/null | sed -n 's/^Version: //p')" == "$3"* ]]
}
new_venv() {
    [[ -x $1/bin/python ]] || "$PY" -m venv "$1"
}

if ! command -v redis-server >/dev/null || ! command -v memcached >/dev/null; then
    echo "[setup-bench-peers] Debian redis-server and memcached"
    if [[ $(id -u) == 0 ]]; then SUDO=""; else SUDO="sudo"; fi
    # The benchmark runs its own servers on free loopback ports; it neither needs nor
    # touches the system services (which a machine without systemd does not start).
    $SUDO apt-get install -y -q redis-server memcached >/dev/null 2>&1 || {
        $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server memcached >/dev/null; } \
        || failed+=("redis-server/memcached (apt-get)")
fi

if [[ -x $VENV/bin/python ]]; then
    if ! "$VENV/bin/python" -c "import redis, hiredis, pymemcache" 2>/dev/null; then
        echo "[setup-bench-peers] redis-py with hiredis, pymemcache in $VENV"
        pip_in "$VENV" "redis[hiredis]>=5" "pymemcache>=4" || failed+=("redis-py/pymemcache")  # = pyproject [bench]
    fi
else
    echo "[setup-bench-peers] warning: no $VENV; run scripts/setup.sh --test first" >&2
    failed+=("project venv $VENV")
fi

MC="$DIR/.venv-bench-mooncake"
if ! has "$MC" mooncake-transfer-engine-non-cuda "$MOONCAKE_VERSION"; then
    echo "[setup-bench-peers] Mooncake Store ($MOONCAKE_VERSION, non-CUDA) in $MC"
    new_venv "$MC" && pip_in "$MC" --upgrade pip setuptools wheel \
        && pip_in "$MC" numpy "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
        || failed+=("mooncake-transfer-engine-non-cuda")
fi
"$MC/bin/python" -c "from mooncake.store import MooncakeDistributedStore" 2>/dev/null \
    || failed+=("mooncake import")

LM="$DIR/.venv-bench-lmcache"
if ! has "$LM" lmcache "$LMCACHE_VERSION"; then
    echo "[setup-bench-peers] LMCache $LMCACHE_VERSION on torch 2.13.0 (CPU) in $LM"
    new_venv "$LM" && pip_in "$LM" --upgrade pip setuptools wheel \
        && pip_in "$LM" torch==2.13.0 \
        && pip_in "$LM" "lmcache==$LMCACHE_VERSION" \
        || failed+=("lmcache")
fi
"$LM/bin/python" -c "import lmcache" 2>/dev/null || failed+=("lmcache import")

if ((${#failed[@]})); then
    echo "[setup-bench-peers] not installed: ${failed[*]} (the benchmark reports these as missing)" >&2
fi
echo "[setup-bench-peers] done"
