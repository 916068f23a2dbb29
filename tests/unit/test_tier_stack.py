"""TierStack (emsd.tier.stack): a real BlockStore over a real pool buffer above a real DiskTier.

The properties take a load's keys each in one of five states (absent, in DRAM, on disk, in
both, owned by another node) and check ``exists``, ``wanted`` and ``promote`` against a model:
the leading run a PIN can serve, and within it the blocks only the disk holds. ``promote``
must bring exactly those into the pool, byte for byte, and touch nothing else.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Status
from emsd.tier.disk import DiskTier
from emsd.tier.engine import aligned
from emsd.tier.stack import TierStack

PAGE = 64 << 10
BLOCK = 16 << 10
POOL = 32 * PAGE
EXTENT = 1 << 20
NS, NAME = 1, "ns"
ABSENT, DRAM, DISK, BOTH, ELSEWHERE = range(5)
NEW = int(Status.NEW)


def _bytes(key: int) -> bytes:
    return np.random.default_rng(key).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


@contextmanager
def _stack() -> Iterator[TierStack]:
    """A TierStack over a fresh pool and a fresh disk tier (in /var/tmp: tmpfs refuses O_DIRECT)."""
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="emsd-stack-test-", dir=base))
    pool = aligned(POOL)
    disk = DiskTier(path, 8 * EXTENT, extent=EXTENT)
    try:
        yield TierStack(BlockStore(POOL, PAGE), disk, memoryview(pool), lambda ns: NAME)
    finally:
        disk.close()  # the pool's mmap goes with its last view
        shutil.rmtree(path, ignore_errors=True)


def _in_dram(stack: TierStack, keys: list[int]) -> None:
    res = stack.store.reserve(NS, KeyBatch.from_user(keys), np.full(len(keys), BLOCK, dtype=np.uint64))
    assert (res.status == NEW).all()
    for key, at in zip(keys, res.offsets.tolist(), strict=True):
        stack.pool[at : at + BLOCK] = _bytes(key)
    stack.store.commit(res.handles)


def _held_writes(stack: TierStack) -> threading.Event:
    """Hold the disk tier's writer threads until the returned event is set (demotions stay queued)."""
    go = threading.Event()
    write = stack.disk._write

    def held(*args: Any) -> None:
        go.wait(30)
        write(*args)

    stack.disk._write = held  # type: ignore[method-assign,assignment]
    return go


def _queue(stack: TierStack, keys: list[int]) -> KeyBatch:
    """Demote blocks of ``keys`` (their bytes ``_bytes``) to the tier's write queue; the batch."""
    staging = aligned(len(keys) * BLOCK)
    for i, key in enumerate(keys):
        staging[i * BLOCK : (i + 1) * BLOCK] = _bytes(key)
    offsets = np.arange(len(keys), dtype=np.uint64) * np.uint64(BLOCK)
    batch = KeyBatch.from_user(keys)
    assert stack.disk.demote(NAME, batch, memoryview(staging), offsets,
                             np.full(len(keys), BLOCK, dtype=np.uint64)) == len(keys)
    return batch


def _on_disk(stack: TierStack, keys: list[int]) -> None:
    _queue(stack, keys)
    assert stack.disk.wait_idle(30)


def _place(stack: TierStack, states: list[int]) -> tuple[KeyBatch, int, np.ndarray]:
    """Key ``100 + i`` in state ``states[i]``; the load's keys, its leading DRAM count and
    ``elsewhere``."""
    keys = [100 + i for i, _ in enumerate(states)]
    dram = [k for k, s in zip(keys, states, strict=True) if s in (DRAM, BOTH)]
    disk = [k for k, s in zip(keys, states, strict=True) if s in (DISK, BOTH)]
    if disk:
        _on_disk(stack, disk)
    if dram:
        _in_dram(stack, dram)
    batch = KeyBatch.from_user(keys)
    return batch, stack.store.exists(NS, batch), np.array([s == ELSEWHERE for s in states])


def _run(states: list[int], count: int, through: set[int]) -> list[int]:
    """The model: positions from ``count`` on while each key's state is in ``through``."""
    end = count
    while end < len(states) and states[end] in through:
        end += 1
    return list(range(count, end))


