"""The shared index's table (``emsd.pool.shared_index``): what the daemon publishes a client
finds with its offset and length, what it retracts or hides is not found, and a client's
check after a copy fails exactly when a slot it used changed. Driven against a model by
hypothesis, through a real memfd mapped read-only as a client maps it."""

from __future__ import annotations

import mmap
import os
import resource
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from emsd.pool import prefault, shared_index
from emsd.pool.index import READY, BlockIndex
from emsd.pool.keys import KeyBatch
from emsd.pool.shared_index import MIN_BITS, SharedIndex, SharedIndexReader, slots_for, table_bytes
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(not shared_index.available(), reason="emsd.pool._shared_index not built")

UNIT = 64
LIMIT = 1 << 30
KEYS = st.one_of(st.integers(0, 60), st.builds(lambda i: b"block-%04d" % i, st.integers(0, 30)))
NS = st.integers(0, 3)


def one(key: int | bytes) -> KeyBatch:
    return KeyBatch.from_user([key])


@pytest.fixture
def table() -> Iterator[tuple[SharedIndex, SharedIndexReader]]:
    writer = SharedIndex(MIN_BITS)
    reader = SharedIndexReader(os.dup(writer.fd), writer.size)
    yield writer, reader
    reader.close()
    writer.close()


class Table(RuleBasedStateMachine):
    """The daemon's index and table side by side with a dict of what must be found."""

    @initialize()
    def setup(self) -> None:
        self.index = BlockIndex()
        self.table = SharedIndex(MIN_BITS)
        fd = os.dup(self.table.fd)
        self.reader = SharedIndexReader(fd, self.table.size)
        os.close(fd)
        self.model: dict[tuple[int, int | bytes], tuple[int, int]] = {}  # (ns, key) -> (offset, length)
        self.ids: dict[tuple[int, int | bytes], int] = {}
        self.hidden: set[int] = set()
        self.seen: list[tuple[tuple[int, int | bytes], int, int]] = []  # (what, slot, seq) found earlier
        self.next_offset = 1

    def teardown(self) -> None:
        if hasattr(self, "reader"):
            self.reader.close()
            self.table.close()

    @rule(ns=NS, key=KEYS, length=st.integers(1, 1 << 20))
    def commit(self, ns: int, key: int | bytes, length: int) -> None:
        if (ns, key) in self.ids:
            return
        offset = self.next_offset
        self.next_offset += 1
        ids, _ = self.index.insert(ns, one(key), np.array([offset], np.uint32), np.array([length], np.uint32),
                                   READY, 1)
        before = self.table.unpublished
        self.table.publish(self.index, ids, UNIT)
        self.ids[ns, key] = int(ids[0])
        if ns not in self.hidden and self.table.unpublished == before:
            self.model[ns, key] = (offset * UNIT, length)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        what = data.draw(st.sampled_from(sorted(self.ids, key=repr)))
        i = np.array([self.ids.pop(what)], np.uint32)
        self.table.retract(self.index, i)
        self.index.remove(i)
        self.model.pop(what, None)

    @rule(ns=NS)
    def drop(self, ns: int) -> None:
        self.table.hide(ns)
        self.hidden.add(ns)
        for what in [w for w in self.model if w[0] == ns]:
            del self.model[what]

    @rule(ns=NS)
    def reuse(self, ns: int) -> None:
        self.table.show(ns)
        self.hidden.discard(ns)

    @rule(ns=NS, key=KEYS)
    def look(self, ns: int, key: int | bytes) -> None:
        found = self.reader.find(ns, one(key), LIMIT)
        if found.offsets.size:
            self.seen.append(((ns, key), int(found.slots[0]), int(found.seqs[0])))

    @invariant()
    def found_is_the_model(self) -> None:
        if not hasattr(self, "model"):
            return
        for (ns, key), (offset, length) in self.model.items():
            found = self.reader.find(ns, one(key), LIMIT)
            assert found.offsets.tolist() == [offset] and found.lengths.tolist() == [length]
        for ns, key in self.ids:
            if (ns, key) not in self.model:
                assert self.reader.find(ns, one(key), LIMIT).offsets.size == 0

    @invariant()
    def one_key_lookups_agree_with_the_batch_ones(self) -> None:
        if not hasattr(self, "ids"):
            return
        for ns, key in [*self.ids, (0, -1 & 0xFFFF_FFFF_FFFF_FFFF)]:
            f = self.reader.find(ns, one(key), LIMIT)
            whole = None if f.offsets.size == 0 else \
                (int(f.offsets[0]), int(f.lengths[0]), int(f.slots[0]), int(f.seqs[0]))
            assert self.reader.find_one(ns, one(key), LIMIT) == whole
        for _, slot, seq in self.seen:
            assert self.reader.check_one(slot, seq) == \
                self.reader.check(np.array([slot], np.uint32), np.array([seq], np.uint64))

    @invariant()
    def checks_fail_once_the_slot_changed(self) -> None:
        if not hasattr(self, "seen"):
            return
        for what, slot, seq in self.seen:
            still = self.reader.check(np.array([slot], np.uint32), np.array([seq], np.uint64))
            now = self.reader.find(what[0], one(what[1]), LIMIT) if what in self.model else None
            if still:
                assert now is not None and int(now.slots[0]) == slot and int(now.seqs[0]) == seq
        self.seen = [s for s in self.seen
                     if self.reader.check(np.array([s[1]], np.uint32), np.array([s[2]], np.uint64))]


