#!/usr/bin/env bash
# Set up everything emsd and its tests need on a fresh Debian machine (idempotent).
#   scripts/setup.sh          the daemon and the SDK in .venv
#   scripts/setup.sh --test   plus test tools, torch 2.13.0 (CPU), Debian's zookeeper and openssl,
#                             and the checkers of deploy/ (scripts/setup-deploy-checks.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build-lock.sh
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1
PY="${PYTHON:-python3}"

echo "[setup] python venv in .venv"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel

if [[ $WITH_TEST == 1 ]]; then
    # torch first and pinned: the CPU build lies on this machine's disk; a bare
    # "torch" requirement would pull a multi-GB CUDA build instead.
    echo "[setup] torch 2.13.0 (CPU)"
    .venv/bin/python -m pip install -q torch==2.13.0
    echo "[setup] emsd with test extras"
    PIP_CONSTRAINT=scripts/constraints.txt with_build_lock .venv/bin/python -m pip install -q -e ".[test]"
    scripts/setup-deploy-checks.sh  # promtool, systemd-analyze, Helm (library), hadolint for tests/deploy
    if ! command -v zkServer.sh >/dev/null && [[ ! -x /usr/share/zookeeper/bin/zkServer.sh ]] \
            || [[ ! -d /usr/lib/python3/dist-packages/pyverbs ]]; then
        # zookeeper for the cluster tests; python3-pyverbs for the RDMA transport (emsd loads it
        # from Debian's dist-packages by itself; PyPI's pyverbs does not build here)
        echo "[setup] Debian zookeeper and python3-pyverbs"
        if [[ $(id -u) == 0 ]]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get install -y -q zookeeper python3-pyverbs >/dev/null 2>&1 || {
            $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q zookeeper python3-pyverbs >/dev/null; }
    fi
    if ! command -v openssl >/dev/null; then
        echo "[setup] Debian openssl (certificates for the peer TLS tests)"
        if [[ $(id -u) == 0 ]]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get install -y -q openssl >/dev/null 2>&1 || {
            $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q openssl >/dev/null; }
    fi
else
    echo "[setup] emsd"
    with_build_lock .venv/bin/python -m pip install -q -e .
fi
# Compile this tree's modules once. Daemons and tests import them in hundreds of processes,
# and where PYTHONDONTWRITEBYTECODE is set (this machine's shell sets it) each would compile
# them again: about 0.2 s of CPU a process.
.venv/bin/python -m compileall -q -j 0 emsd ems benchmarks tests >/dev/null
echo "[setup] done"
