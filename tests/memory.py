"""Memory of a daemon process as the chaos tests measure it.

``private_rss(pid)`` is the resident memory the process owns alone:
psutil's ``rss - shared``, i.e. the kernel's RssAnon (heap, stacks, Python
objects). The pool is a shared file mapping: touching its pages raises RSS
without being a leak, so it is left out.

``allowed_growth(members, connections)`` is what a daemon may keep above
its idle baseline once a cluster has carried load: one scratch buffer
(``emsd.transport.peer.SCRATCH``) per peer connection, in both directions
(its own links to each peer, and each peer's links to it), plus ``SLACK``
for the Python heap and the allocator. Measured on the 3-node chaos runs
(2 connections per peer, so 32 MiB of scratch): 33 MiB above the baseline
on every node, in four runs of the two chaos tests on 2026-11-26. Before that
day a closed peer link kept its 4 MiB scratch buffer until the garbage
collector's next full pass (a failed request's traceback holds the link in
a reference cycle), and the node that lived through its peers' restarts
measured 37-81 MiB above. So the bound, 64 MiB, catches what grows with
the load (a buffer or a connection kept per request, per reconnect or per
failure: the runs make thousands of requests and dozens of reconnects) but
not a small fixed leak.

``measurable(monkeypatch)`` makes the daemons a test starts return freed
memory to the kernel, so that RSS measures live memory: one malloc arena
(glibc otherwise keeps per-thread arenas that hold freed memory; the bulk
threads each get one) and a fixed mmap threshold (glibc otherwise raises it
after the first large free, and later 4 MiB buffers stay in the heap when
freed). Without it a node that carried the chaos load measured up to
30 MiB more than with it.
"""

from __future__ import annotations

import psutil
import pytest

from emsd.transport.peer import SCRATCH

MiB = 1 << 20
SLACK = 32 * MiB


def measurable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start daemons (children of this process) with a glibc malloc that gives freed memory back."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))


def private_rss(pid: int) -> int:
    info = psutil.Process(pid).memory_info()
    return int(info.rss - info.shared)


def allowed_growth(members: int, connections: int) -> int:
    return 2 * connections * (members - 1) * SCRATCH + SLACK
