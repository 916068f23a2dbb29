"""BlockStore: the reserve / commit / pin / release / exists contract."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from emsd.pool.eviction import lru_victims, page_ages, steal_choice
from emsd.pool.index import FREE, PENDING, READY
from emsd.pool.keys import KeyBatch
from emsd.pool.store import MAX_PINS, BlockStore, Reservation, Status

PAGE = 4096
MODEL_KEYS = 40  # enough distinct keys to keep the model's pool under eviction pressure
NEW, PRESENT, FAILED = int(Status.NEW), int(Status.PRESENT), int(Status.FAILED)


def kb(*keys: int | bytes) -> KeyBatch:
    return KeyBatch.from_user(list(keys))


def sizes(n: int, size: int = 1024) -> np.ndarray:
    return np.full(n, size, dtype=np.uint64)


def save(store: BlockStore, ns: int, keys: list[int], size: int = 1024) -> list[int]:
    """Reserve and commit; returns the statuses."""
    res = store.reserve(ns, kb(*keys), sizes(len(keys), size))
    store.commit(res.handles[res.status == NEW])
    return res.status.tolist()


def present(store: BlockStore, ns: int, keys: list[int]) -> list[bool]:
    return [store.exists(ns, kb(k)) == 1 for k in keys]


def check_invariants(store: BlockStore) -> None:
    """Structure that must hold after any sequence of calls."""
    idx, slabs = store.index, store.slabs
    live = idx.live_ids()
    assert len(live) == len(idx)
    offs = idx.offset[live].astype(np.int64) * slabs.align
    lengths = idx.length[live].astype(np.int64)
    order = np.argsort(offs)
    ends = offs[order] + lengths[order]
    assert (ends[:-1] <= offs[order][1:]).all(), "two live blocks overlap"
    assert (ends <= slabs.pages * slabs.page_size).all()
    owners = slabs.page_owner[offs // slabs.page_size]
    assert (owners >= 0).all()
    chunk = np.array([slabs.classes[c].chunk_size for c in owners.tolist()], dtype=np.int64)
    assert (lengths <= chunk).all() and (lengths > 0).all()
    assert (offs % slabs.page_size + chunk <= slabs.page_size).all()
    assert int(sum(chunk)) + store.granted_bytes == slabs.bytes_used()
    free = np.concatenate([c.stack[: c.top] for c in slabs.classes] or [np.zeros(0, np.uint64)])
    assert np.unique(free).size == free.size, "a chunk is on a free stack twice"
    assert not np.isin(free, offs.astype(np.uint64)).any(), "a live block's chunk is on a free stack"
    st = store.stats()
    slack = sum(c.pages * c.page_size - (c.chunks_used + c.chunks_free) * c.chunk_size
                for c in st.classes)
    assert st.bytes_used + st.bytes_free + slack + st.capacity % store.page_size == st.capacity
    assert st.entries == len(live)
    assert st.pending == int((idx.state[live] == PENDING).sum())
    assert (idx.pins[live][idx.state[live] == PENDING] == 0).all()
    ready = live[idx.state[live] == READY]
    by_ns = Counter()
    for ns, n in zip(idx.ns_of(ready).tolist(), idx.length[ready].tolist(), strict=True):
        by_ns[ns] += n
    assert st.ns_bytes == {k: v for k, v in by_ns.items() if v}
    found = idx.find(0, idx.keys_of(live[idx.ns_of(live) == 0]))
    assert (found == live[idx.ns_of(live) == 0]).all()


# -- eviction policy (pure functions) ----------------------------------------------------


def test_lru_victims_are_the_oldest_first_with_ties_in_input_order() -> None:
    last_used = np.array([0, 0, 5, 1, 9, 1, 3], dtype=np.uint32)
    eligible = np.array([2, 3, 4, 5, 6], dtype=np.uint32)
    assert lru_victims(last_used, eligible, 3).tolist() == [3, 5, 6]
    assert lru_victims(last_used, eligible, 10).tolist() == [3, 5, 6, 2, 4]
    assert lru_victims(last_used, eligible, 0).size == 0
    assert lru_victims(last_used, eligible[:0], 2).size == 0


def page_to_steal(page_owner: np.ndarray, entry_pages: np.ndarray, entry_last_used: np.ndarray,
                  entry_blocked: np.ndarray, requester: int, older_than: int | None = None) -> int | None:
    """``steal_choice`` over ``page_ages`` of per-entry arrays, as the store's numpy path does."""
    recent, blocked = page_ages(page_owner.size, entry_pages, entry_last_used, entry_blocked)
    return steal_choice(page_owner, recent, blocked, requester, older_than)


def test_page_to_steal_takes_the_page_used_longest_ago() -> None:
    owner = np.array([0, 0, 1, -1, 0, 2], dtype=np.int32)
    pages = np.array([0, 0, 1, 2, 4, 5])
    last_used = np.array([50, 10, 30, 5, 20, 1])
    blocked = np.array([False, False, False, False, False, True])
    # page 0's latest use is 50, page 1's 30, page 4's 20; page 2 is the requester's own,
    # page 3 is free, page 5 has a pinned or pending entry
    assert page_to_steal(owner, pages, last_used, blocked, requester=1) == 4
    owner[1] = 0  # a page with no live entry at all goes first
    assert page_to_steal(owner, pages[pages != 1], last_used[pages != 1],
                         blocked[pages != 1], requester=1) == 1
    assert page_to_steal(owner[[2, 3]], np.array([0]), np.array([1]), np.array([False]),
                         requester=1) is None


