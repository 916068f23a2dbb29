"""Loopback ports for the servers that tests start, taken outside the kernel's ephemeral range.

A port found with ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default). It is free only
until the server binds it, and in that window any outgoing connection on the
machine (a ZooKeeper client, an HTTP probe, a peer dial) may be given the same
port: under four xdist workers a daemon then failed with "metrics.listen:
cannot listen ... Address already in use". Ports below the ephemeral range are
never handed to outgoing connections, so only another listener can take them.

``free_port()`` walks that range from a start chosen per process (pytest
sessions and xdist workers run side by side), never returns the same port
twice in one process, and skips a port it cannot bind now. Two processes can
still pick the same port at the same instant only if their walks meet, which
the spread of starting points makes unlikely; it is not a lock.
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
_given: set[int] = set()
_next = random.Random(os.getpid()).randrange(LOWEST, _HIGHEST)


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
    for _ in range(_HIGHEST - LOWEST):
        port, _next = _next, LOWEST + (_next + 1 - LOWEST) % (_HIGHEST - LOWEST)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {LOWEST}-{_HIGHEST - 1}")
