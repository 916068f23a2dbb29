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
    """Random alloc / free / release_page against a record of live chunks, and against a twin
    allocator that takes every single chunk with ``alloc_many(cls, 1)`` where this one takes
    it with ``alloc`` (scalar steps): the same chunks, the same state."""

    def __init__(self) -> None:
        super().__init__()
        self.slabs = SlabAllocator(PAGES * PAGE + 100, PAGE)
        self.slabs.on_bind = self.bind
        self.twin = SlabAllocator(PAGES * PAGE + 100, PAGE)
        self.twin.on_bind = lambda page, old, new: None
        self.memory = [0] * PAGES  # whose memory each page is, as the binds left it
        self.live: dict[int, int] = {}  # offset -> class

    def bind(self, page: int, old: int, new: int) -> None:
        assert self.slabs.page_owner[page] == -1 and self.slabs.page_used[page] == 0  # free pages only
        assert self.memory[page] == old != new
        self.memory[page] = new

    @rule(size=st.sampled_from([1, 64, 100, 700, 1500, 4000]), k=st.one_of(st.just(1), st.integers(1, 20)),
          group=st.sampled_from([0, 0, 1, 2]))
    def alloc(self, size: int, k: int, group: int) -> None:
        cls = self.slabs.class_for(size, group)
        assert cls is not None and self.twin.class_for(size, group) == cls
        before_free = self.slabs.free_pages
        if k == 1:
            one = self.slabs.alloc(cls)
            got = np.array([] if one is None else [one], dtype=np.uint64)
        else:
            got = self.slabs.alloc_many(cls, k)
        assert got.tolist() == self.twin.alloc_many(cls, k).tolist()
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
            for slabs in (self.slabs, self.twin):
                slabs.free_many(cls, np.array(group, dtype=np.uint64))

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
        self.twin.release_page(page)
        assert self.slabs.page_owner[page] == -1

    @invariant()
    def the_twin_is_in_the_same_state(self) -> None:
        for name in ("page_used", "page_owner", "page_group"):
            assert getattr(self.slabs, name).tolist() == getattr(self.twin, name).tolist()
        assert self.slabs._free_pages == self.twin._free_pages
        assert [(c.top, c.stack[: c.top].tolist(), c.carve_page, c.carve_next, c.chunks_used, c.pages)
                for c in self.slabs.classes] == \
               [(c.top, c.stack[: c.top].tolist(), c.carve_page, c.carve_next, c.chunks_used, c.pages)
                for c in self.twin.classes]

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
    def every_chunk_is_in_its_groups_memory(self) -> None:
        assert self.slabs.page_group.tolist() == self.memory
        for off, cls in self.live.items():
            assert self.memory[off // PAGE] == self.slabs.classes[cls].group

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


def test_a_page_changes_group_only_through_on_bind_and_a_failed_bind_leaves_it_free() -> None:
    s = SlabAllocator(2 * PAGE, PAGE)
    binds: list[tuple[int, int, int]] = []
    s.on_bind = lambda page, old, new: binds.append((page, old, new))
    a, b = s.class_for(64, 1), s.class_for(64, 2)
    assert a is not None and b is not None and a != b and s.class_for(64) not in (a, b)
    s.alloc_many(a, PAGE // 64)  # page 0, for group 1
    assert binds == [(0, 0, 1)]
    off = s.alloc_many(b, 1)  # page 1, for group 2
    assert binds[-1] == (1, 0, 2)
    s.free_many(b, off)
    s.release_page(1)
    assert s.alloc_many(b, 1).size == 1 and len(binds) == 2  # its own page again: no bind
    s.free_many(b, np.array([PAGE], dtype=np.uint64))
    s.release_page(1)

    def refuse(page: int, old: int, new: int) -> None:
        raise OSError(12, "no memory")

    s.on_bind = refuse
    assert s.alloc_many(a, 1).size == 0  # as if the pool were full
    assert s.free_pages == 1 and s.page_group[1] == 2


def test_restore_puts_each_page_in_its_blocks_group_and_refuses_two_groups_on_a_page() -> None:
    s = SlabAllocator(4 * PAGE, PAGE)
    s.restore(np.array([0, 64, 2 * PAGE], dtype=np.uint64), np.array([64, 64, 64], dtype=np.uint64),
              np.array([3, 3, 1]))
    assert s.page_group.tolist() == [3, 0, 1, 0]
    assert s.classes[int(s.page_owner[0])].group == 3 and s.classes[int(s.page_owner[2])].group == 1
    with pytest.raises(SlabError, match="two groups"):
        SlabAllocator(4 * PAGE, PAGE).restore(np.array([0, 64], dtype=np.uint64),
                                              np.array([64, 64], dtype=np.uint64), np.array([1, 2]))


SlabMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSlabMachine = SlabMachine.TestCase