def test_page_to_steal_older_than_takes_only_a_page_older_throughout() -> None:
    owner = np.array([0, 0, 1], dtype=np.int32)
    pages = np.array([0, 0, 1, 2])
    last_used = np.array([5, 40, 30, 99])  # page 0: 5 and 40 (latest 40); page 1: 30
    blocked = np.zeros(4, dtype=bool)
    assert page_to_steal(owner, pages, last_used, blocked, requester=1, older_than=31) == 1
    assert page_to_steal(owner, pages, last_used, blocked, requester=1, older_than=30) is None
    assert page_to_steal(owner, pages, last_used, blocked, requester=1) == 1


# -- the contract, one behaviour at a time ---------------------------------------------


def test_reserve_then_commit_makes_blocks_loadable() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    res = store.reserve(0, kb(1, 2, 3), np.array([100, 200, 300], dtype=np.uint64))
    assert res.status.tolist() == [NEW, NEW, NEW]
    assert res.status.dtype == np.uint8 and res.handles.dtype == np.uint32
    assert res.offsets.dtype == np.uint64
    assert store.exists(0, kb(1, 2, 3)) == 0
    assert store.commit(res.handles) == 3
    assert store.exists(0, kb(1, 2, 3, 4)) == 3
    pinned = store.pin(0, kb(1, 2, 3))
    assert pinned.count == 3
    assert pinned.offsets.tolist() == res.offsets.tolist()
    assert pinned.lengths.tolist() == [100, 200, 300]
    assert pinned.handles.tolist() == res.handles.tolist()
    check_invariants(store)


def test_pending_blocks_are_invisible_to_loads_but_present_to_saves() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    res = store.reserve(0, kb(1), sizes(1))
    assert store.exists(0, kb(1)) == 0
    assert store.pin(0, kb(1)).count == 0
    assert store.reserve(0, kb(1, 2), sizes(2)).status.tolist() == [PRESENT, NEW]
    store.commit(res.handles)
    assert store.exists(0, kb(1)) == 1


def test_same_key_twice_in_a_batch_is_reserved_once() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    res = store.reserve(0, kb(7, 8, 7, b"\x07", 7), sizes(5))
    assert res.status.tolist() == [NEW, NEW, PRESENT, NEW, PRESENT]
    assert store.stats().entries == 3


def test_namespaces_do_not_share_blocks() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    save(store, 0, [1])
    assert store.exists(1, kb(1)) == 0
    assert save(store, 1, [1]) == [NEW]


def test_a_bad_size_fails_that_key_and_every_later_one() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    save(store, 0, [3])
    res = store.reserve(0, kb(1, 2, 3, 4), np.array([10, 0, 10, 10], dtype=np.uint64))
    assert res.status.tolist() == [NEW, FAILED, FAILED, FAILED]
    res = store.reserve(0, kb(5, 6), np.array([10, PAGE + 1], dtype=np.uint64))
    assert res.status.tolist() == [NEW, FAILED]
    assert store.stats().pending == 2  # the NEW ones stay reserved


def test_abort_frees_the_place_and_the_key() -> None:
    store = BlockStore(PAGE, PAGE)
    res = store.reserve(0, kb(1, 2, 3, 4), sizes(4))
    assert store.abort(res.handles[:2]) == 2
    assert store.stats().bytes_used == 2 * 1024
    again = store.reserve(0, kb(1, 9), sizes(2))
    assert again.status.tolist() == [NEW, NEW]
    assert sorted(again.offsets.tolist()) == sorted(res.offsets[:2].tolist())
    check_invariants(store)


def test_commit_and_abort_ignore_handles_in_the_wrong_state() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    res = store.reserve(0, kb(1, 2), sizes(2))
    junk = np.array([0, 1, 999_999, 2**32 - 1], dtype=np.uint32)
    assert store.commit(np.concatenate([res.handles, res.handles, junk])) == 2
    assert store.commit(res.handles) == 0
    assert store.abort(res.handles) == 0
    assert store.abort(junk) == 0
    assert store.exists(0, kb(1, 2)) == 2


def test_pin_takes_the_leading_ready_keys_only() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    save(store, 0, [1, 2, 4])
    store.reserve(0, kb(5), sizes(1))  # PENDING
    assert store.pin(0, kb(1, 2, 3, 4)).count == 2
    assert store.pin(0, kb(3, 1)).count == 0
    assert store.pin(0, kb(4, 5, 1)).count == 1
    p = store.pin(0, kb(1, 1))
    assert p.count == 2 and p.handles[0] == p.handles[1]
    assert store.stats().pinned == 3
    assert store.release(p.handles) == 2


@pytest.mark.parametrize("eviction", ["lru", "prefix"])
def test_touch_stamps_every_ready_key_of_a_batch_and_pins_nothing(eviction: str) -> None:
    store = BlockStore(8 * PAGE, PAGE, eviction=eviction)
    save(store, 0, [1, 2, 4])
    store.reserve(0, kb(5), sizes(1))  # PENDING
    ids = store.index.lookup(0, kb(1, 2, 4))
    before = store.index.last_used[ids].copy()
    assert store.touch(0, kb(1, 3, 5, 4)) == (2, 2048)  # 3 absent, 5 PENDING: 1 and 4 still count
    after = store.index.last_used[ids]
    assert after[0] > before[0] and after[2] > before[2] and after[1] == before[1]
    assert store.stats().pinned == 0
    assert store.touch(1, kb(1, 2)) == (0, 0)  # another namespace


def test_release_never_takes_pins_below_zero() -> None:
    store = BlockStore(8 * PAGE, PAGE)
    save(store, 0, [1])
    h = store.pin(0, kb(1)).handles
    assert store.release(np.concatenate([h, h, h])) == 1
    assert store.release(h) == 0
    assert store.stats().pinned == 0


def test_a_pin_count_never_wraps() -> None:
    """u32 pins: an entry pinned MAX_PINS times is a miss for the next pin, never wrapped to 0."""
    store = BlockStore(8 * PAGE, PAGE)
    save(store, 0, [1, 2])
    handle = store.pin(0, kb(1)).handles[0]
    store.index.pins[handle] = MAX_PINS - 1  # as if a client had pinned it 2**31 - 1 times
    assert store.pin(0, kb(1, 1, 1, 2)).count == 4  # below the limit when asked: pinned, no wrap
    assert int(store.index.pins[handle]) == int(MAX_PINS) + 2
    assert store.pin(0, kb(1, 2)).count == 0 and store.pin(0, kb(2, 1)).count == 1
    assert int(store.index.pins[handle]) == int(MAX_PINS) + 2


def test_eviction_takes_the_least_recently_used_first() -> None:
    store = BlockStore(PAGE, PAGE)  # room for four 1 KiB blocks
    save(store, 0, [1, 2, 3, 4])
    store.release(store.pin(0, kb(1)).handles)  # 1 is now the most recent
    assert save(store, 0, [5]) == [NEW]
    assert present(store, 0, [1, 2, 3, 4, 5]) == [True, False, True, True, True]
    assert save(store, 0, [6, 7]) == [NEW, NEW]
    assert present(store, 0, [1, 3, 4, 5, 6, 7]) == [True, False, False, True, True, True]
    assert store.stats().evictions["lru"] == 3
    check_invariants(store)


def _batches_held(store: BlockStore, ns: int, batches: int, per: int) -> list[int]:
    return [store.exists(ns, kb(*range(b * per, (b + 1) * per))) for b in range(batches)]


BIG_PAGE = 64 << 10  # 4 blocks of 16 KiB, 64 of 1 KiB


def test_a_late_size_class_takes_pages_of_older_blocks_not_its_own_newer_ones() -> None:
    """A pool full of small blocks nobody uses any more, then a model with bigger blocks:
    its blocks push the old ones out a page at a time instead of evicting each other
    on the one page their class got first (what per-class LRU alone does)."""
    store = BlockStore(16 * BIG_PAGE, BIG_PAGE)
    per_page = BIG_PAGE // 16384  # 16 KiB blocks
    save(store, 0, list(range(16 * BIG_PAGE // 1024)))  # every page: 1 KiB blocks
    for b in range(8):  # half the pool of 16 KiB blocks, one page a batch
        assert save(store, 1, list(range(b * per_page, (b + 1) * per_page)), 16384) == [NEW] * per_page
    assert _batches_held(store, 1, 8, per_page) == [per_page] * 8
    assert store.stats().evictions["lru"] == 0
    assert store.stats().ns_bytes[0] == 8 * BIG_PAGE  # the other half: the old blocks
    for b in range(8, 24):  # once only 16 KiB blocks are left, the class evicts its own oldest
        save(store, 1, list(range(b * per_page, (b + 1) * per_page)), 16384)
    assert _batches_held(store, 1, 24, per_page) == [0] * 8 + [per_page] * 16
    assert 0 not in store.stats().ns_bytes
    check_invariants(store)


def test_pages_of_blocks_used_since_stay_while_a_class_has_older_blocks_of_its_own() -> None:
    store = BlockStore(16 * BIG_PAGE, BIG_PAGE)
    per_page = BIG_PAGE // 16384
    small = list(range(12 * BIG_PAGE // 1024))
    save(store, 0, small)  # 12 pages of 1 KiB blocks
    for b in range(4):  # 4 pages of 16 KiB blocks: the pool is full
        save(store, 1, list(range(b * per_page, (b + 1) * per_page)), 16384)
    store.release(store.pin(0, kb(*small)).handles)  # the small blocks are used again: now newest
    for b in range(4, 8):
        save(store, 1, list(range(b * per_page, (b + 1) * per_page)), 16384)
    assert _batches_held(store, 1, 8, per_page) == [0] * 4 + [per_page] * 4  # its own went
    assert store.exists(0, kb(*small)) == len(small)  # the small blocks all stayed
    assert store.stats().evictions == {"lru": 4 * per_page, "page": 0}
    check_invariants(store)


def test_exists_does_not_count_as_a_use() -> None:
    store = BlockStore(PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4])
    assert store.exists(0, kb(1)) == 1
    save(store, 0, [5])
    assert present(store, 0, [1, 2]) == [False, True]


def test_saving_a_present_key_counts_as_a_use() -> None:
    store = BlockStore(PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4])
    assert save(store, 0, [1]) == [PRESENT]
    save(store, 0, [5])
    assert present(store, 0, [1, 2]) == [True, False]


def test_pinned_blocks_are_never_evicted() -> None:
    store = BlockStore(PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4])
    store.pin(0, kb(1, 2))
    assert save(store, 0, [5, 6, 7]) == [NEW, NEW, FAILED]
    assert present(store, 0, [1, 2, 5, 6]) == [True, True, True, True]
    check_invariants(store)


def test_no_room_even_after_eviction_fails_that_key_and_the_rest() -> None:
    store = BlockStore(PAGE, PAGE)
    save(store, 0, [1, 2, 3])
    store.pin(0, kb(1, 2, 3))
    res = store.reserve(0, kb(1, 4, 5, 2), sizes(4))
    assert res.status.tolist() == [PRESENT, NEW, FAILED, FAILED]
    assert store.stats().pending == 1


def test_keys_present_in_a_batch_are_not_evicted_to_make_room_for_it() -> None:
    store = BlockStore(PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4])
    res = store.reserve(0, kb(1, 2, 3, 4, 5), sizes(5))
    assert res.status.tolist() == [PRESENT] * 4 + [FAILED]
    assert present(store, 0, [1, 2, 3, 4]) == [True] * 4
    assert store.stats().pinned == 0


def test_pending_blocks_are_never_evicted() -> None:
    store = BlockStore(PAGE, PAGE)
    store.reserve(0, kb(1, 2, 3, 4), sizes(4))
    assert store.reserve(0, kb(5), sizes(1)).status.tolist() == [FAILED]


def test_a_new_size_class_steals_the_least_recently_used_page() -> None:
    store = BlockStore(2 * PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4, 5, 6, 7, 8])  # two pages of 1 KiB blocks
    store.release(store.pin(0, kb(2)).handles)  # page 0 has the most recent use
    assert save(store, 0, [100], size=3000) == [NEW]
    assert present(store, 0, [1, 2, 3, 4, 5, 6, 7, 8, 100]) == [True] * 4 + [False] * 4 + [True]
    st = store.stats()
    assert st.evictions["page"] == 4
    assert [(c.chunk_size, c.pages) for c in st.classes] == [(1024, 1), (3008, 1)]
    check_invariants(store)


