# Sourced by the set-up scripts: with_build_lock CMD... runs CMD (a command or a shell function)
# holding this user's lock on editable builds of the tree. Each `pip install -e` builds emsd's C
# extensions into the tree, and scripts/test.sh runs the engine venvs' set-up beside
# scripts/setup.sh: one build at a time.
with_build_lock() {
    (flock 9 && "$@") 9>"${TMPDIR:-/tmp}/emsd-editable-$(id -u).lock"
}

# An editable build writes the C extensions into the tree in place (same file, truncated and
# written again), under any process that has them loaded: a test's daemon could crash on a page
# of its extension read mid-write. So the engine venvs install this tree only when their stamp
# (VENV/.emsd-pyproject) says it was not installed with the pyproject.toml as it is now (its
# dependencies may have changed); the extensions themselves are the tree's, built by
# scripts/setup.sh. Run from the tree's root.
emsd_installed() {  # emsd_installed VENV: VENV has this tree installed for this pyproject.toml
    [[ "$(cat "$1/.emsd-pyproject" 2>/dev/null)" == "$(sha256sum pyproject.toml | cut -c1-16)" ]] \
        && "$1/bin/python" -I -c 'import emsd, os, sys
sys.exit(not emsd.__file__.startswith(os.getcwd() + os.sep))' 2>/dev/null
}
mark_emsd_installed() {  # mark_emsd_installed VENV: the stamp of emsd_installed
    sha256sum pyproject.toml | cut -c1-16 >"$1/.emsd-pyproject"
}
