"""Checksums: digests sealed at commit, checked on read; kept by the store and its ledger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from emsd.pool.checksum import Checksums, digests, leading_good
from emsd.pool.keys import KeyBatch
from emsd.pool.ledger import Geometry, Ledger
from emsd.pool.store import BlockStore, Status

POOL, PAGE = 1 << 20, 64 << 10


def kb(*keys: int) -> KeyBatch:
    return KeyBatch.from_user(list(keys))


def written(store: BlockStore, pool: memoryview, keys: list[int], size: int = 1000) -> np.ndarray:
    """Reserve ``keys``, write each block full of its key's low byte; the PENDING handles."""
    res = store.reserve(0, kb(*keys), np.full(len(keys), size, np.uint64))
    assert (res.status == Status.NEW).all()
    for key, off in zip(keys, res.offsets.tolist(), strict=True):
        pool[off : off + size] = bytes([key & 0xFF]) * size
    return res.handles


@given(blocks=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8), data=st.data())
def test_leading_good_stops_at_the_first_changed_block(blocks: list[bytes], data: st.DataObject) -> None:
    buf = bytearray(b"".join(blocks))
    lengths = np.array([len(b) for b in blocks], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    sums = digests(memoryview(buf), offsets, lengths)
    assert (sums != 0).all()
    assert leading_good(memoryview(buf), offsets, lengths, sums) == len(blocks)
    bad = data.draw(st.integers(0, len(blocks) - 1))
    at = int(offsets[bad]) + data.draw(st.integers(0, len(blocks[bad]) - 1))
    buf[at] ^= 0x01
    assert leading_good(memoryview(buf), offsets, lengths, sums) == bad
    unsealed = sums.copy()
    unsealed[bad] = 0  # not sealed: served unchecked
    assert leading_good(memoryview(buf), offsets, lengths, unsealed) == len(blocks)


def test_a_changed_block_cuts_the_pin_and_is_dropped() -> None:
    store, pool = BlockStore(POOL, PAGE), memoryview(bytearray(POOL))
    sums = Checksums(store, pool)
    handles = written(store, pool, [1, 2, 3, 4])
    sums.seal(handles)
    store.commit(handles)
    off, _ = store.places(handles[2:3])
    pool[int(off[0]) + 10] ^= 0xFF
    pinned = sums.verified(store.pin(0, kb(1, 2, 3, 4)))
    assert pinned.count == 2
    assert store.stats().pinned == 2  # the rest lost their pins
    assert store.exists(0, kb(3)) == 0 and store.exists(0, kb(4)) == 1
    assert store.stats().evictions.get("corrupt") == 1 and sums.mismatches == 1


def test_seal_touches_pending_entries_only_and_a_reused_entry_starts_unsealed() -> None:
    store, pool = BlockStore(POOL, PAGE), memoryview(bytearray(POOL))
    store.enable_checksums()
    h = written(store, pool, [1])
    store.seal(h, np.array([77], dtype=np.uint64))
    store.commit(h)
    store.seal(h, np.array([99], dtype=np.uint64))  # READY now: left alone
    assert store.sums_of(h).tolist() == [77]
    store.discard(0, kb(1))
    again = written(store, pool, [2])
    assert again.tolist() == h.tolist()  # the entry id is reused...
    assert store.sums_of(again).tolist() == [0]  # ...without the old digest


def test_the_ledger_keeps_the_digests_across_a_restart(tmp_path: Path) -> None:
    store, pool = BlockStore(POOL, PAGE), memoryview(bytearray(POOL))
    geometry = Geometry(store.capacity, store.page_size, store.slabs.align, 1, 7)
    ledger, _ = Ledger.open(tmp_path / "ledger", geometry)
    store.enable_checksums()
    store.attach(ledger, set())
    assert ledger.add_namespace(0, "m")
    sums = Checksums(store, pool)
    handles = written(store, pool, [5, 6])
    sums.seal(handles)
    store.commit(handles)
    want = store.sums_of(handles).tolist()
    ledger.close()

    again = BlockStore(POOL, PAGE)
    again.enable_checksums()
    ledger2, outcome = Ledger.open(tmp_path / "ledger", geometry)
    assert outcome == "attached"
    assert again.attach(ledger2, set(ledger2.names())) == 2
    pinned = again.pin(0, kb(5, 6))
    assert again.sums_of(pinned.handles).tolist() == want
    ledger2.close()
