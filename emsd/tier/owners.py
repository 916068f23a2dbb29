"""SlotOwners: which index entry holds each slot of the disk tier's data file.

Per extent in use, one int32 array of its slots (``extent // slot`` of them,
4 bytes a slot), made when the first of its slots is given an owner: what a
dict from byte offset to entry costs about 80 bytes a slot for. The disk
tier asks it for the owners of an extent's slots when it frees a whole
extent for a block of another size class (``emsd.tier.disk``). An extent
whose class changes (freed, then carved again for another slot size) gets a
new array. Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

import numpy as np

NONE = -1  # a slot nobody holds


class SlotOwners:
    """Slot byte offset -> the entry id holding it, over extents of ``extent`` bytes."""

    def __init__(self, extent: int) -> None:
        self.extent = extent
        self._by_extent: dict[int, tuple[int, np.ndarray]] = {}  # extent -> (slot size, owners)

    def _slots(self, e: int, slot: int) -> np.ndarray:
        got = self._by_extent.get(e)
        if got is None or got[0] != slot:
            got = self._by_extent[e] = (slot, np.full(self.extent // slot, NONE, dtype=np.int32))
        return got[1]

    def set(self, offset: int, slot: int, owner: int) -> None:
        """The slot of ``slot`` bytes at ``offset`` is held by entry ``owner``."""
        e, at = divmod(offset, self.extent)
        self._slots(e, slot)[at // slot] = owner

    def set_many(self, offsets: np.ndarray, slots: np.ndarray, owners: np.ndarray) -> None:
        """``set`` of each (offset, slot size, owner), in a step per extent."""
        offsets = np.asarray(offsets, dtype=np.int64)
        extents = offsets // self.extent
        for e in np.unique(extents).tolist():
            sel = np.flatnonzero(extents == e)
            slot = int(slots[sel[0]])
            self._slots(e, slot)[(offsets[sel] - e * self.extent) // slot] = owners[sel]

    def clear(self, offset: int, slot: int, owner: int) -> None:
        """The slot at ``offset`` is no longer held by ``owner`` (nothing if another holds it)."""
        e, at = divmod(offset, self.extent)
        got = self._by_extent.get(e)
        if got is not None and got[0] == slot and got[1][at // slot] == owner:
            got[1][at // slot] = NONE

    def on_extent(self, e: int, slot: int) -> list[int]:
        """The entries holding slots of extent ``e`` (carved in slots of ``slot`` bytes)."""
        got = self._by_extent.get(e)
        if got is None or got[0] != slot:
            return []
        return got[1][got[1] != NONE].tolist()

    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self._by_extent.values())
