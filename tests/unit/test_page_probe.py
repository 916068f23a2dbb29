"""Page stealing's passes in C (emsd.pool._probe.page_ages, on_page) answer exactly as the
numpy ones: the same per-page latest use and blocked flags, the same ids on a page."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool import store as store_mod
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore

pytestmark = pytest.mark.skipif(store_mod._probe is None, reason="emsd.pool._probe not built")

PAGE = 64 << 10


def _store(sizes: list[int], pinned: list[int], pending: int, removed: list[int]) -> BlockStore:
    """Blocks of the given sizes (several classes), some pinned, some left PENDING, some evicted."""
    store = BlockStore(16 * PAGE, PAGE)
    for i, size in enumerate(sizes):
        res = store.reserve(i % 3, KeyBatch.from_user([i]), np.array([size], np.uint64))
        if i >= len(sizes) - pending:
            continue  # PENDING
        store.commit(res.handles[res.status == 0])
    if not sizes:
        return store
    for k in pinned:
        store.pin(k % 3, KeyBatch.from_user([k % len(sizes)]))
    for k in removed:
        store.discard(k % 3, KeyBatch.from_user([k % len(sizes)]))
    return store


def _both(store: BlockStore, page: int) -> tuple[tuple, tuple]:
    out = []
    for use_c in (True, False):
        store.index.use_c = use_c
        recent, blocked = store._page_ages()
        out.append((recent.tolist(), blocked.astype(bool).tolist(), store._ids_on_page(page).tolist()))
    store.index.use_c = True
    return out[0], out[1]


@given(st.lists(st.sampled_from([512, 1024, 4096, 16384, 65536]), max_size=120),
       st.lists(st.integers(0, 500), max_size=20), st.integers(0, 5),
       st.lists(st.integers(0, 500), max_size=10), st.integers(0, 15))
@settings(max_examples=150, deadline=None)
def test_c_page_passes_match_numpy(sizes: list[int], pinned: list[int], pending: int, removed: list[int],
                                   page: int) -> None:
    store = _store(sizes, pinned, min(pending, len(sizes)), removed)
    fast, slow = _both(store, page)
    assert fast == slow


def test_c_page_passes_refuse_mismatched_arrays() -> None:
    store = _store([1024] * 4, [], 0, [])
    idx = store.index
    with pytest.raises(ValueError, match="page_ages"):
        store_mod._probe.page_ages(idx.state, idx.pins, idx.offset, idx.last_used, store._units_per_page,
                                   np.full(16, -1, np.int64), np.zeros(15, np.uint8))
    with pytest.raises(TypeError, match="recent"):
        store_mod._probe.page_ages(idx.state, idx.pins, idx.offset, idx.last_used, store._units_per_page,
                                   np.full(16, -1, np.int32), np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="on_page"):
        store_mod._probe.on_page(idx.state[:2], idx.offset, store._units_per_page, 0,
                                 np.empty(8, np.uint32))