def test_pages_with_pinned_or_pending_blocks_are_not_stolen() -> None:
    store = BlockStore(2 * PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    store.pin(0, kb(1))
    store.reserve(0, kb(9), np.array([64], dtype=np.uint64))  # no page for a new class
    assert store.reserve(0, kb(10), sizes(1, 3000)).status.tolist() == [FAILED]


def test_a_batch_never_steals_the_page_it_just_got_a_place_on() -> None:
    store = BlockStore(2 * PAGE, PAGE)
    save(store, 0, [1, 2, 3, 4])  # page 0; page 1 free
    res = store.reserve(0, kb(10, 11), np.array([3000, 2000], dtype=np.uint64))
    assert res.status.tolist() == [NEW, NEW]
    assert res.offsets.tolist() == [PAGE, 0]
    assert present(store, 0, [1, 2, 3, 4]) == [False] * 4
    check_invariants(store)


def test_stats_account_for_every_byte() -> None:
    store = BlockStore(3 * PAGE + 100, PAGE)
    save(store, 0, [1, 2], size=1000)
    save(store, 1, [1], size=3000)
    store.reserve(0, kb(3), sizes(1, 10))
    st = store.stats()
    assert st.capacity == 3 * PAGE + 100
    assert st.bytes_used == 2 * 1024 + 3008 + 64
    assert st.ns_bytes == {0: 2000, 1: 3000}
    assert (st.entries, st.pending, st.pinned) == (4, 1, 0)
    check_invariants(store)


def test_clock_rebase_keeps_the_lru_order() -> None:
    store = BlockStore(PAGE, PAGE)
    store.clock_limit = 16
    for k in range(1, 5):
        save(store, 0, [k])
    for _ in range(20):  # many ticks, rebases on the way
        store.release(store.pin(0, kb(4)).handles)
    store.release(store.pin(0, kb(2)).handles)
    save(store, 0, [5, 6])
    assert present(store, 0, [1, 2, 3, 4, 5, 6]) == [False, True, False, True, True, True]
    assert int(store.index.last_used.max()) < 16


def test_big_blocks_fill_whole_pages() -> None:
    store = BlockStore(2 * PAGE, PAGE)
    res = store.reserve(0, kb(1, 2, 3), sizes(3, PAGE))
    assert res.status.tolist() == [NEW, NEW, FAILED]
    assert sorted(res.offsets[:2].tolist()) == [0, PAGE]


def test_mismatched_sizes_are_an_error() -> None:
    store = BlockStore(PAGE, PAGE)
    with pytest.raises(ValueError, match="sizes"):
        store.reserve(0, kb(1, 2), sizes(1))


def test_empty_batches_do_nothing() -> None:
    store = BlockStore(PAGE, PAGE)
    empty = KeyBatch.from_ints(np.zeros(0, dtype=np.uint64))
    assert store.reserve(0, empty, sizes(0)).status.size == 0
    assert store.pin(0, empty).count == 0
    assert store.exists(0, empty) == 0
    assert store.commit(np.zeros(0, dtype=np.uint32)) == 0
    assert store.release(np.zeros(0, dtype=np.uint32)) == 0


# -- a model of what the store may hold -------------------------------------------------


class StoreModel(RuleBasedStateMachine):
    """Random calls against a model of what the store must, may and must not hold.

    PENDING and pinned blocks are known exactly (never evicted); committed,
    unpinned blocks may have been evicted, which the model learns when a
    call reports them missing.
    """

    eviction = "lru"
    admit = False  # with True, namespace 1 stores a block from its second save on

    def __init__(self) -> None:
        super().__init__()
        self.store = BlockStore(6 * PAGE + 500, PAGE, eviction=self.eviction)
        if self.admit:
            self.store.set_admit_after(1, 2)
        self.store.clock_limit = 64  # rebase the clock now and then
        self.store.lru_queue_fraction = 2  # queues outlive the call that built them
        self.pending: dict[tuple[int, int], int] = {}  # key -> handle
        self.ready: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (handle, size)
        self.pins: Counter[int] = Counter()  # handle -> pins we hold
        self.granted: dict[int, int] = {}  # byte offset -> chunk size of the chunks granted to us

    def pinned(self, key: tuple[int, int]) -> bool:
        return key in self.ready and self.pins[self.ready[key][0]] > 0

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, MODEL_KEYS), min_size=1, max_size=8),
          data=st.data())
    def reserve(self, ns: int, keys: list[int], data: st.DataObject) -> None:
        one = st.sampled_from([1, 100, 1000, 2000, 4000, 0, PAGE + 1])
        if data.draw(st.booleans()):  # usually one size for the batch, as a model saves
            per_key = [data.draw(one)] * len(keys)
        else:
            per_key = data.draw(st.lists(one, min_size=len(keys), max_size=len(keys)))
        res = self.store.reserve(ns, kb(*keys), np.array(per_key, dtype=np.uint64), admit=self.admit)
        self.reserved(ns, keys, per_key, res)

    def reserved(self, ns: int, keys: list[int], per_key: list[int], res: Reservation) -> None:
        """Check a reservation's answer and learn from it."""
        status = res.status.tolist()
        failed = status.index(FAILED) if FAILED in status else len(keys)
        assert status[failed:] == [FAILED] * (len(keys) - failed)
        if failed < len(keys):
            key = (ns, keys[failed])
            assert key not in self.pending and not self.pinned(key)
        batch: set[tuple[int, int]] = set()
        for k, s, h, off, size in zip(keys[:failed], status, res.handles.tolist(),
                                      res.offsets.tolist(), per_key, strict=False):
            key = (ns, k)
            if s == PRESENT:
                assert key in self.pending or key in self.ready or key in batch
            else:
                assert key not in self.pending and not self.pinned(key) and key not in batch
                assert 1 <= size <= PAGE and off + size <= self.store.capacity
                self.ready.pop(key, None)  # it had been evicted
                assert self.pins[h] == 0, "the entry of a pinned block was reused"
                for gone in [r for r, (rh, _) in self.ready.items() if rh == h]:
                    del self.ready[gone]  # evicted: its entry id is reused
                self.pending[key] = h
            batch.add(key)

    @rule(size=st.sampled_from([1, 100, 1000, 2000, 4000, 0, PAGE + 1]), k=st.integers(0, 4))
    def grant(self, size: int, k: int) -> None:
        got = self.store.grant(size, k).tolist()
        assert len(got) <= k
        if not 1 <= size <= PAGE:
            assert got == []
        for off in got:
            assert off not in self.granted, "a chunk was granted twice"
            self.granted[off] = self.store.slabs.chunk_for(size)

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, MODEL_KEYS), min_size=1, max_size=4),
          data=st.data())
    def put(self, ns: int, keys: list[int], data: st.DataObject) -> None:
        """A save into granted chunks (``reserve(at=...)``), as a client with grants saves."""
        if len(self.granted) < len(keys):
            return
        chosen = data.draw(st.permutations(sorted(self.granted)))[: len(keys)]
        # any size whose chunk is the granted chunk's: from the chunk down to one alignment step less
        per_key = [max(1, self.granted[o] - data.draw(st.integers(0, self.store.slabs.align - 1)))
                   for o in chosen]
        res = self.store.reserve(ns, kb(*keys), np.array(per_key, dtype=np.uint64), admit=self.admit,
                                 at=np.array(chosen, dtype=np.uint64))
        status = res.status.tolist()
        assert FAILED not in status or self.admit, "a save into granted chunks failed without admission"
        for o, s, off in zip(chosen, status, res.offsets.tolist(), strict=True):
            if s == NEW:
                assert off == o, "a NEW key did not take its granted chunk"
                del self.granted[o]
        self.reserved(ns, keys, per_key, res)

    @rule(data=st.data())
    def ungrant(self, data: st.DataObject) -> None:
        back = data.draw(st.lists(st.sampled_from(sorted(self.granted) or [0]), unique=True))
        back = [o for o in back if o in self.granted]
        assert self.store.ungrant(np.array(back, dtype=np.uint64)) == len(back)
        for o in back:
            del self.granted[o]

    @rule(data=st.data(), junk=st.lists(st.integers(0, 40), max_size=3))
    def commit(self, data: st.DataObject, junk: list[int]) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pending) or [(9, 9)]),
                                  unique=True))
        keys = [k for k in keys if k in self.pending]
        handles = [self.pending[k] for k in keys]
        known = set(self.pending.values())
        extra = [j for j in junk if j not in known]
        assert self.store.commit(np.array(handles + extra + handles, dtype=np.uint32)) == len(keys)
        for k in keys:
            h = self.pending.pop(k)
            self.ready[k] = (h, int(self.store.index.length[h]))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pending) or [(9, 9)]),
                                  unique=True))
        keys = [k for k in keys if k in self.pending]
        handles = [self.pending.pop(k) for k in keys]
        assert self.store.abort(np.array(handles, dtype=np.uint32)) == len(keys)

    def check_prefix(self, ns: int, keys: list[int], count: int) -> None:
        for k in keys[:count]:
            assert (ns, k) in self.ready, "a key that is not committed was loaded"
        if count < len(keys):
            key = (ns, keys[count])
            assert not self.pinned(key), "a pinned block went missing"
            self.ready.pop(key, None)  # committed but evicted

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, MODEL_KEYS), min_size=1, max_size=8))
    def pin(self, ns: int, keys: list[int]) -> None:
        p = self.store.pin(ns, kb(*keys))
        self.check_prefix(ns, keys, p.count)
        for k, h, n in zip(keys, p.handles.tolist(), p.lengths.tolist(), strict=False):
            assert self.ready[(ns, k)] == (h, n)
            self.pins[h] += 1

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = sorted(self.pins.elements())
        if not held:
            return
        handles = data.draw(st.lists(st.sampled_from(held), max_size=len(held)))
        handles = [h for h in handles if self.pins[h] > 0]
        done = Counter()
        for h in handles:
            if self.pins[h] > done[h]:
                done[h] += 1
        assert self.store.release(np.array(handles, dtype=np.uint32)) == sum(done.values())
        self.pins.subtract(done)

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, MODEL_KEYS), min_size=1, max_size=8))
    def exists(self, ns: int, keys: list[int]) -> None:
        self.check_prefix(ns, keys, self.store.exists(ns, kb(*keys)))

    @invariant()
    def structure_holds(self) -> None:
        check_invariants(self.store)

    @invariant()
    def granted_chunks_are_nobody_elses(self) -> None:
        st_ = self.store
        assert st_.granted_bytes == sum(self.granted.values())
        if not self.granted:
            return
        offs = np.array(sorted(self.granted), dtype=np.uint64)
        free = np.concatenate([c.stack[: c.top] for c in st_.slabs.classes])
        assert not np.isin(offs, free).any(), "a granted chunk is on a free stack"
        live = st_.index.live_ids()
        starts = st_.index.offset[live].astype(np.uint64) * np.uint64(st_.slabs.align)
        assert not np.isin(offs, starts).any(), "a block was placed in a granted chunk"
        owners = st_.slabs.page_owner[(offs // np.uint64(PAGE)).astype(np.int64)]
        chunks = [st_.slabs.classes[c].chunk_size for c in owners.tolist()]
        assert chunks == [self.granted[o] for o in offs.tolist()], "a granted chunk's page changed class"

    @invariant()
    def known_blocks_are_where_the_model_says(self) -> None:
        idx = self.store.index
        for (ns, k), h in self.pending.items():
            assert idx.state[h] == PENDING and idx.find(ns, kb(k)).tolist() == [h]
        for h, n in self.pins.items():
            if n:
                assert idx.state[h] == READY and idx.pins[h] == n
        assert self.store.stats().pending == len(self.pending)
        assert int((idx.state[: idx.high_water] != FREE).sum()) >= len(self.pending)


StoreModel.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestStoreModel = StoreModel.TestCase


class PrefixStoreModel(StoreModel):
    """The same model under the prefix eviction policy, with admission on namespace 1."""

    eviction = "prefix"
    admit = True


PrefixStoreModel.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestPrefixStoreModel = PrefixStoreModel.TestCase


def test_read_cache_copies_are_evicted_before_owned_blocks() -> None:
    store = BlockStore(4 << 20, 1 << 20)  # 4 pages of 1 MiB: 16 blocks of 256 KiB
    size = np.full(1, 256 << 10, np.uint64)
    for k in range(16):
        res = store.reserve(0, KeyBatch.from_user([k]), size)
        store.commit(res.handles)
    copies = [3, 7, 11]  # recently used, but only copies of other nodes' blocks
    store.mark_cached(0, KeyBatch.from_user(copies))
    pinned = store.pin(0, KeyBatch.from_user(copies))  # a use: they are now the most recent
    store.release(pinned.handles)
    for k in range(100, 103):
        res = store.reserve(0, KeyBatch.from_user([k]), size)
        assert res.status[0] == Status.NEW
        store.commit(res.handles)
    assert all(store.exists(0, KeyBatch.from_user([c])) == 0 for c in copies)
    assert store.exists(0, KeyBatch.from_user(list(range(3)))) == 3  # the oldest owned blocks stayed
    assert store.mark_cached(0, KeyBatch.from_user([999])) == 0  # absent keys are not flagged


def owned_and_copies(store: BlockStore, ns: int = 0) -> tuple[set[int], int]:
    """(ids of READY owned entries, bytes of READY copies)."""
    idx = store.index
    live = idx.live_ids()
    ready = live[idx.state[live] == READY]
    copy = idx.cached[ready] != 0
    return set(ready[~copy].tolist()), int(idx.length[ready[copy]].sum())


def fetch(store: BlockStore, key: int, size: int) -> int:
    """A copy fetched from another node: reserved as a copy, committed, marked cached."""
    res = store.reserve(0, KeyBatch.from_user([key]), np.full(1, size, np.uint64), copy=True)
    store.commit(res.handles[res.status == Status.NEW])
    store.mark_cached(0, KeyBatch.from_user([key]))
    return int(res.status[0])


def test_a_fetched_copy_evicts_owned_blocks_only_while_copies_hold_less_than_the_floor() -> None:
    store = BlockStore(4 << 20, 1 << 20)  # 16 blocks of 256 KiB
    store.copy_floor = 512 << 10  # two blocks
    size = 256 << 10
    for k in range(16):
        save(store, 0, [k], size)
    for k in range(100, 113):  # fetches through a pool full of owned blocks
        assert fetch(store, k, size) == NEW
    owned, copied = owned_and_copies(store)
    assert len(owned) == 14 and copied == 2 * size  # two owned blocks went, then only copies
    assert present(store, 0, list(range(2, 16))) == [True] * 14  # the oldest two were the ones
    save(store, 0, [200], size)  # a save takes a copy first, as before
    assert len(owned_and_copies(store)[0]) == 15


def test_with_no_floor_a_fetched_copy_never_evicts_an_owned_block() -> None:
    store = BlockStore(4 << 20, 1 << 20)
    store.copy_floor = 0
    for k in range(12):  # three pages of owned 256 KiB blocks
        save(store, 0, [k], 256 << 10)
    for k in range(50, 66):  # a page of 64 KiB copies
        assert fetch(store, k, 64 << 10) == NEW
    assert fetch(store, 100, 256 << 10) == NEW  # took back the page of copies, not an owned block
    assert present(store, 0, list(range(12))) == [True] * 12
    assert fetch(store, 101, 256 << 10) == NEW  # a free chunk of that page
    save(store, 0, [300, 301], 256 << 10)  # the pool is full: owned blocks and two copies
    pinned = store.pin(0, KeyBatch.from_user([100, 101]))  # being read: not evictable
    before = owned_and_copies(store)[0]
    assert fetch(store, 102, 256 << 10) == FAILED  # no copy to evict: a miss, never an owned block
    assert owned_and_copies(store)[0] == before
    store.release(pinned.handles)
    assert fetch(store, 102, 256 << 10) == NEW  # took the place of a copy
    assert owned_and_copies(store)[0] == before
    check_invariants(store)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60),
                          st.sampled_from([16 << 10, 64 << 10, 256 << 10])), max_size=80),
       st.sampled_from([0, 256 << 10, 1 << 20]))
def test_fetched_copies_evict_owned_blocks_only_below_the_floor(ops: list[tuple[bool, int, int]],
                                                                  floor: int) -> None:
    store = BlockStore(2 << 20, 256 << 10)
    store.copy_floor = floor
    for is_fetch, key, size in ops:
        owned, copied = owned_and_copies(store)
        if is_fetch:
            lengths = {i: int(store.index.length[i]) for i in owned}
            fetch(store, 1000 + key, size)
            lost = sum(lengths[i] for i in owned - owned_and_copies(store)[0])
            assert lost <= max(0, floor - copied), "a copy took more from owned blocks than the floor"
        else:
            save(store, 0, [key], size)
        check_invariants(store)


def test_discard_drops_unpinned_ready_blocks_only() -> None:
    store = BlockStore(4 << 20, 1 << 20)
    res = store.reserve(0, KeyBatch.from_user([1, 2, 3]), np.full(3, 4096, np.uint64))
    store.commit(res.handles[:2])  # 3 stays PENDING
    pinned = store.pin(0, KeyBatch.from_user([2]))
    assert store.discard(0, KeyBatch.from_user([1, 2, 3, 4])) == 1
    assert store.exists(0, KeyBatch.from_user([1])) == 0 and store.exists(0, KeyBatch.from_user([2])) == 1
    store.release(pinned.handles)
    store.abort(res.handles[2:])
    assert store.stats().evictions.get("moved") == 1


