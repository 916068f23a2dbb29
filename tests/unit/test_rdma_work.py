"""Posting work requests with a bounded number in flight, and polling completions.

Runs against ``tests/fake_verbs.FakeEngine``, which copies bytes in memory:
this checks the driver's logic, not RDMA.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_verbs import FakeEngine, FakeFabric  # noqa: E402

from emsd.transport.rdma import pool_address, run_work  # noqa: E402
from emsd.transport.rdma_plan import Chunk, plan, segments  # noqa: E402
from emsd.transport.verbs import Opcode, RdmaError, WorkRequest  # noqa: E402


class Pair:
    """Two buffers registered on one fake fabric and a connected QP between two engines."""

    def __init__(self, size: int = 1 << 16, **engine: object) -> None:
        self.fabric = FakeFabric()
        self.engine = FakeEngine(self.fabric, "a", **engine)  # type: ignore[arg-type]
        other = FakeEngine(self.fabric, "b")
        self.local, self.remote = bytearray(size), bytearray(range(256)) * (size // 256)
        lm = self.engine.register(0, pool_address(memoryview(self.local)), size)
        rm = other.register(0, pool_address(memoryview(self.remote)), size)
        self.lchunks = [Chunk(0, size, lm.lkey, lm.addr)]
        self.rchunks = [Chunk(0, size, rm.rkey, rm.addr)]
        self.qp, mine = self.engine.create_qp(8, 4)
        theirs, addr = other.create_qp(8, 4)
        self.engine.connect_qp(self.qp, addr)
        other.connect_qp(theirs, mine)

    def wrs(self, blocks: list[tuple[int, int, int]], max_sge: int = 4) -> list[WorkRequest]:
        return plan(segments(blocks, self.lchunks, self.rchunks), self.lchunks, self.rchunks, max_sge)


BLOCKS = [(i * 1000, i * 700 + 3, 500) for i in range(40)]


async def test_all_requests_complete_and_the_bytes_arrive() -> None:
    p = Pair(lag=2)
    wrs = p.wrs(BLOCKS)
    await run_work(p.engine, p.qp, Opcode.READ, wrs, max_outstanding=5)
    assert p.engine.posted == len(wrs)
    for lo, ro, n in BLOCKS:
        assert p.local[lo : lo + n] == p.remote[ro : ro + n]


async def test_writes_go_the_other_way() -> None:
    p = Pair()
    p.local[:] = bytes(reversed(p.remote))
    await run_work(p.engine, p.qp, Opcode.WRITE, p.wrs(BLOCKS), max_outstanding=3)
    for lo, ro, n in BLOCKS:
        assert p.remote[ro : ro + n] == p.local[lo : lo + n]


@pytest.mark.parametrize("limit", [1, 3, 8])
async def test_never_more_than_max_outstanding_in_flight(limit: int) -> None:
    p = Pair(lag=3, max_wr=limit)  # the fake refuses a post beyond max_wr
    await run_work(p.engine, p.qp, Opcode.READ, p.wrs(BLOCKS, max_sge=1), max_outstanding=limit)
    assert p.engine.peak_inflight == limit


async def test_a_failed_completion_raises() -> None:
    p = Pair(fail=lambda wr: wr.wr_id == 7)
    with pytest.raises(RdmaError, match="fake injected error"):
        await run_work(p.engine, p.qp, Opcode.READ, p.wrs(BLOCKS, max_sge=1), max_outstanding=4)


async def test_polling_yields_to_the_event_loop_while_nothing_completes() -> None:
    p = Pair(lag=50)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await run_work(p.engine, p.qp, Opcode.READ, p.wrs(BLOCKS[:2]), max_outstanding=4)
    task.cancel()
    assert ticks >= 50


async def test_a_silent_queue_pair_fails_after_the_stall_limit() -> None:
    p = Pair(lag=10**9)
    with pytest.raises(RdmaError, match="no completion"):
        await run_work(p.engine, p.qp, Opcode.READ, p.wrs(BLOCKS[:1]), max_outstanding=4, stall=0.05)
