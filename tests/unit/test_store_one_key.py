"""The store's one-key paths (a one-block save, a one-block PUT into a granted chunk, a
fetched copy, commit, pin, release, a touch and marking a copy, in scalar steps) give the same
answers and leave the same state, the ledger's rows included, as the batch path, under
both eviction policies."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from emsd.pool.eviction import POLICIES
from emsd.pool.keys import KeyBatch
from emsd.pool.ledger import Geometry, Ledger
from emsd.pool.store import BlockStore, Status

PAGE = 4096
SIZES = (700, 1024, 1500)  # two size classes, so that saves also steal pages
KEYS = st.integers(0, 11)



def _ops(keys: st.SearchStrategy[int], sizes: tuple[int, ...], most: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(st.one_of(
        st.tuples(st.just("save"), keys, st.sampled_from(sizes), st.booleans(), st.booleans(),
                  st.one_of(st.none(), keys), st.booleans()),
        st.tuples(st.just("pin"), keys, st.one_of(st.none(), keys)),
        st.tuples(st.just("touch"), keys, st.one_of(st.none(), keys)),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("end"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("mark"), keys),
        st.tuples(st.just("commit any"), st.integers(-1, 40)),  # any handle: most are not PENDING
    ), max_size=most)


ops = _ops(KEYS, SIZES, 60)
# Many small blocks in a full pool (FILL of them, 64 to a page): an LRU scan queues several
# victims, which pins, releases and page steals then make stale before a save takes them.
FILL = 128
many_small = _ops(st.integers(0, FILL + 40), (64, 64, 100, 200), 80)


def _key(k: int | None) -> KeyBatch | None:
    return None if k is None else KeyBatch.from_user([k])


def _state(store: BlockStore) -> list[Any]:
    """Everything a call may change, comparable."""
    idx = store.index
    top = idx.high_water
    s = store.stats()
    assert store.ledger is not None
    ids, rows = store.ledger.committed()
    return [store._clock, s.bytes_used, s.bytes_free, s.pending, s.granted, s.evictions, s.ns_bytes, top,
            *(getattr(idx, name)[:top].tolist() for name in
              ("w0", "state", "pins", "offset", "length", "last_used", "cached")),
            ids.tolist(), rows.tobytes(), store.slabs.page_used.tolist(),
            [(c.top, c.carve_page, c.carve_next, c.chunks_used, list(c.pages)) for c in store.slabs.classes]]


def _run(store: BlockStore, script: list[tuple[Any, ...]]) -> list[Any]:
    """Carry out ``script`` on ``store``; every answer and the state after each step."""
    pinned: list[int] = []
    pending: list[int] = []
    out: list[Any] = []
    for op, *args in script:
        if op == "save":
            k, size, granted, copy, prev, commit = args
            at = None
            if granted:
                chunks = store.grant(size, 1)
                if chunks.size == 0:
                    continue
                at = chunks
            if at is not None and not copy:  # as a one-block PUT: the scalar path, or the batch one
                status, handle = store.reserve_granted_one(0, KeyBatch.from_user([k]), size,
                                                           int(at[0]), _key(prev))
                out.append((status, handle))
                new = np.array([handle] if status == Status.NEW else [], dtype=np.uint32)
            else:
                res = store.reserve(0, KeyBatch.from_user([k]), np.array([size], dtype=np.uint64),
                                    prev=_key(prev), at=at, copy=copy)
                out.append((res.status.tolist(), res.handles.tolist(), res.offsets.tolist()))
                new = res.handles[res.status == Status.NEW]
            if at is not None and new.size == 0:
                store.ungrant(at)
            if commit:  # as a PUT does
                out.append(store.commit(new))
            else:  # as a RESERVE does: committed or aborted by a later step
                pending += new.tolist()
        elif op == "pin":
            k, prev = args
            p = store.pin(0, KeyBatch.from_user([k]), _key(prev))
            pinned += p.handles.tolist()
            out.append((p.count, p.handles.tolist(), p.offsets.tolist(), p.lengths.tolist()))
        elif op == "touch":  # a load read through the shared index, told to the daemon
            k, prev = args
            out.append(store.touch(0, KeyBatch.from_user([k]), _key(prev)))
        elif op == "release" and pinned:
            h = pinned.pop(args[0] % len(pinned))
            out.append(store.release(np.array([h], dtype=np.uint32)))
        elif op == "end" and pending:
            h = np.array([pending.pop(args[0] % len(pending))], dtype=np.uint32)
            out.append(store.commit(h) if args[1] else store.abort(h))
        elif op == "mark":  # a fetched block: flagged as a copy once committed
            out.append(store.mark_cached(0, KeyBatch.from_user([args[0]])))
        elif op == "commit any":
            out.append(store.commit(np.array([args[0]], dtype=np.int64)))
        out.append(_state(store))
    return out


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(POLICIES), ops)
def test_one_key_calls_answer_and_change_the_store_as_the_batch_path_does(
        policy: str, script: list[tuple[Any, ...]]) -> None:
    _same_on_both_paths(policy, 4, script)


_TOUCH_QUEUED = [("save", 500, 64, False, False, None, True),  # the first eviction queues 8 victims
                 ("pin", 2, None), ("release", 0),  # the third of them is used again: stale
                 ("save", 501, 64, False, False, None, True), ("save", 502, 64, False, False, None, True),
                 ("save", 3, 64, False, False, None, True),  # a save that finds it: used again too
                 ("save", 503, 64, False, False, None, True), ("save", 504, 200, False, False, None, True)]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(POLICIES), many_small)
@example("lru", _TOUCH_QUEUED)
@example("prefix", _TOUCH_QUEUED)
def test_one_block_saves_into_a_full_pool_evict_as_the_batch_path_does(
        policy: str, script: list[tuple[Any, ...]]) -> None:
    _same_on_both_paths(policy, 2, [("save", k, 64, False, False, None, True) for k in range(FILL)] + script)


def _same_on_both_paths(policy: str, pages: int, script: list[tuple[Any, ...]]) -> None:
    """``script`` answers and leaves the state alike on a store of ``pages`` pages with its
    scalar paths and on one without."""
    with tempfile.TemporaryDirectory() as tmp:
        scalar, batch = (_with_ledger(BlockStore(pages * PAGE, PAGE, eviction=policy), Path(tmp, name))
                         for name in ("scalar", "batch"))
        batch.scalar_paths = False
        try:
            assert _run(scalar, script) == _run(batch, script)
        finally:
            for store in (scalar, batch):
                assert store.ledger is not None
                store.ledger.close()


def _with_ledger(store: BlockStore, path: Path) -> BlockStore:
    """``store`` writing its committed blocks to a ledger at ``path`` (as a daemon's does)."""
    ledger, _ = Ledger.open(path, Geometry(store.capacity, store.page_size, store.slabs.align, 1, 7))
    store.attach(ledger, set())
    assert ledger.add_namespace(0, "m")
    return store
