"""The daemon's own directories and files: never another user's, never through a symlink.

The socket directory and the state directory hold the control socket, the
pool file and the ledger. A directory another user can write to lets that
user plant a symlink named like one of these files, and the daemon would
then truncate and overwrite whatever it points at; a file another user owns
or can write is not the daemon's to trust. So:

- ``check_dir``: a directory must be owned by the daemon's user and not be
  writable by others (group-writable is the operator's choice).
- ``open_own``: files are opened with ``O_NOFOLLOW`` (a symlink is refused,
  never followed), then checked with ``fstat`` on the open descriptor (no
  race with a rename): a regular file of the daemon's user, not writable by
  group or others.

Both raise ``UnsafePath`` with a one-line reason for the start-up error.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnsafePath(Exception):
    """A directory or file the daemon must not use; ``str()`` is one line for the operator."""


def check_dir(path: Path) -> None:
    """Raise ``UnsafePath`` unless ``path`` is a directory of the daemon's user that others
    cannot write to (``OSError`` if it cannot be looked at)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to the daemon's user (uid "
                         f"{os.geteuid()}): another user could plant files in it; chown it or use another")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafePath(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): another "
                         f"user could plant symlinks in it; chmod o-w it or use another")


def open_own(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``, then checked: a regular file
    of the daemon's user, not writable by group or others. Raises ``UnsafePath`` (the
    descriptor closed) or ``OSError``."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link: refused, not followed (remove it)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to the daemon's user (uid "
                             f"{os.geteuid()}): remove it")
        if st.st_mode & 0o022:
            raise UnsafePath(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                             "chmod 600 it or remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd
