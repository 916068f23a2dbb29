# Sourced by the set-up scripts: make_linked_venv SRC DST makes the venv DST (replacing it) with
# SRC's installed packages, hard-linked where both are on one file system (else copied): torch and
# the rest are not unpacked again, and pip, which replaces files rather than writing into them,
# changes only DST's. DST gets no pip of its own: SRC's comes with the packages. Only the packages
# come along, not SRC's bin/ scripts (run tools as DST/bin/python -m NAME).
site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

make_linked_venv() {
    local src=$1 dst=$2 from to
    rm -rf "$dst"
    "${PYTHON:-python3}" -m venv --without-pip "$dst"
    from=$(site_packages "$src") to=$(site_packages "$dst")
    rm -rf "$to"
    if ! cp -al "$from" "$to" 2>/dev/null; then
        rm -rf "$to"
        cp -a "$from" "$to"
    fi
}
