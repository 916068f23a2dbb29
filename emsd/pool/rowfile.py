"""Rows of a numpy dtype after a fixed prefix in a mapped file, their capacity kept in the file's
header: the mechanics the pool's ledger and the disk tier's index share."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

_CAPACITY = struct.Struct("<Q")


def view(mm: mmap.mmap, dtype: np.dtype, offset: int, capacity_at: int) -> np.ndarray:
    """The rows from ``offset``, as many as the u64 at ``capacity_at`` says (a view of ``mm``)."""
    (capacity,) = _CAPACITY.unpack_from(mm, capacity_at)
    return np.frombuffer(mm, dtype=dtype, count=capacity, offset=offset)


def grow(fd: int, mm: mmap.mmap, dtype: np.dtype, offset: int, capacity_at: int, capacity: int) -> None:
    """Size the file and its map for ``capacity`` rows and record it. No view of ``mm`` may be
    alive (the caller drops its own first): a resize under one fails."""
    size = offset + capacity * dtype.itemsize
    os.ftruncate(fd, size)
    mm.resize(size)
    _CAPACITY.pack_into(mm, capacity_at, capacity)
