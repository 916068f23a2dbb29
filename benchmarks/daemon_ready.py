"""Waiting for a benchmark's daemon: ready, and its pool faulted in.

A daemon is ready before its pool is faulted in (``pool.prefault`` runs in
the background, ``emsd/pool/prefault.py``); a benchmark measures the steady
state, so it waits for both.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def prefaulted(port: int) -> bool:
    """Whether the daemon's background prefault is over (or it runs none)."""
    status, body = _get(port, "/metrics")
    if status != 200:
        return False
    done = total = 0.0
    for line in body.splitlines():
        if line.startswith('emsd_pool_prefault_bytes{state="done"}'):
            done = float(line.split()[-1])
        elif line.startswith('emsd_pool_prefault_bytes{state="total"}'):
            total = float(line.split()[-1])
    return done >= total


def wait(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 300.0) -> None:
    """Until the daemon on metrics ``port`` is ready and its pool faulted in (asked at least
    once, also with ``timeout`` 0); ``RuntimeError`` naming ``what`` if ``proc`` exits first or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        if _get(port, "/readyz")[0] == 200 and prefaulted(port):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} was not ready with its pool faulted in after {timeout:.0f} s")
