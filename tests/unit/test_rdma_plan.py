"""Region chunking and work-request planning for the RDMA transport (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.transport.rdma_plan import (
    CHUNK_ALIGN,
    MAX_CHUNKS,
    Chunk,
    PlanError,
    chunk_region,
    plan,
    segments,
)


@given(size=st.integers(0, 1 << 44), max_chunk=st.integers(CHUNK_ALIGN, 1 << 32))
def test_chunks_cover_the_region_contiguously_within_the_limits(size: int, max_chunk: int) -> None:
    chunks = chunk_region(size, max_chunk)
    assert len(chunks) <= MAX_CHUNKS
    assert sum(length for _, length in chunks) == size
    off = 0
    for start, length in chunks:
        assert start == off and length > 0
        off += length
    for start, length in chunks[:-1]:
        assert length % CHUNK_ALIGN == 0
        assert start % CHUNK_ALIGN == 0


def test_small_pools_get_chunks_of_the_requested_size() -> None:
    assert chunk_region(10 << 20, 4 << 20) == [(0, 4 << 20), (4 << 20, 4 << 20), (8 << 20, 2 << 20)]
    assert chunk_region(0) == []


def test_chunking_rejects_nonsense() -> None:
    with pytest.raises(PlanError):
        chunk_region(-1)
    with pytest.raises(PlanError):
        chunk_region(1 << 20, 100)


def _chunks(sizes: list[int], base: int, key0: int) -> list[Chunk]:
    out, off = [], 0
    for i, size in enumerate(sizes):
        out.append(Chunk(off, size, key0 + i, base + off))
        off += size
    return out


LOCAL_BASE, REMOTE_BASE = 1 << 40, 1 << 41


@st.composite
def transfers(draw: st.DrawFn) -> tuple[list[Chunk], list[Chunk], list[tuple[int, int, int]]]:
    lsizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=6))
    rsizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=6))
    local, remote = _chunks(lsizes, LOCAL_BASE, 1), _chunks(rsizes, REMOTE_BASE, 100)
    ltotal, rtotal = sum(lsizes), sum(rsizes)
    blocks = []
    for _ in range(draw(st.integers(0, 8))):
        length = draw(st.integers(0, min(ltotal, rtotal)))
        blocks.append((draw(st.integers(0, ltotal - length)), draw(st.integers(0, rtotal - length)), length))
    return local, remote, blocks


@settings(max_examples=300)
@given(t=transfers(), max_sge=st.integers(1, 5), max_bytes=st.integers(1, 80))
def test_plan_moves_every_byte_once_in_order_within_the_limits(
        t: tuple[list[Chunk], list[Chunk], list[tuple[int, int, int]]], max_sge: int, max_bytes: int) -> None:
    local, remote, blocks = t
    wrs = plan(segments(blocks, local, remote), local, remote, max_sge, max_bytes, first_id=7)
    # Byte by byte: which local address goes to which remote address, in order.
    want = [(LOCAL_BASE + lo + i, REMOTE_BASE + ro + i) for lo, ro, n in blocks for i in range(n)]
    got = []
    for wr in wrs:
        assert 1 <= len(wr.sges) <= max_sge and wr.length <= max_bytes
        rc = next(c for c in remote if c.key == wr.rkey)  # one remote chunk per request
        assert rc.addr <= wr.remote_addr and wr.remote_addr + wr.length <= rc.addr + rc.length
        raddr = wr.remote_addr
        for sge in wr.sges:
            lc = next(c for c in local if c.key == sge.lkey)  # each element inside its local chunk
            assert sge.length > 0 and lc.addr <= sge.addr and sge.addr + sge.length <= lc.addr + lc.length
            got += [(sge.addr + i, raddr + i) for i in range(sge.length)]
            raddr += sge.length
    assert got == want
    assert [wr.wr_id for wr in wrs] == list(range(7, 7 + len(wrs)))


def test_contiguous_blocks_share_one_request_and_one_element() -> None:
    local, remote = _chunks([1 << 20], LOCAL_BASE, 1), _chunks([1 << 20], REMOTE_BASE, 100)
    blocks = [(0, 4096, 1000), (1000, 5096, 1000), (2000, 6096, 1000)]
    (wr,) = plan(segments(blocks, local, remote), local, remote, max_sge=4)
    assert len(wr.sges) == 1 and wr.length == 3000 and wr.remote_addr == REMOTE_BASE + 4096


def test_remote_contiguous_local_scattered_blocks_use_a_scatter_list_up_to_max_sge() -> None:
    local, remote = _chunks([1 << 20], LOCAL_BASE, 1), _chunks([1 << 20], REMOTE_BASE, 100)
    blocks = [(i * 10_000, i * 100, 100) for i in range(5)]
    wrs = plan(segments(blocks, local, remote), local, remote, max_sge=2)
    assert [len(w.sges) for w in wrs] == [2, 2, 1]


def test_a_block_crossing_a_chunk_boundary_is_split() -> None:
    local, remote = _chunks([100, 100], LOCAL_BASE, 1), _chunks([300], REMOTE_BASE, 100)
    segs = segments([(50, 0, 100)], local, remote)
    assert [(s.local, s.length, s.lchunk) for s in segs] == [(50, 50, 0), (100, 50, 1)]
    (wr,) = plan(segs, local, remote, max_sge=2)
    assert [s.lkey for s in wr.sges] == [1, 2]


def test_a_block_outside_the_regions_is_refused() -> None:
    local, remote = _chunks([100], LOCAL_BASE, 1), _chunks([100], REMOTE_BASE, 100)
    with pytest.raises(PlanError):
        segments([(50, 0, 51)], local, remote)
    with pytest.raises(PlanError):
        plan([], local, remote, max_sge=0)