def _dram_bytes(stack: TierStack, key: int) -> bytes | None:
    pin = stack.store.pin(NS, KeyBatch.from_user([key]))
    if len(pin.handles) == 0:
        return None
    try:
        at = int(pin.offsets[0])
        return bytes(stack.pool[at : at + BLOCK])
    finally:
        stack.store.release(pin.handles)


STATES = st.lists(st.sampled_from([ABSENT, DRAM, DISK, BOTH, ELSEWHERE]), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(STATES)
def test_exists_counts_the_leading_run_in_dram_or_on_disk(states: list[int]) -> None:
    with _stack() as stack:
        keys, count, _ = _place(stack, states)
        assert count == len(_run(states, 0, {DRAM, BOTH}))
        assert stack.exists(NS, keys, count) == len(_run(states, 0, {DRAM, DISK, BOTH}))
        assert stack.present(NS, keys).tolist() == [s in (DRAM, DISK, BOTH) for s in states]


@settings(max_examples=40, deadline=None)
@given(STATES, st.booleans())
def test_promote_brings_exactly_the_disk_only_blocks_of_the_run(states: list[int], cluster: bool) -> None:
    """Standalone (no ``elsewhere``) the run ends at the first key neither in DRAM nor on disk; in
    a cluster it goes on through keys other nodes own. Within it, the disk-only blocks come into
    the pool with their bytes; every other key keeps its state."""
    with _stack() as stack:
        keys, count, elsewhere = _place(stack, states)
        through = {DRAM, DISK, BOTH} | ({ELSEWHERE} if cluster else set())
        want = [i for i in _run(states, count, through) if states[i] == DISK]
        given_elsewhere = elsewhere if cluster else None
        if cluster:
            assert stack.wanted(NS, keys, count, given_elsewhere) == bool(want)
        elif count < len(states):
            assert stack.wanted(NS, keys, count) == (states[count] == DISK)
        got = asyncio.run(stack.promote(NS, keys, count, float("inf"), given_elsewhere))
        assert got == len(want) == stack.promoted
        for i, state in enumerate(states):
            held = _dram_bytes(stack, 100 + i)
            if state in (DRAM, BOTH) or i in want:
                assert held == _bytes(100 + i), f"key {i} ({state}) should be in DRAM, intact"
            else:
                assert held is None, f"key {i} ({state}) was not to be promoted"


def test_a_read_past_the_deadline_is_committed_when_it_ends() -> None:
    """A read slower than its load's deadline: the PIN it serves counts a miss, but the read goes
    on and the block is in DRAM afterwards (``late``), so the next load finds it."""
    with _stack() as stack:
        keys, count, _ = _place(stack, [DISK, DISK])
        read_run = stack.disk.read_run

        def slow_read(*args: Any) -> Any:
            time.sleep(0.2)
            return read_run(*args)

        stack.disk.read_run = slow_read  # type: ignore[method-assign,assignment]

        async def late_promote() -> int:
            got = await stack.promote(NS, keys, count, asyncio.get_running_loop().time() + 0.05)
            for _ in range(500):
                if stack.store.exists(NS, keys) == 2:
                    break
                await asyncio.sleep(0.01)
            return got

        assert asyncio.run(late_promote()) == 0
        assert stack.late == 2 and stack.promoted == 2
        assert [_dram_bytes(stack, k) for k in (100, 101)] == [_bytes(100), _bytes(101)]


def test_blocks_evicted_for_room_go_to_disk_and_come_back() -> None:
    """The store's eviction hook demotes: a pool filled past its size keeps every block, the
    evicted ones on disk, and a promote brings them back byte for byte."""
    with _stack() as stack:
        n = 2 * POOL // BLOCK
        for key in range(n):
            _in_dram(stack, [key])
        assert stack.disk.wait_idle(30)
        keys = KeyBatch.from_user(list(range(n)))
        dram = stack.store.present(NS, keys)
        assert not dram.all()
        assert stack.present(NS, keys).all()
        gone = [k for k in range(n) if not dram[k]][:8]
        got = asyncio.run(stack.promote(NS, KeyBatch.from_user(gone), 0, float("inf")))
        assert got == len(gone)
        assert [_dram_bytes(stack, k) for k in gone] == [_bytes(k) for k in gone]


def test_a_block_evicted_and_still_queued_for_disk_is_promoted_from_its_staging_buffer() -> None:
    """A load right after an eviction, before the demotion is written: the block is found and
    comes back byte for byte, copied from the write queue (before, a miss until written)."""
    with _stack() as stack:
        go = _held_writes(stack)
        try:
            n = 2 * POOL // BLOCK
            for key in range(n):
                _in_dram(stack, [key])
            keys = KeyBatch.from_user(list(range(n)))
            gone = np.flatnonzero(~stack.store.present(NS, keys))[:8].tolist()
            assert gone and stack.disk.queued >= len(gone)  # evicted, none written yet
            batch = KeyBatch.from_user(gone)
            assert stack.exists(NS, batch, 0) == len(gone)
            assert asyncio.run(stack.promote(NS, batch, 0, float("inf"))) == len(gone)
            assert [_dram_bytes(stack, k) for k in gone] == [_bytes(k) for k in gone]
        finally:
            go.set()
        assert stack.disk.wait_idle(30)


def test_a_block_written_between_its_lookup_and_its_copy_is_read_from_disk() -> None:
    """The race of a promotion with the writer: queued when looked up, on disk by the copy. The
    block is read from disk instead (before, a miss that ended its load)."""
    with _stack() as stack:
        go, copy_staged = _held_writes(stack), stack.disk.copy_staged

        def copy_after_the_writes(*args: Any) -> list[bool]:
            go.set()
            assert stack.disk.wait_idle(30)
            return copy_staged(*args)

        stack.disk.copy_staged = copy_after_the_writes  # type: ignore[method-assign,assignment]
        try:
            keys = _queue(stack, [100, 101, 102])
            assert stack.disk.staged_lengths(NAME, keys) == [BLOCK] * 3
            assert asyncio.run(stack.promote(NS, keys, 0, float("inf"))) == 3
        finally:
            go.set()
        assert [_dram_bytes(stack, k) for k in (100, 101, 102)] == [_bytes(k) for k in (100, 101, 102)]


def _drained(stack: TierStack, limit: int) -> list[int]:
    """The user keys of every part ``drain_next`` hands out, each part at most ``limit`` keys."""
    got: list[int] = []
    while (part := stack.drain_next(limit)) is not None:
        name, keys = part
        assert name == NAME and 0 < len(keys) <= limit
        got += [int(keys.key(i)) for i in range(len(keys))]
    return got


def test_a_drain_moves_what_was_demoted_before_it_reached_the_disk() -> None:
    """A drain that counts what is left on disk (its first call ran out of time while it pushed
    DRAM blocks) takes no snapshot then: blocks demoted after the count are moved too. Once it
    reaches the disk, the snapshot is fixed and handed out in parts of at most the limit."""
    with _stack() as stack:
        _on_disk(stack, [1, 2, 3])
        assert stack.drain_left() == 3
        _on_disk(stack, [4, 5])  # evicted from DRAM while the drain pushed other blocks
        assert stack.drain_left() == 5
        first = stack.drain_next(2)
        assert first is not None and len(first[1]) == 2
        _on_disk(stack, [6])  # after the snapshot: not the drain's (it demotes none of its own)
        assert stack.drain_left() == 3
        moved = [int(first[1].key(i)) for i in range(2)] + _drained(stack, 2)
        assert sorted(moved) == [1, 2, 3, 4, 5]
        assert stack.drain_left() == 0 and stack.drain_next(2) is None


@settings(max_examples=15, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=20), st.integers(1, 8))
def test_away_on_disk_names_the_blocks_of_others_a_chunk_at_a_time(mine: list[bool], chunk: int) -> None:
    """A handoff's look at the disk: every block on disk the ring does not give to this node,
    once, in one part per chunk of keys looked up (empty when the chunk is all this node's)."""
    keys = list(range(1, len(mine) + 1))
    looked: list[int] = []

    def owned(name: str, batch: KeyBatch) -> np.ndarray:
        assert name == NAME and 0 < len(batch) <= chunk
        looked.append(len(batch))
        return np.array([mine[int(batch.key(i)) - 1] for i in range(len(batch))])

    with _stack() as stack:
        _on_disk(stack, keys)
        parts = list(stack.away_on_disk(owned, chunk))
    assert len(parts) == -(-len(keys) // chunk) and sum(looked) == len(keys)
    away = sorted(int(b.key(i)) for _, b in parts for i in range(len(b)))
    assert away == [k for k, m in zip(keys, mine, strict=True) if not m]
