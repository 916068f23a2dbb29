"""Starting the cache servers the engine benchmark compares (Mooncake Store, LMCache's server)
as processes on loopback, each logging to a file of its own."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a later bind by someone else may still take it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def tail(log: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of ``log``, joined on one line."""
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_listening(name: str, argv: list[str], log: Path, address: str,
                    timeout: float) -> subprocess.Popen[bytes]:
    """Start ``argv`` logging to ``log``; return the process once ``address`` (host:port) accepts
    connections. ``RuntimeError`` (with the log's tail) if it exits first or does not listen
    within ``timeout`` seconds; the caller stops a process that does not listen."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return proc
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{name} did not listen on {address} in {timeout:.0f} s: {tail(log)}")
        time.sleep(0.05)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate ``procs`` last first (kill after 5 s), and forget them."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    procs.clear()