def test_discard_handles_drops_unpinned_ready_entries_and_ignores_the_rest() -> None:
    store = BlockStore(4 << 20, 1 << 20)
    res = store.reserve(0, KeyBatch.from_user([1, 2, 3]), np.full(3, 4096, np.uint64))
    store.commit(res.handles[:2])  # 3 stays PENDING
    pinned = store.pin(0, KeyBatch.from_user([2]))
    bogus = np.array([0, 1, 2**32 - 1], dtype=np.uint32)
    assert store.discard_handles(np.concatenate([res.handles, res.handles, bogus])) == 1
    assert present(store, 0, [1, 2]) == [False, True]
    store.release(pinned.handles)
    assert store.discard_handles(pinned.handles) == 1
    store.abort(res.handles[2:])
    check_invariants(store)


def test_copies_first_takes_copies_oldest_first_then_owned() -> None:
    from emsd.pool.eviction import copies_first

    last_used = np.array([0, 0, 5, 1, 9, 2, 3], dtype=np.uint32)
    cached = np.array([0, 0, 0, 1, 1, 0, 0], dtype=np.uint8)
    ids = np.arange(2, 7, dtype=np.uint32)
    assert copies_first(last_used, cached, ids, 1).tolist() == [3]
    assert copies_first(last_used, cached, ids, 4).tolist() == [3, 4, 5, 6]
    assert copies_first(last_used, cached, ids, 9).tolist() == [3, 4, 5, 6, 2]


