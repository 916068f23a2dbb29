#!/usr/bin/env bash
# Install everything the tests need, then run them: lint, types, the test suite, then the
# engine tests in venvs of their own: real vLLM engines (scripts/test-vllm.sh) and the
# LMCache and SGLang backends (scripts/test-engines.sh). EMS_SKIP_ENGINES=1 leaves those out.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES=1
[[ "${EMS_SKIP_ENGINES:-0}" == 1 || "${EMS_SKIP_VLLM:-0}" == 1 ]] && ENGINES=0
if ((ENGINES)); then
    # The engine venvs install from the start, beside the set-up and then the main suite, at a
    # lower priority: the suite's timeouts are the ones that matter. setsid gives the set-up a
    # session of its own (a process group to stop); where the kernel shares the CPU out by
    # session first (autogroup), nice alone would not lower it against the suite, so its
    # session's group is lowered too. It marks in $ready what is ready: "built" (.venv-vllm has
    # this tree installed: the suite waits for that, since an editable build rewrites the tree's
    # C extensions, scripts/build-lock.sh), "vllm" (the venvs of scripts/test-vllm.sh), then
    # "engines" (scripts/test-engines.sh's).
    setup_log=$(mktemp) ready=$(mktemp -d)
    EMS_SETUP_BUILT="$ready/built" setsid nice -n 10 bash -c '{ echo 10 >/proc/self/autogroup; } 2>/dev/null || true
        scripts/setup-vllm.sh && scripts/setup-lmcache-vllm.sh && scripts/setup-mooncake-vllm.sh \
        && touch "$0/vllm" && scripts/setup-engines.sh && touch "$0/engines"' "$ready" >"$setup_log" 2>&1 &
    setup_pid=$!
    trap 'kill -- "-$setup_pid" 2>/dev/null || true' EXIT  # a stage that fails stops it too
fi
wait_for_setup() {  # wait_for_setup built|vllm|engines: until that part of the venvs' set-up is ready
    while [[ ! -e $ready/$1 ]]; do
        if ! kill -0 "$setup_pid" 2>/dev/null && [[ ! -e $ready/$1 ]]; then
            cat "$setup_log" >&2
            echo "[test] setting up the engine venvs failed" >&2
            return 1
        fi
        sleep 1
    done
}
echo "[test] $(date +%T) set-up"
scripts/setup.sh --test
echo "[test] $(date +%T) ruff"
.venv/bin/ruff check emsd ems tests benchmarks
echo "[test] $(date +%T) mypy"
.venv/bin/mypy emsd ems
# Most tests wait on daemons, ZooKeeper and sockets: four workers (pytest-xdist) keep two
# cores busy. EMS_TEST_WORKERS=0 runs them in this process, one after another. Tests marked
# serial (the hugepage count is the machine's) run after, alone.
workers="${EMS_TEST_WORKERS:-4}"
selected=$(($# > 0))  # arguments given: they select tests
pytest_part() {  # a selection of arguments may leave one part with no test: that is no failure
    local rc=0
    .venv/bin/python -m pytest -q "$@" || rc=$?
    ((rc == 5 && selected)) && return 0
    return "$rc"
}
if ((ENGINES)); then
    wait_for_setup built  # no editable build of the tree runs beside the suite from here on
fi
echo "[test] $(date +%T) pytest ($workers workers)"
pytest_part --durations=15 -n "$workers" -m "not serial" "$@"
echo "[test] $(date +%T) pytest, the serial tests"
pytest_part -m serial "$@"
if ((ENGINES)); then
    echo "[test] $(date +%T) the engine venvs"
    wait_for_setup vllm
    export EMS_ENGINE_VENVS_READY=1  # the two scripts below need not set them up again
    # The LMCache and SGLang tests run beside the vLLM tests, in the time their two workers
    # leave (the engine benchmark's quick run is the longest); their output follows.
    engines_log=$(mktemp)
    { wait_for_setup engines && scripts/test-engines.sh; } >"$engines_log" 2>&1 &
    engines_pid=$!
    vllm_rc=0
    scripts/test-vllm.sh || vllm_rc=$?
    engines_rc=0
    wait "$engines_pid" || engines_rc=$?
    cat "$engines_log"
    ((vllm_rc == 0 && engines_rc == 0)) || exit 1
fi
echo "[test] $(date +%T) done"
