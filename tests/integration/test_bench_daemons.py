"""The benchmarks' daemons (benchmarks/workload/daemons.py) against real emsd processes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.workload import daemons

PREFAULT = 'state="done"', 'state="total"'


def test_wait_prefaulted_returns_once_every_page_of_the_pool_is_faulted_in(tmp_path: Path) -> None:
    dep = daemons.start(tmp_path, 1, 512 << 20, "lru", prefault=True)
    try:
        dep.wait_prefaulted(timeout=120)
        node = dep.nodes[0]
        done, total = (node.metric("emsd_pool_prefault_bytes", label) for label in PREFAULT)
        assert done == total == 512 << 20
    finally:
        dep.stop()


def test_wait_prefaulted_without_a_prefault_returns_at_once(tmp_path: Path) -> None:
    dep = daemons.start(tmp_path, 1, 16 << 20, "lru", prefault=False)
    try:
        dep.wait_prefaulted(timeout=0)  # nothing to wait for: no deadline to pass
        assert dep.nodes[0].metric("emsd_pool_prefault_bytes", PREFAULT[1]) == 0
    finally:
        dep.stop()