def test_an_eviction_that_outruns_the_lru_queue_frees_each_chunk_once() -> None:
    # 64 blocks fill the pool; the first eviction queues the oldest 64/16 = 4 and takes 1.
    # The next needs 6: the 3 left in the queue, then a fresh scan, which must not hand
    # out those 3 again (a chunk freed twice is later given to two blocks at once).
    store = BlockStore(16 * PAGE, PAGE)
    save(store, 0, list(range(64)))
    save(store, 0, [100])
    save(store, 0, list(range(200, 206)))
    check_invariants(store)
    save(store, 0, list(range(300, 340)))
    check_invariants(store)
    assert store.exists(0, kb(*range(300, 340))) == 40


# -- the prefix policy and admission ------------------------------------------------------


def test_prefix_policy_evicts_a_cold_chain_from_its_tail() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")  # room for four 1 KiB blocks
    save(store, 0, [1, 2, 3, 4])  # one chain: 1 is its head
    assert save(store, 0, [5]) == [NEW]
    assert present(store, 0, [1, 2, 3, 4]) == [True, True, True, False]
    lru = BlockStore(PAGE, PAGE, eviction="lru")
    save(lru, 0, [1, 2, 3, 4])
    save(lru, 0, [5])
    assert present(lru, 0, [1, 2, 3, 4]) == [False, True, True, True]  # the head goes first
    check_invariants(store)


