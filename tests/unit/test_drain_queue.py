"""A drain's queue (``emsd.remote.drain_queue``, ``drain_step``) over a real ``BlockStore``:
taken once, then checked a step at a time while the pool changes under it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.remote import drain_queue, drain_step

SIZE = 4096


def _save(store: BlockStore, ns: int, keys: list[int]) -> np.ndarray:
    res = store.reserve(ns, KeyBatch.from_user(keys), np.full(len(keys), SIZE, dtype=np.uint64))
    store.commit(res.handles)
    return res.handles


def _owned(store: BlockStore) -> np.ndarray:
    idx = store.index
    hw = idx.high_water
    return np.flatnonzero((idx.state[:hw] == 2) & (idx.cached[:hw] == 0)).astype(np.uint32)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 15)), min_size=1, max_size=30, unique=True),
       st.sets(st.integers(0, 29)), st.sets(st.integers(0, 29)), st.sets(st.integers(1, 3)),
       st.integers(1, 7))
def test_a_drain_pushes_each_block_still_owned_once_by_namespace(
        blocks: list[tuple[int, int]], cached: set[int], dropped: set[int], retired: set[int],
        limit: int) -> None:
    """Blocks made read-cache copies, dropped (their ids taken by new blocks of another
    namespace) or of a namespace retired after the queue was taken are not pushed; every other
    block of the queue is, once, in steps of one namespace each, at most ``limit`` a step,
    namespaces in ascending order."""
    store = BlockStore(8 << 20, 1 << 20)
    ids = [int(_save(store, ns, [key])[0]) for ns, key in blocks]
    queue, nss = drain_queue(store.index, _owned(store))
    for i in cached & set(range(len(ids))):
        ns, key = blocks[i]
        store.mark_cached(ns, KeyBatch.from_user([key]))
    gone = sorted(dropped & set(range(len(ids))) - cached)
    for i in gone:
        ns, key = blocks[i]
        store.discard(ns, KeyBatch.from_user([key]))
    if gone:  # new blocks, which may take the freed ids: of another namespace, and pending
        _save(store, 9, [1000 + i for i in gone[::2]])
        for i in gone[1::2]:  # reserved in the namespace of the block gone, not committed
            store.reserve(blocks[i][0], KeyBatch.from_user([2000 + i]), np.full(1, SIZE, dtype=np.uint64))
    expect = sorted(ids[i] for i, (ns, _) in enumerate(blocks)
                    if i not in cached and i not in gone and ns not in retired)
    pushed: list[int] = []
    order: list[int] = []
    while queue.size:
        ns, step, queue, nss = drain_step(store.index, queue, nss, retired.__contains__, limit)
        assert step.size <= limit
        assert all(blocks[ids.index(int(h))][0] == ns for h in step)
        order.append(ns)
        pushed += step.tolist()
    assert sorted(pushed) == expect and len(set(pushed)) == len(pushed)
    assert order == sorted(order)
