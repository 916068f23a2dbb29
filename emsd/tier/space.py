"""Where blocks live in the disk tier's data file: extents carved into slots of one size.

The data file is cut into extents (``extent`` bytes, 64 MiB by default). A
size class is one exact slot size: a block's length rounded up to ``SECTOR``
(4 KiB, the unit O_DIRECT needs), so every slot starts and ends on a sector
boundary. A class takes a whole extent when it has no free slot and carves
it into ``extent // slot`` slots; when the last used slot of an extent is
freed, the extent goes back to the free extents for any class to take (KV
blocks come in one or two sizes per model, so an extent rarely holds a few
stragglers for long). A class hands out its lowest free slot first, so that
blocks demoted one after another (the blocks of a prefix, evicted in order)
lie one after another in the file and are read back in one I/O a run.

This module only counts: it never touches the file and never chooses a
victim (``emsd.tier.disk`` evicts when ``alloc`` says there is no room).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TypeVar

import numpy as np

SECTOR = 4096
DEFAULT_EXTENT = 64 << 20


class SpaceError(ValueError):
    """A geometry that cannot work, or a restored slot that does not fit the layout."""


_Length = TypeVar("_Length", int, np.ndarray)


def slot_for(length: _Length) -> _Length:
    """The slot size that holds ``length`` bytes: rounded up to ``SECTOR`` (of each, for an
    array of lengths)."""
    return -(-length // SECTOR) * SECTOR


class FreeSlots:
    """The free slot offsets of one class: a set, and a heap for the lowest first.

    The heap may hold offsets no longer free (taken by ``discard``); ``pop``
    skips them, and the heap is rebuilt when they outnumber the free ones.
    ``update(..., heap=False)`` (a restart's re-index, a whole extent at a time)
    adds to the set only and leaves the heap stale: the next ``pop`` sorts the
    set once, instead of every extent being heapified and every claim weighed.
    """

    def __init__(self) -> None:
        self._set: set[int] = set()
        self._heap: list[int] = []
        self._stale = False  # the heap lacks offsets of the set: rebuild before a pop

    def __bool__(self) -> bool:
        return bool(self._set)

    def __contains__(self, offset: int) -> bool:
        return offset in self._set

    def update(self, offsets: Iterable[int], heap: bool = True) -> None:
        new = set(offsets) - self._set
        self._set |= new
        if not heap or self._stale:
            self._stale = True
        elif len(new) > len(self._heap):  # a whole extent's slots: one heapify, not a push each
            self._heap.extend(new)
            heapq.heapify(self._heap)
        else:
            for offset in new:
                heapq.heappush(self._heap, offset)

    def discard(self, offset: int) -> None:
        self._set.discard(offset)
        if not self._stale and len(self._heap) > 2 * len(self._set) + 1024:
            self._heap = sorted(self._set)

    def difference_update(self, offsets: Iterable[int]) -> None:
        for offset in offsets:
            self.discard(offset)

    def pop(self) -> int:
        """The lowest free offset, taken. ``IndexError`` when there is none."""
        if self._stale:
            self._heap, self._stale = sorted(self._set), False  # a sorted list is a heap
        while True:
            offset = heapq.heappop(self._heap)
            if offset in self._set:
                self._set.remove(offset)
                return offset


class DiskSpace:
    """Slot allocation over ``size`` bytes of file, in extents of ``extent`` bytes.

    Raises ``SpaceError`` when ``extent`` is not a positive multiple of
    ``SECTOR`` or the file holds no whole extent.
    """

    def __init__(self, size: int, extent: int = DEFAULT_EXTENT) -> None:
        if extent <= 0 or extent % SECTOR:
            raise SpaceError(f"extent {extent} must be a positive multiple of {SECTOR}")
        if size < extent:
            raise SpaceError(f"disk tier size {size} holds no extent of {extent} bytes")
        self.extent = extent
        self.extents = size // extent
        self.size = self.extents * extent
        self._free_extents = list(range(self.extents - 1, -1, -1))  # a stack: low extents first
        self.extent_slot = [0] * self.extents  # slot size of each extent's class, 0 free
        self.extent_used = [0] * self.extents  # used slots on each extent
        self._free: dict[int, FreeSlots] = {}  # slot size -> byte offsets of its free slots
        self.bytes_used = 0  # bytes of used slots

    @property
    def max_block(self) -> int:
        """The largest block a slot can hold: one extent."""
        return self.extent

    def extent_of(self, offset: int) -> int:
        return offset // self.extent

    def alloc(self, length: int) -> int | None:
        """A free slot for ``length`` bytes (1..``max_block``): its byte offset, or None if full."""
        if not 0 < length <= self.extent:
            return None
        slot = slot_for(length)
        free = self._free.setdefault(slot, FreeSlots())
        if not free:
            if not self._free_extents:
                return None
            e = self._free_extents.pop()
            self.extent_slot[e] = slot
            base = e * self.extent
            free.update(range(base, base + (self.extent // slot) * slot, slot))
        offset = free.pop()
        self._take(offset, slot)
        return offset

    def free(self, offset: int, length: int) -> None:
        """Give back the slot at ``offset`` that holds ``length`` bytes (used, once)."""
        slot = slot_for(length)
        e = self.extent_of(offset)
        if self.extent_slot[e] != slot or self.extent_used[e] <= 0:
            raise SpaceError(f"slot {offset} of {slot} bytes is not in use")
        self.extent_used[e] -= 1
        self.bytes_used -= slot
        free = self._free[slot]
        free.update((offset,))
        if self.extent_used[e] == 0:  # the whole extent is free again: any class may take it
            base = e * self.extent
            free.difference_update(range(base, base + (self.extent // slot) * slot, slot))
            self.extent_slot[e] = 0
            self._free_extents.append(e)

    def restore(self, offset: int, length: int) -> bool:
        """Claim the slot at ``offset`` for ``length`` bytes (re-indexing at start).

        False (nothing claimed) when it does not fit the layout: outside the
        file, not on a slot boundary of its class, on an extent of another
        class, or already claimed.
        """
        slot = slot_for(length)
        if not 0 < length <= self.extent or offset < 0 or offset + slot > self.size:
            return False
        e = self.extent_of(offset)
        base = e * self.extent
        if (offset - base) % slot or offset + slot > base + (self.extent // slot) * slot:
            return False
        if self.extent_slot[e] == 0:
            self._free_extents.remove(e)
            self.extent_slot[e] = slot
            self._free.setdefault(slot, FreeSlots()).update(
                range(base, base + (self.extent // slot) * slot, slot), heap=False)
        elif self.extent_slot[e] != slot:
            return False
        free = self._free[slot]
        if offset not in free:
            return False
        free.discard(offset)
        self._take(offset, slot)
        return True

    def restore_many(self, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``restore`` of each (offset, length) in turn: per row, whether its slot was claimed.

        On a space where nothing is claimed yet (a restart) it runs as whole arrays: each
        extent takes the size class of its first row that fits the geometry, and each slot
        goes to its first row of that class. Else it is the loop of ``restore``.
        """
        off = np.asarray(offsets, dtype=np.int64)
        n = np.asarray(lengths, dtype=np.int64)
        ok = np.zeros(off.size, dtype=bool)
        if self.bytes_used:
            for j, (o, k) in enumerate(zip(off.tolist(), n.tolist(), strict=True)):
                ok[j] = self.restore(o, k)
            return ok
        slot = slot_for(n)
        fit = (n > 0) & (n <= self.extent) & (off >= 0) & (off + slot <= self.size)
        slot_safe = np.where(fit, slot, SECTOR)  # no division by a slot of 0
        e = np.where(fit, off, 0) // self.extent
        base = e * self.extent
        carved_end = base + self.extent // slot_safe * slot_safe  # past the extent's last slot
        fit &= ((off - base) % slot_safe == 0) & (off + slot_safe <= carved_end)
        rows = np.flatnonzero(fit)
        ext, first = np.unique(e[rows], return_index=True)
        cls = np.zeros(self.extents, dtype=np.int64)
        cls[ext] = slot[rows[first]]
        rows = rows[slot[rows] == cls[e[rows]]]  # of its extent's class
        rows = rows[np.unique(off[rows], return_index=True)[1]]  # a slot's first row
        ok[rows] = True
        used = np.bincount(e[rows], minlength=self.extents)
        for x, s in zip(ext.tolist(), cls[ext].tolist(), strict=True):
            self.extent_slot[x] = s
            self.extent_used[x] = int(used[x])
        self.bytes_used = int(slot[rows].sum())
        carved = set(ext.tolist())
        self._free_extents = [x for x in self._free_extents if x not in carved]
        for s in np.unique(cls[ext]).tolist():  # each class's free slots: its extents' others
            mine = ext[cls[ext] == s]
            taken = off[rows[slot[rows] == s]]
            per = self.extent // s
            step = max(1, (1 << 22) // per)  # extents at a time: temporaries of 32 MiB at most
            free = self._free.setdefault(s, FreeSlots())
            for lo in range(0, mine.size, step):
                part = mine[lo : lo + step]
                every = (part[:, None] * self.extent + np.arange(per, dtype=np.int64) * s).ravel()
                free.update(np.setdiff1d(every, taken, assume_unique=True).tolist(), heap=False)
        return ok

    def _take(self, offset: int, slot: int) -> None:
        self.extent_used[self.extent_of(offset)] += 1
        self.bytes_used += slot

    def slots_on(self, e: int) -> range:
        """Byte offsets of every slot of extent ``e`` (empty for a free extent)."""
        slot = self.extent_slot[e]
        if slot == 0:
            return range(0)
        base = e * self.extent
        return range(base, base + (self.extent // slot) * slot, slot)

    def has_room(self, length: int) -> bool:
        """Whether ``alloc(length)`` would find a slot without an eviction."""
        return bool(self._free.get(slot_for(length))) or bool(self._free_extents)