def test_prefix_policy_keeps_a_head_whose_successor_was_just_loaded() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")
    save(store, 0, [1, 2])
    save(store, 0, [3, 4])
    store.release(store.pin(0, kb(1, 2)).handles)  # chain 1-2 is hot, 3-4 is cold
    assert save(store, 0, [5, 6]) == [NEW, NEW]
    assert present(store, 0, [1, 2, 3, 5, 6]) == [True, True, False, True, True]


def test_prefix_policy_commit_keeps_the_reserve_stamps() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")
    save(store, 0, [1])
    res = store.reserve(0, kb(1, 2), sizes(2))  # 1 present, 2 new: 1 stamped newer
    store.commit(res.handles[res.status == NEW])
    h1, h2 = store.index.find(0, kb(1, 2)).tolist()
    assert store.index.last_used[h1] > store.index.last_used[h2]


def test_exists_does_not_count_as_a_use_under_the_prefix_policy() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")
    save(store, 0, [4])
    save(store, 0, [1, 2, 3])
    before = store.index.last_used.copy()
    assert store.exists(0, kb(4)) == 1
    assert (store.index.last_used == before).all()
    save(store, 0, [5])
    assert present(store, 0, [4, 1]) == [False, True]


def test_an_unknown_eviction_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'mru'"):
        BlockStore(PAGE, PAGE, eviction="mru")


def test_admission_stores_a_block_from_its_nth_save_on() -> None:
    store = BlockStore(4 * PAGE, PAGE)
    store.set_admit_after(0, 2)
    assert store.reserve(0, kb(1, 2), sizes(2), admit=True).status.tolist() == [FAILED, FAILED]
    assert store.stats().pending == 0
    res = store.reserve(0, kb(1, 2, 3), sizes(3), admit=True)
    assert res.status.tolist() == [NEW, NEW, FAILED]  # 3 is seen for the first time
    store.commit(res.handles[res.status == NEW])
    assert store.reserve(0, kb(1, 2, 3), sizes(3), admit=True).status.tolist() == [PRESENT, PRESENT, NEW]


def test_admission_is_per_namespace_and_only_for_client_saves() -> None:
    store = BlockStore(4 * PAGE, PAGE)
    store.set_admit_after(0, 3)
    assert save(store, 1, [1]) == [NEW]  # another namespace: no rule
    assert store.reserve(0, kb(1), sizes(1)).status.tolist() == [NEW]  # a peer's copy: admitted
    with pytest.raises(ValueError, match="got 0"):
        store.set_admit_after(0, 0)


def test_admission_rule_is_taken_from_the_namespace_name() -> None:
    from emsd.pool.admission import AdmissionRule

    store = BlockStore(4 * PAGE, PAGE, admission=AdmissionRule(1, (("chat*", 2),)))
    store.name_namespace(0, "chat-a")
    store.name_namespace(1, "batch")
    assert store.reserve(0, kb(1), sizes(1), admit=True).status.tolist() == [FAILED]
    assert store.reserve(1, kb(1), sizes(1), admit=True).status.tolist() == [NEW]


def test_prefix_policy_stamps_a_continued_chain_below_its_predecessor() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")
    save(store, 0, [1, 2])
    store.release(store.pin(0, kb(1, 2)).handles)  # a load of the head ...
    res = store.reserve(0, kb(3, 4), sizes(2), prev=kb(2))  # ... then a save of the rest only
    store.commit(res.handles[res.status == NEW])
    stamps = store.index.last_used[store.index.find(0, kb(1, 2, 3, 4))].tolist()
    assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == 4
    assert save(store, 0, [5]) == [NEW]
    assert present(store, 0, [1, 2, 3, 4]) == [True, True, True, False]  # the tail went first


def test_a_predecessor_that_is_not_stored_bounds_nothing() -> None:
    store = BlockStore(PAGE, PAGE, eviction="prefix")
    save(store, 0, [1])
    res = store.reserve(0, kb(3), sizes(1), prev=kb(99))
    h3 = int(res.handles[0])
    assert store.index.last_used[h3] > store.index.last_used[store.index.find(0, kb(1))[0]]


def test_the_eviction_scan_finds_the_same_entries_in_c_and_numpy() -> None:
    """READY, unpinned, of the class: ``_scan`` with the C filter and with numpy alike."""
    store = BlockStore(16 * PAGE, PAGE)
    for i in range(12):  # three sizes of class, some PENDING, some pinned, some evicted
        res = store.reserve(0, kb(*range(10 * i, 10 * i + 6)), sizes(6, (256, 512, 1024)[i % 3]))
        if i % 4:
            store.commit(res.handles[res.status == NEW])
    store.pin(0, kb(*range(0, 40, 3)))
    queues = []
    for use_c in (True, False):
        store.index.use_c = use_c
        store._queues.clear()
        queues.append([(q.ids.tolist(), q.stamps.tolist())
                       for q in (store._scan(cls, 10**6, np.zeros(0, np.uint32))  # need: all
                                 for cls in range(len(store.slabs.classes)))])
    assert queues[0] == queues[1] and any(ids for ids, _ in queues[0])
