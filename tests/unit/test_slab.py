"""The slab allocator: classes, chunks, pages and their accounting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from emsd.pool.slab import SlabAllocator, SlabError

PAGE = 4096
PAGES = 8


def test_sizes_round_up_to_64_bytes_and_share_a_class() -> None:
    slabs = SlabAllocator(PAGES * PAGE, PAGE)
    a = slabs.class_for(1)
    assert slabs.classes[a].chunk_size == 64
    assert slabs.class_for(64) == a
    b = slabs.class_for(65)
    assert b != a and slabs.classes[b].chunk_size == 128


def test_sizes_outside_one_page_are_refused() -> None:
    slabs = SlabAllocator(PAGES * PAGE, PAGE)
    assert slabs.class_for(0) is None
    assert slabs.class_for(PAGE + 1) is None
    assert slabs.class_for(PAGE) is not None


def test_alloc_carves_pages_then_runs_out() -> None:
    slabs = SlabAllocator(2 * PAGE, PAGE)
    cls = slabs.class_for(1024)
    got = slabs.alloc_many(cls, 100)
    assert got.tolist() == [i * 1024 for i in range(8)]
    assert slabs.alloc(cls) is None
    assert slabs.free_pages == 0


def test_alloc_after_free_reuses_the_chunk() -> None:
    slabs = SlabAllocator(PAGES * PAGE, PAGE)
    cls = slabs.class_for(100)
    first = slabs.alloc(cls)
    slabs.alloc(cls)
    slabs.free(cls, first)
    assert slabs.alloc(cls) == first


def test_release_page_refuses_a_page_in_use() -> None:
    slabs = SlabAllocator(PAGES * PAGE, PAGE)
    cls = slabs.class_for(100)
    off = slabs.alloc(cls)
    with pytest.raises(SlabError, match="in use"):
        slabs.release_page(int(slabs.page_of(off)))
    slabs.free(cls, off)
    slabs.release_page(int(slabs.page_of(off)))
    assert slabs.free_pages == PAGES
    with pytest.raises(SlabError, match="not owned"):
        slabs.release_page(0)


def test_released_page_goes_to_another_class() -> None:
    slabs = SlabAllocator(PAGE, PAGE)
    small, big = slabs.class_for(64), slabs.class_for(2048)
    offs = slabs.alloc_many(small, 64)
    assert slabs.alloc(big) is None
    slabs.free_many(small, offs)
    slabs.release_page(0)
    assert slabs.classes[small].chunks_free == 0
    assert slabs.alloc_many(big, 2).tolist() == [0, 2048]


def test_class_without_pages_is_recycled_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("emsd.pool.slab.MAX_CLASSES", 2)
    slabs = SlabAllocator(PAGES * PAGE, PAGE)
    a, b = slabs.class_for(64), slabs.class_for(128)
    slabs.alloc(a)
    c = slabs.class_for(256)  # b owns no page: recycled
    assert c == b and slabs.classes[c].chunk_size == 256
    slabs.alloc(c)
    assert slabs.class_for(512) is None  # every class owns a page
    assert slabs.class_for(64) == a


def test_big_pool_aligns_offsets_so_they_fit_32_bits() -> None:
    slabs = SlabAllocator(1 << 40, 64 << 20)  # 1 TiB: nothing is touched
    assert slabs.align == 256
    assert slabs.chunk_for(1) == 256


class SlabMachine(RuleBasedStateMachine):
    """Random alloc / free / release_page against a record of live chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.slabs = SlabAllocator(PAGES * PAGE + 100, PAGE)
        self.live: dict[int, int] = {}  # offset -> class

    @rule(size=st.sampled_from([1, 64, 100, 700, 1500, 4000]), k=st.integers(1, 20))
    def alloc(self, size: int, k: int) -> None:
        cls = self.slabs.class_for(size)
        assert cls is not None
        before_free = self.slabs.free_pages
        got = self.slabs.alloc_many(cls, k)
        assert got.size <= k
        if got.size < k:
            assert self.slabs.free_pages == 0
        else:
            assert self.slabs.free_pages <= before_free
        for off in got.tolist():
            assert off not in self.live
            self.live[off] = cls

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offs = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        by_class: dict[int, list[int]] = {}
        for off in offs:
            by_class.setdefault(self.live.pop(off), []).append(off)
        for cls, group in by_class.items():
            self.slabs.free_many(cls, np.array(group, dtype=np.uint64))

    @rule(data=st.data())
    def release_a_page(self, data: st.DataObject) -> None:
        owned = np.flatnonzero(self.slabs.page_owner >= 0).tolist()
        if not owned:
            return
        page = data.draw(st.sampled_from(owned))
        on_page = [o for o in self.live if o // PAGE == page]
        if on_page:
            with pytest.raises(SlabError):
                self.slabs.release_page(page)
            return
        self.slabs.release_page(page)
        assert self.slabs.page_owner[page] == -1

    @invariant()
    def chunks_never_overlap_and_stay_in_their_page(self) -> None:
        spans = sorted((o, o + self.slabs.classes[c].chunk_size) for o, c in self.live.items())
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start
        for off, cls in self.live.items():
            page = off // PAGE
            assert self.slabs.page_owner[page] == cls
            assert off + self.slabs.classes[cls].chunk_size <= (page + 1) * PAGE
            assert off % 64 == 0

    @invariant()
    def accounting_adds_up(self) -> None:
        s = self.slabs
        assert s.bytes_used() + s.bytes_free() + s.bytes_slack() == s.capacity
        used = sum(s.classes[c].chunk_size for c in self.live.values())
        assert s.bytes_used() == used
        for cls, c in enumerate(s.classes):
            assert c.chunks_used == sum(1 for v in self.live.values() if v == cls)
            assert len(c.pages) * c.per_page == c.chunks_used + c.chunks_free
            assert sorted(c.pages) == np.flatnonzero(s.page_owner == cls).tolist()
        per_page = np.bincount([o // PAGE for o in self.live], minlength=s.pages)
        assert per_page.tolist() == s.page_used.tolist()


SlabMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSlabMachine = SlabMachine.TestCase
