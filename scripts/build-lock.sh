# Sourced by the set-up scripts: with_build_lock CMD... runs CMD (a command or a shell function)
# holding this user's lock on editable builds of the tree. Each `pip install -e` builds emsd's C
# extensions into the tree, and scripts/test.sh runs the engine venvs' set-up beside
# scripts/setup.sh: one build at a time.
with_build_lock() {
    (flock 9 && "$@") 9>"${TMPDIR:-/tmp}/emsd-editable-$(id -u).lock"
}
