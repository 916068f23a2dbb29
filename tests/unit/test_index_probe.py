"""The C lookup loop (emsd.pool._probe) answers exactly as the numpy probe."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool import index as index_mod
from emsd.pool.index import READY, BlockIndex
from emsd.pool.keys import KeyBatch

pytestmark = pytest.mark.skipif(index_mod._probe is None, reason="emsd.pool._probe not built")

# Few distinct first words make first-word twins (same w0, other words differ).
keys = st.one_of(
    st.integers(0, 40),
    st.binary(min_size=9, max_size=32).map(lambda b: b[:8].rjust(8, b"\0")[:1] * 8 + b[8:]),
    st.binary(max_size=32),
)


def both(idx: BlockIndex, ns: int, batch: KeyBatch, prefix: bool) -> tuple[np.ndarray, np.ndarray]:
    idx.use_c = True
    fast = idx.find(ns, batch, prefix=prefix)
    idx.use_c = False
    slow = idx.find(ns, batch, prefix=prefix)
    idx.use_c = True
    return fast, slow


@given(st.lists(st.tuples(st.integers(0, 2), keys), max_size=300, unique=True),
       st.lists(st.booleans(), max_size=300), st.lists(st.tuples(st.integers(0, 3), keys), max_size=60))
@settings(max_examples=120, deadline=None)
def test_c_probe_matches_numpy_probe(entries: list, removed: list, queries: list) -> None:
    idx = BlockIndex()
    ids = []
    for ns, key in entries:
        batch = KeyBatch.from_user([key])
        got, _ = idx.insert(ns, batch, np.zeros(1, np.uint64), np.ones(1, np.uint32), READY, 1)
        ids.append(int(got[0]))
    gone = [i for i, r in zip(ids, removed, strict=False) if r]  # tombstones
    if gone:
        idx.remove(np.array(gone, dtype=np.uint32))
    probes = queries + [(ns, k) for ns, k in entries[:60]]
    for ns in range(4):
        batch = KeyBatch.from_user([k for n, k in probes if n == ns])
        fast, slow = both(idx, ns, batch, prefix=False)
        assert np.array_equal(fast, slow)
        fast, slow = both(idx, ns, batch, prefix=True)
        misses = np.flatnonzero(slow == 0)
        upto = int(misses[0]) + 1 if misses.size else len(batch)
        assert np.array_equal(fast[:upto], slow[:upto])  # after the first miss: unspecified


def test_c_probe_refuses_mismatched_arrays() -> None:
    idx = BlockIndex()
    batch = KeyBatch.from_user([1, 2])
    with pytest.raises(ValueError):
        index_mod._probe.find(idx.table, idx.w0, idx.rest, batch.words, batch.tags, 0,
                              int(idx._shift), np.empty(3, np.uint32), False)
    with pytest.raises(TypeError):
        index_mod._probe.find(idx.table, idx.w0, idx.rest, batch.words, batch.tags, 0,
                              int(idx._shift), np.empty(2, np.uint64), False)


def _table_holds(idx: BlockIndex) -> None:
    """Every live entry once in the table, tombstones counted, and the numpy probe (which
    knows nothing of how the C loop placed them) finds every key."""
    live = idx.live_ids()
    table = idx.table
    assert np.array_equal(np.sort(table[table >= 2]), np.sort(live))
    assert idx._tombs == int(np.count_nonzero(table == 1))
    use_c, idx.use_c = idx.use_c, False
    for ns in np.unique(idx.ns_of(live)).tolist():
        mine = live[idx.ns_of(live) == ns]
        assert np.array_equal(idx.find(ns, idx.keys_of(mine)), mine)
    idx.use_c = use_c


@given(st.lists(st.tuples(st.integers(0, 2), keys), max_size=400, unique=True),
       st.lists(st.integers(0, 10_000), max_size=6), st.booleans())
@settings(max_examples=80, deadline=None)
def test_c_place_and_slots_of_keep_a_valid_table(entries: list, cuts: list, use_c: bool) -> None:
    """Inserts and removes in batches (tombstones, their reuse, rebuilds as the table grows),
    with the C loops or the numpy ones: the table stays a valid probe table."""
    idx = BlockIndex()
    idx.use_c = use_c
    live: list[int] = []
    for step, start in enumerate(range(0, len(entries), 50)):
        for ns in range(3):
            chunk = [k for n, k in entries[start : start + 50] if n == ns]
            if chunk:
                got, _ = idx.insert(ns, KeyBatch.from_user(chunk), np.zeros(len(chunk), np.uint64),
                                    np.ones(len(chunk), np.uint32), READY, 1)
                live += got.tolist()
        if live and cuts:
            gone = live[: cuts[step % len(cuts)] % len(live) + 1 : 2]
            live = [x for x in live if x not in set(gone)]
            idx.remove(np.array(gone, dtype=np.uint32))
        _table_holds(idx)


def test_c_place_and_slots_of_refuse_ids_that_are_not_entries() -> None:
    idx = BlockIndex()
    for bad in (np.array([0], np.uint32), np.array([idx.capacity], np.uint32)):
        with pytest.raises(ValueError):
            index_mod._probe.place(idx.table, idx.w0, idx.rest, bad, int(idx._shift), idx.table.size)
        with pytest.raises(ValueError):
            index_mod._probe.slots_of(idx.table, idx.w0, idx.rest, bad, int(idx._shift),
                                      np.empty(1, np.int64))
