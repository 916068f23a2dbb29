"""The keeper: a tiny process that holds the pool's memfd while daemons come and go.

The pool is a sealed memfd (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so
that no client can truncate or grow the descriptor it is handed. A memfd lives
only as long as some process holds it; the keeper is that process, so a
daemon killed with -9, crashed or restarted finds its pool again (warm
restart). It listens on a Unix socket in the state directory,
``<state_dir>/emsd-<node.id>.keeper`` (mode 0600), and answers the daemon's
user only (``SO_PEERCRED``):

    G             -> 8-byte little-endian size (0: holding nothing), with the
                     memfd attached (SCM_RIGHTS) when it holds one
    P + memfd     -> b"K": hold this one from now on (the previous one is let go)

A daemon that finds no keeper starts one (``spawn``: its own session, so
signals to the daemon's process group do not reach it) and hands it the new
pool. In Kubernetes the chart runs it as a container of its own in the pod,
so that it outlives restarts of the emsd container.

The keeper exits, letting the pool go (its memory is freed once the daemon
and every client have let go too), when its socket file is removed or
replaced: ``stop(path)`` does that, and so does removing the state directory.
``python -m emsd.pool.keeper PATH`` runs one on its own: it takes over the
pool of a keeper already at PATH, if there is one, and starts empty otherwise.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
from pathlib import Path

SIZE = struct.Struct("<Q")
POLL = 1.0  # seconds between two looks at whether the socket file is still ours
TIMEOUT = 5.0  # a daemon's exchange with the keeper, and a client's with it


class KeeperError(Exception):
    """The keeper cannot be reached or answered badly; ``str()`` is one line."""


# -- the daemon's side -----------------------------------------------------------


def fetch(path: Path) -> int | None:
    """The memfd the keeper at ``path`` holds (a new descriptor), or None if it holds none.

    Raises ``FileNotFoundError`` or ``ConnectionRefusedError`` when no keeper
    listens there, ``KeeperError`` when one answers badly.
    """
    with _dial(path) as sock:
        sock.sendall(b"G")
        data, fds = _recv_fds(sock, SIZE.size)
    if len(data) != SIZE.size:
        _close_all(fds)
        raise KeeperError(f"the keeper at {path} answered {len(data)} bytes, not {SIZE.size}")
    (size,) = SIZE.unpack(data)
    if size == 0 or len(fds) != 1:
        _close_all(fds)
        return None
    return fds[0]


def put(path: Path, fd: int) -> None:
    """Make the keeper at ``path`` hold ``fd`` (a copy travels; ``fd`` stays ours)."""
    with _dial(path) as sock:
        socket.send_fds(sock, [b"P"], [fd])
        if sock.recv(1) != b"K":
            raise KeeperError(f"the keeper at {path} did not take the pool")


def spawn(path: Path, fd: int) -> None:
    """Start a keeper listening at ``path`` and holding ``fd``.

    The daemon binds the socket (so it is there when this returns, with mode
    0600 from the start) and passes it with ``fd`` to the new process, which
    runs in a session of its own. A stale socket file at ``path`` is replaced.
    Raises ``OSError`` if it cannot be started.
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = _listen(path)
    try:
        # The child forks the keeper and exits at once: the keeper is nobody's child here (no
        # zombie when it exits, nothing to wait for), and it runs in a session of its own.
        subprocess.run(
            [sys.executable, "-m", "emsd.pool.keeper", "--detach", str(path), str(listener.fileno()),
             str(fd)], pass_fds=(listener.fileno(), fd), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True, check=True, timeout=30)
    except subprocess.SubprocessError as exc:
        raise OSError(f"the keeper did not start: {exc}") from None
    finally:
        listener.close()


def _listen(path: Path) -> socket.socket:
    """A Unix socket listening at ``path``, mode 0600 from its creation (bound under umask 0177)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        umask = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(umask)
        listener.listen(16)
    except BaseException:
        listener.close()
        raise
    return listener


def stop(path: Path) -> None:
    """Let the keeper at ``path`` go: it exits within ``POLL`` seconds of its socket's removal."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _dial(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    try:
        sock.connect(str(path))
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_fds(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    try:
        data, fds, _, _ = socket.recv_fds(sock, size, 1)
    except (OSError, TimeoutError) as exc:
        raise KeeperError(f"the keeper did not answer: {exc}") from None
    return data, list(fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- the keeper's side -----------------------------------------------------------


def serve(path: Path, listener: socket.socket, fd: int | None) -> None:
    """Answer G and P on ``listener`` until the socket file at ``path`` is removed or replaced."""
    st = os.stat(path)
    mine = (st.st_dev, st.st_ino)
    while _still_mine(path, mine):
        ready, _, _ = select.select([listener], [], [], POLL)
        if not ready:
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        with conn:
            conn.settimeout(TIMEOUT)
            with contextlib.suppress(OSError, TimeoutError):
                fd = _answer(conn, fd)


def _answer(conn: socket.socket, fd: int | None) -> int | None:
    """One request on ``conn``; returns the descriptor held afterwards."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        return fd  # only the daemon's user: anyone else is hung up on
    op, fds, _, _ = socket.recv_fds(conn, 1, 1)
    if op == b"G":
        size = os.fstat(fd).st_size if fd is not None else 0
        socket.send_fds(conn, [SIZE.pack(size)], [fd] if fd is not None else [])
    elif op == b"P" and len(fds) == 1:
        if fd is not None:
            os.close(fd)
        fd = fds[0]
        conn.sendall(b"K")
    else:
        _close_all(list(fds))
    return fd


def _still_mine(path: Path, mine: tuple[int, int]) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == mine


def main(argv: list[str]) -> int:
    """``[--detach] PATH [LISTEN_FD MEMFD]``: serve at PATH (binding it when no descriptors are
    given); with ``--detach``, in a forked process, this one exiting at once."""
    if argv[:1] == ["--detach"]:
        argv = argv[1:]
        if os.fork() != 0:
            os._exit(0)
    if len(argv) not in (1, 3):
        print("usage: python -m emsd.pool.keeper PATH", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if len(argv) == 3:
        listener = socket.socket(fileno=int(argv[1]))
        fd: int | None = int(argv[2])
    else:
        fd = _take_over(path)
        listener = _listen(path)
    serve(path, listener, fd)
    return 0


def _take_over(path: Path) -> int | None:
    """The pool a keeper already at ``path`` holds (None if none), its socket file removed so
    that it exits: a keeper started on its own (a container of its own in Kubernetes) takes
    over from one a daemon started before it, and the pool stays kept."""
    try:
        fd = fetch(path)
    except (OSError, KeeperError):
        fd = None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return fd


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