TestTable = Table.TestCase
TestTable.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_batch_is_found_up_to_its_first_missing_key(table: tuple[SharedIndex, SharedIndexReader]) -> None:
    writer, reader = table
    idx = BlockIndex()
    keys = KeyBatch.from_user([b"a", b"b", b"c", b"d"])
    ids, _ = idx.insert(1, keys, np.arange(1, 5, dtype=np.uint32), np.full(4, 100, np.uint32), READY, 1)
    writer.publish(idx, ids[[0, 1, 3]], UNIT)  # c is not published
    found = reader.find(1, keys, LIMIT)
    assert found.offsets.tolist() == [UNIT, 2 * UNIT] and found.lengths.tolist() == [100, 100]
    assert reader.find(2, keys, LIMIT).offsets.size == 0  # another namespace
    assert reader.check(found.slots, found.seqs)
    writer.retract(idx, ids[1:2])
    assert not reader.check(found.slots, found.seqs)
    assert reader.find(1, keys, LIMIT).offsets.tolist() == [UNIT]


def test_blocks_past_the_pool_are_not_found(table: tuple[SharedIndex, SharedIndexReader]) -> None:
    writer, reader = table
    idx = BlockIndex()
    keys = KeyBatch.from_user([7])
    ids, _ = idx.insert(0, keys, np.array([10], np.uint32), np.array([64], np.uint32), READY, 1)
    writer.publish(idx, ids, UNIT)
    assert reader.find(0, keys, 10 * UNIT + 64).offsets.size == 1
    assert reader.find(0, keys, 10 * UNIT + 63).offsets.size == 0  # a client never copies past its map
    assert reader.find_one(0, keys, 10 * UNIT + 64) is not None
    assert reader.find_one(0, keys, 10 * UNIT + 63) is None
    assert not reader.check_one(1 << 40, 0)  # a slot past the table: changed, never read


def test_a_full_window_leaves_keys_unpublished_and_counted() -> None:
    writer = SharedIndex(MIN_BITS)
    try:
        idx = BlockIndex()
        n = (1 << MIN_BITS) * 3  # three keys a slot: many windows overflow
        keys = KeyBatch.from_user(list(range(n)))
        ids, _ = idx.insert(0, keys, np.arange(n, dtype=np.uint32), np.ones(n, np.uint32), READY, 1)
        writer.publish(idx, ids, UNIT)
        assert writer.unpublished > 0
        assert writer.published() == n - writer.unpublished <= (1 << MIN_BITS) + shared_index.WINDOW
    finally:
        writer.close()


def test_a_reader_refuses_what_is_not_a_table() -> None:
    fd = os.memfd_create("not-a-table")
    try:
        os.ftruncate(fd, table_bytes(MIN_BITS))
        with pytest.raises(ValueError):
            SharedIndexReader(fd, table_bytes(MIN_BITS))
    finally:
        os.close(fd)


def test_the_table_grows_with_the_pool_within_bounds() -> None:
    assert slots_for(1 << 20) == MIN_BITS
    assert slots_for(12 << 30) == 20  # two slots per 32 KiB: 786,432, to the next power of two
    assert slots_for(1 << 50) == shared_index.MAX_BITS


def _populate_supported() -> bool:
    with mmap.mmap(-1, mmap.PAGESIZE) as mm:
        return prefault.supported(mm)


@pytest.mark.skipif(not _populate_supported(), reason="the kernel has no MADV_POPULATE_WRITE")
def test_a_new_tables_pages_are_allocated_before_a_publish_writes_into_them() -> None:
    """A page of a new memfd is allocated at its first write, a page fault; the table allocates
    all of its pages in the background from the start, so that publishes take none."""
    writer = SharedIndex(16)  # 4 MiB: 1,024 pages
    pages = writer.size // mmap.PAGESIZE
    try:
        wait_for(writer.filled, 30, 0.01, "the table was not filled within 30 s")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        writer.table[shared_index.HEADER::mmap.PAGESIZE] = 0  # each page's first slot: free, 0 already
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    finally:
        writer.close()
    assert faults < pages // 10, f"{faults} page faults writing {pages} pages of a filled table"
