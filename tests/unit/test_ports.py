"""The tests' port picker: outside the ephemeral range, never the same port twice, never a bound one."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ports  # noqa: E402


def test_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < ports._ephemeral_start() for p in got)


def test_a_port_held_by_a_listener_is_skipped() -> None:
    held = ports._next
    with socket.socket() as s:
        s.bind(("127.0.0.1", held))
        s.listen()
        got = ports.free_port()
    assert got != held


@given(st.integers(1, 64), st.integers(10000, 20000), st.integers(1000, 40000))
def test_each_xdist_worker_walks_a_part_of_its_own(n: int, lowest: int, width: int) -> None:
    highest = lowest + width
    parts = [ports.worker_range(f"gw{i}", str(n), lowest, highest) for i in range(n)]
    assert all(lowest <= lo < hi <= highest for lo, hi in parts)
    assert all(a[1] <= b[0] for a, b in zip(parts[:-1], parts[1:], strict=True))  # in order, none overlapping
    assert parts[-1][1] - parts[0][0] > highest - lowest - n  # together, all but a remainder


@pytest.mark.parametrize(("worker", "count"), [(None, None), ("gw2", None), ("main", "4"), ("gw4", "4"),
                                               ("gwx", "4"), ("gw1", "0")])
def test_a_process_that_is_no_worker_walks_the_whole_range(worker: str | None, count: str | None) -> None:
    assert ports.worker_range(worker, count, 10000, 32768) == (10000, 32768)


def test_this_process_walks_its_part() -> None:
    lo, hi = ports.worker_range(os.environ.get("PYTEST_XDIST_WORKER"),
                                os.environ.get("PYTEST_XDIST_WORKER_COUNT"), ports.LOWEST, ports._HIGHEST)
    assert all(lo <= ports.free_port() < hi for _ in range(50))
