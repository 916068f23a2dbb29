"""Slab allocator: size classes of equal chunks carved from fixed-size pages.

The model is memcached's ``slabs.c``; this is the mechanism only (what to
evict or which page to take back is decided by ``emsd.pool.eviction`` and
carried out by the store).

- The region's ``capacity`` bytes are cut into ``pages = capacity //
  page_size`` pages. A page is free, or owned by exactly one size class.
- A size class is one exact chunk size: the requested size rounded up to
  ``align`` (64 bytes; more for pools over 256 GiB so that an offset in
  ``align`` units fits in 32 bits, which the index relies on). KV blocks of
  one model all have the same size, so exact classes waste almost nothing.
  Classes are created on demand, at most ``MAX_CLASSES``; beyond that a class
  that owns no page is recycled for the new size.
- A class carves its pages into ``page_size // chunk_size`` chunks. Carving is
  lazy: a class keeps a cursor into its newest page and hands out its chunks
  in order, so taking a page costs O(1) even for tiny chunks. Freed chunks go
  on the class's free stack and are reused first (LIFO, cache-warm).
- The free stack is a numpy array with a top index rather than a Python list:
  8 bytes per free chunk instead of ~40, batches pushed and popped with one
  slice, and ``release_page`` drops a page's chunks with one vectorised mask.
- ``release_page`` returns an empty page (no chunk in use) from its class to
  the free pages, so another class can take it (page stealing, like
  memcached's slab rebalancer). The caller evicts the page's entries first.
- Groups (``class_for(size, group)``): a class belongs to one group, and a
  page, once taken by a class, belongs to that class's group until another
  group's class takes it. Each page remembers its last group
  (``page_group``); when a class takes a free page of another group,
  ``on_bind(page, old, new)`` is called first (the daemon gives each tenant
  its own memory this way: ``emsd.pool.tenancy``). A bind that fails
  (``OSError``) leaves the page free and the allocation short, as a full
  pool would. Group 0 is the default; without groups nothing is bound.

Accounting, per class: ``pages * per_page == chunks_used + chunks_free``
(free = on the stack + not yet carved). Over the region: ``bytes_used() +
bytes_free() + bytes_slack() == capacity``, where slack is the tail of each
owned page that no chunk covers, plus ``capacity % page_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MAX_CLASSES = 1024
MIN_ALIGN = 64
_OFFSET_UNITS = 1 << 32  # offsets are stored in 32 bits of ``align`` units


class SlabError(ValueError):
    """A misuse of the allocator (a bug in the caller, never a full pool)."""


@dataclass
class SlabClass:
    """One size class: its pages, its free stack and its carving cursor."""

    chunk_size: int
    per_page: int
    group: int = 0
    pages: list[int] = field(default_factory=list)
    chunks_used: int = 0
    stack: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.uint64))
    top: int = 0  # stack[:top] are free chunk offsets
    carve_page: int = -1  # page being carved, or -1
    carve_next: int = 0  # next uncarved chunk index in carve_page

    @property
    def chunks_free(self) -> int:
        uncarved = self.per_page - self.carve_next if self.carve_page >= 0 else 0
        return self.top + uncarved


class SlabAllocator:
    """Pages, size classes and free chunks of a region of ``capacity`` bytes."""

    def __init__(self, capacity: int, page_size: int) -> None:
        """``page_size`` is floored to a multiple of ``align``; raises
        ``SlabError`` if it is smaller than ``align`` or than the region."""
        self.capacity = capacity
        self.align = _align_for(capacity)
        self.page_size = page_size - page_size % self.align
        if self.page_size <= 0 or self.page_size > capacity:
            raise SlabError(f"page size {page_size} must be in [{self.align}, {capacity}]")
        self.pages = capacity // self.page_size
        self.page_owner = np.full(self.pages, -1, dtype=np.int32)  # class id or -1
        self.page_used = np.zeros(self.pages, dtype=np.int64)  # chunks in use per page
        self.page_group = np.zeros(self.pages, dtype=np.int32)  # the group whose memory a page is
        self.on_bind: Callable[[int, int, int], None] | None = None  # (page, old group, new group)
        self.classes: list[SlabClass] = []
        self._by_chunk: dict[tuple[int, int], int] = {}
        self._free_pages = list(range(self.pages - 1, -1, -1))  # a stack: page 0 first

    # -- size classes ---------------------------------------------------------

    def chunk_for(self, size: int) -> int:
        """The chunk size that holds ``size`` bytes (rounded up to ``align``)."""
        return -(-size // self.align) * self.align

    def class_for(self, size: int, group: int = 0) -> int | None:
        """Class id for blocks of ``size`` bytes of ``group``, created on demand.

        None if ``size`` is not in 1..page_size, or ``MAX_CLASSES`` classes
        exist and none of them owns no page (so none can be recycled).
        """
        if not 0 < size <= self.page_size:
            return None
        chunk = self.chunk_for(size)
        cls = self._by_chunk.get((chunk, group))
        if cls is not None:
            return cls
        new = SlabClass(chunk, self.page_size // chunk, group)
        if len(self.classes) < MAX_CLASSES:
            self.classes.append(new)
            cls = len(self.classes) - 1
        else:
            cls = self._recyclable()
            if cls is None:
                return None
            old = self.classes[cls]
            del self._by_chunk[(old.chunk_size, old.group)]
            self.classes[cls] = new
        self._by_chunk[(chunk, group)] = cls
        return cls

    def _recyclable(self) -> int | None:
        for cls, c in enumerate(self.classes):
            if not c.pages:
                return cls
        return None

    # -- chunks ---------------------------------------------------------------

    def alloc(self, cls: int) -> int | None:
        """One chunk of class ``cls``: its byte offset, or None if no room. ``alloc_many(cls, 1)``
        in scalar steps (one block a call), with the same effects."""
        c = self.classes[cls]
        if c.top:
            c.top -= 1
            offset = int(c.stack[c.top])
        else:
            if not self._carving(cls):
                return None
            offset = c.carve_page * self.page_size + c.carve_next * c.chunk_size
            c.carve_next += 1
        c.chunks_used += 1
        self.page_used[offset // self.page_size] += 1
        return offset

    def alloc_many(self, cls: int, k: int) -> np.ndarray:
        """Up to ``k`` chunks (uint64 byte offsets): free stack first, then the
        carving page, then new pages. Fewer than ``k`` means no free page is
        left: the caller may evict and ask again."""
        c = self.classes[cls]
        parts: list[np.ndarray] = []
        take = min(k, c.top)
        if take:
            parts.append(c.stack[c.top - take : c.top][::-1].copy())
            c.top -= take
        need = k - take
        while need > 0 and self._carving(cls):
            n = min(need, c.per_page - c.carve_next)
            first = c.carve_page * self.page_size + c.carve_next * c.chunk_size
            parts.append(first + np.arange(n, dtype=np.uint64) * np.uint64(c.chunk_size))
            c.carve_next += n
            need -= n
        if not parts:
            return np.zeros(0, dtype=np.uint64)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        c.chunks_used += out.size
        np.add.at(self.page_used, self.page_of(out), 1)
        return out

    def _carving(self, cls: int) -> bool:
        """Whether class ``cls`` has a page to carve chunks from: its carving page, or when that
        is used up a free page, taken for it now. False when no page is free."""
        c = self.classes[cls]
        if c.carve_page >= 0 and c.carve_next < c.per_page:
            return True
        page = self._take_free_page(c.group)
        if page is None:
            return False
        self.page_owner[page] = cls
        c.pages.append(page)
        c.carve_page, c.carve_next = page, 0
        return True

    def _take_free_page(self, group: int) -> int | None:
        """A free page for ``group``, or None: the last freed of the group's own, else the last
        freed of all, bound to ``group`` first."""
        free = self._free_pages
        if not free:
            return None
        at = len(free) - 1
        if self.on_bind is not None:
            at = next((i for i in range(at, -1, -1) if self.page_group[free[i]] == group), at)
        page = free[at]
        old = int(self.page_group[page])
        if old != group:
            if self.on_bind is not None:
                try:
                    self.on_bind(page, old, group)
                except OSError:
                    return None
            self.page_group[page] = group
        return free.pop(at)

    def free(self, cls: int, offset: int) -> None:
        """Return one chunk to its class: ``free_many`` of one offset in scalar steps."""
        c = self.classes[cls]
        if c.top == c.stack.size:
            self.free_many(cls, np.array([offset], dtype=np.uint64))  # the stack grows there
            return
        c.stack[c.top] = offset
        c.top += 1
        c.chunks_used -= 1
        self.page_used[offset // self.page_size] -= 1

    def free_many(self, cls: int, offsets: np.ndarray) -> None:
        """Return chunks of class ``cls`` (each allocated, each once)."""
        k = offsets.size
        if k == 0:
            return
        c = self.classes[cls]
        if c.top + k > c.stack.size:
            grown = np.zeros(max(2 * c.stack.size, c.top + k), dtype=np.uint64)
            grown[: c.top] = c.stack[: c.top]
            c.stack = grown
        c.stack[c.top : c.top + k] = offsets
        c.top += k
        c.chunks_used -= k
        np.subtract.at(self.page_used, self.page_of(offsets), 1)

    def restore(self, offsets: np.ndarray, sizes: np.ndarray, groups: np.ndarray | None = None) -> None:
        """Mark the chunks of blocks at byte ``offsets`` of ``sizes`` bytes (of ``groups``,
        default 0) in use (warm restart).

        Only on a fresh allocator. Each page that holds a block goes to the
        class of its blocks, wholly carved: its other chunks go on the
        class's free stack; ``page_group`` says whose it is (``on_bind`` is
        not called: the caller maps restored pages itself). Raises
        ``SlabError`` (and changes nothing) if the blocks do not fit this
        geometry: outside the region, not on a chunk boundary of their
        class, two sizes of class or two groups on one page, two blocks on
        one chunk, too many classes.
        """
        if self.classes or self.free_pages != self.pages:
            raise SlabError("restore needs a fresh allocator")
        offsets = np.asarray(offsets, dtype=np.uint64)
        sizes = np.asarray(sizes, dtype=np.uint64)
        groups = (np.zeros(offsets.size, dtype=np.int64) if groups is None
                  else np.asarray(groups, dtype=np.int64))
        if offsets.size == 0:
            return
        if int(sizes.min()) < 1 or int(sizes.max()) > self.page_size:
            raise SlabError("a block size is outside 1..page_size")
        chunks = (sizes + np.uint64(self.align - 1)) // np.uint64(self.align) * np.uint64(self.align)
        pages = offsets // np.uint64(self.page_size)
        within = offsets % np.uint64(self.page_size)
        if int(pages.max()) >= self.pages or bool((within % chunks).any()) \
                or bool((within + chunks > np.uint64(self.page_size)).any()):
            raise SlabError("a block is not on a chunk of its class inside the region")
        order = np.lexsort((offsets, pages))
        p, c, o, g = pages[order], chunks[order], offsets[order], groups[order]
        if bool(((p[1:] == p[:-1]) & (c[1:] != c[:-1])).any()):
            raise SlabError("blocks of two size classes on one page")
        if bool(((p[1:] == p[:-1]) & (g[1:] != g[:-1])).any()):
            raise SlabError("blocks of two groups on one page")
        if bool((o[1:] == o[:-1]).any()):
            raise SlabError("two blocks on one chunk")
        if np.unique(np.stack([c, g.astype(np.uint64)]), axis=1).shape[1] > MAX_CLASSES:
            raise SlabError("more size classes than the allocator holds")
        starts = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
        ends = np.r_[starts[1:], p.size]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            self._restore_page(int(p[a]), int(c[a]), o[a:b], int(g[a]))
        self._free_pages = [pg for pg in range(self.pages - 1, -1, -1) if self.page_owner[pg] < 0]

    def _restore_page(self, page: int, chunk: int, used: np.ndarray, group: int) -> None:
        cls = self.class_for(chunk, group)
        assert cls is not None  # chunk <= page_size and the class count was checked
        c = self.classes[cls]
        base = page * self.page_size
        every = base + np.arange(c.per_page, dtype=np.uint64) * np.uint64(chunk)
        free = np.setdiff1d(every, used, assume_unique=True)[::-1]  # LIFO: lowest offsets first
        self.page_owner[page] = cls
        self.page_group[page] = group
        self.page_used[page] = used.size
        c.pages.append(page)
        c.chunks_used += used.size
        if c.top + free.size > c.stack.size:
            grown = np.zeros(max(2 * c.stack.size, c.top + free.size), dtype=np.uint64)
            grown[: c.top] = c.stack[: c.top]
            c.stack = grown
        c.stack[c.top : c.top + free.size] = free
        c.top += free.size

    # -- pages ----------------------------------------------------------------

    def page_of(self, offset: int | np.ndarray) -> np.ndarray:
        """Page index of byte offset(s)."""
        return np.asarray(offset, dtype=np.uint64) // np.uint64(self.page_size)

    def release_page(self, page: int) -> None:
        """Take an empty page back from its class and make it free.

        Raises ``SlabError`` if the page is free already or a chunk on it is
        still in use (evict its entries first).
        """
        cls = int(self.page_owner[page])
        if cls < 0:
            raise SlabError(f"page {page} is not owned by a class")
        if self.page_used[page]:
            raise SlabError(f"page {page} still has {self.page_used[page]} chunks in use")
        c = self.classes[cls]
        keep = self.page_of(c.stack[: c.top]) != page
        kept = c.stack[: c.top][keep]
        c.stack[: kept.size] = kept
        c.top = kept.size
        if c.carve_page == page:
            c.carve_page, c.carve_next = -1, 0
        c.pages.remove(page)
        self.page_owner[page] = -1
        self._free_pages.append(page)

    def class_of_offsets(self, offsets: np.ndarray) -> np.ndarray:
        """Owning class id of each offset's page (int32; -1 for a free page)."""
        return self.page_owner[self.page_of(offsets)]

    # -- accounting -----------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def bytes_used(self) -> int:
        """Bytes in chunks handed out and not freed."""
        return sum(c.chunks_used * c.chunk_size for c in self.classes)

    def bytes_free(self) -> int:
        """Bytes in free pages plus free (stacked or uncarved) chunks."""
        chunks = sum(c.chunks_free * c.chunk_size for c in self.classes)
        return self.free_pages * self.page_size + chunks

    def bytes_slack(self) -> int:
        """Bytes no chunk can use: page tails past the last chunk, region tail."""
        tails = sum(len(c.pages) * (self.page_size - c.per_page * c.chunk_size)
                    for c in self.classes)
        return tails + self.capacity - self.pages * self.page_size


def _align_for(capacity: int) -> int:
    """Smallest power-of-two alignment >= 64 with capacity / align <= 2**32."""
    align = MIN_ALIGN
    while capacity > align * _OFFSET_UNITS:  # offsets < capacity, so units < 2**32
        align *= 2
    return align
