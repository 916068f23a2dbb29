"""Loopback ports for the servers that tests start, taken outside the kernel's ephemeral range.

A port found with ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default). It is free only
until the server binds it, and in that window any outgoing connection on the
machine (a ZooKeeper client, an HTTP probe, a peer dial) may be given the same
port: under four xdist workers a daemon then failed with "metrics.listen:
cannot listen ... Address already in use". Ports below the ephemeral range are
never handed to outgoing connections, so only another listener can take them.

``free_port()`` walks that range from a start chosen per process, never
returns the same port twice in one process, and skips a port it cannot bind
now. An xdist worker walks only its own share of the range (``worker_range``:
worker i of n takes the i-th of n equal parts), so that two workers never hand
out the same port: with starting points chosen per process alone, two
workers' walks met in a CI run and handed the same ports to daemons starting
at once ("cluster.peer_listen: cannot listen ... Address already in use", seven
times in one run). A process a worker starts (a benchmark a test runs)
inherits the worker's part, while the worker waits for it. Processes that
are not workers (a pytest session of its own) walk the whole range from a
start of their own; two of them can still meet, which is unlikely; it is not
a lock.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services a test machine may run


def _ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (32768 when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HIGHEST = max(_ephemeral_start(), LOWEST + 1000)  # exclusive


def worker_range(worker: str | None, count: str | None, lowest: int, highest: int) -> tuple[int, int]:
    """The ports ``[lo, hi)`` of ``[lowest, highest)`` that xdist worker ``worker`` ("gw3", from
    ``PYTEST_XDIST_WORKER``) of ``count`` workers (``PYTEST_XDIST_WORKER_COUNT``) walks: the
    worker's own equal part; the whole range for anything that is not a worker."""
    try:
        i, n = int((worker or "")[2:]), int(count or "")
    except ValueError:
        return lowest, highest
    if not (worker or "").startswith("gw") or not 0 <= i < n:
        return lowest, highest
    part = (highest - lowest) // n
    return lowest + i * part, lowest + (i + 1) * part


_LO, _HI = worker_range(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
                        LOWEST, _HIGHEST)
_given: set[int] = set()
_next = random.Random(os.getpid()).randrange(_LO, _HI)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port that no listener holds now and that this process has not handed out."""
    global _next
    for _ in range(_HI - _LO):
        port, _next = _next, _LO + (_next + 1 - _LO) % (_HI - _LO)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {_LO}-{_HI - 1}")
