"""The benchmarks' daemons (benchmarks/workload/daemons.py) against real emsd processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.workload import daemons

PREFAULT = 'state="done"', 'state="total"'


@pytest.fixture
def work() -> Iterator[Path]:
    """A short directory of its own: socket paths must stay under the 108 bytes of a Unix address
    (pytest's tmp_path under xdist is too long for them)."""
    path = Path(tempfile.mkdtemp(prefix="emsd-bd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_wait_prefaulted_returns_once_every_page_of_the_pool_is_faulted_in(work: Path) -> None:
    dep = daemons.start(work, 1, 512 << 20, "lru", prefault=True)
    try:
        dep.wait_prefaulted(timeout=120)
        node = dep.nodes[0]
        done, total = (node.metric("emsd_pool_prefault_bytes", label) for label in PREFAULT)
        assert done == total == 512 << 20
    finally:
        dep.stop()


def test_wait_prefaulted_without_a_prefault_returns_at_once(work: Path) -> None:
    dep = daemons.start(work, 1, 16 << 20, "lru", prefault=False)
    try:
        dep.wait_prefaulted(timeout=0)  # nothing to wait for: no deadline to pass
        assert dep.nodes[0].metric("emsd_pool_prefault_bytes", PREFAULT[1]) == 0
    finally:
        dep.stop()
