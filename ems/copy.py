"""Batched raw-memory copies: the one primitive under the SDK's data path.

``copy_segments(dst, src, lengths)`` performs ``memcpy(dst[i], src[i],
lengths[i])`` for every i, where the three arrays hold raw process addresses
and byte counts. ``ems.layout`` turns a save or load into one such batch, so
a whole request costs one call however many blocks, layers and tensors it
spans.

Two implementations, chosen once at import:

- ``"c"``: the ``ems._memcopy`` extension. It validates, then releases the GIL
  and copies in a C loop with streaming (non-temporal) stores; big batches are
  split over a few threads.
- ``"ctypes"``: a Python loop over ``ctypes.memmove``, used when the extension
  is not built (e.g. a source checkout without a compiler). Same results,
  roughly a microsecond per segment slower, and it holds the GIL.

``COPY_IMPL`` says which one is in use; the choice is also logged once.

Contract for callers: every range must lie in memory the process owns and
keeps alive for the duration of the call, and destination ranges must not
overlap. Nothing here can check that; ``ems.layout`` does, from the
registered tensors and the pool's bounds.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Any, Final

import numpy as np

log = logging.getLogger(__name__)

_memcopy: Any
try:
    _memcopy = importlib.import_module("ems._memcopy")
except ImportError:  # the extension is optional: fall back to ctypes
    _memcopy = None

COPY_IMPL: Final[str] = "c" if _memcopy is not None else "ctypes"
log.debug("ems.copy: using the %s implementation of copy_segments", COPY_IMPL)

_ADDRESS_DTYPES = (np.dtype(np.uint64), np.dtype(np.int64))


def as_address_array(values: np.ndarray, name: str) -> np.ndarray:
    """Return ``values`` as a 1-D C-contiguous uint64/int64 array (no copy when already one).

    Raises TypeError for a non-integer array and ValueError for a wrong rank.
    """
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-dimensional, got shape {arr.shape}")
    if arr.dtype in _ADDRESS_DTYPES and arr.flags.c_contiguous:
        return arr
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    signed = arr.size == 0 or np.issubdtype(arr.dtype, np.signedinteger)
    return np.ascontiguousarray(arr, dtype=np.int64 if signed else np.uint64)


def _checked(
    dst: np.ndarray, src: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = as_address_array(dst, "dst")
    s = as_address_array(src, "src")
    n = as_address_array(lengths, "lengths")
    if not len(d) == len(s) == len(n):
        raise ValueError(f"dst, src and lengths must have equal length, got {len(d)}, {len(s)} and {len(n)}")
    return d, s, n


def copy_segments_ctypes(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """The pure-Python implementation (always available; used for tests and as a fallback)."""
    d, s, n = _checked(dst, src, lengths)
    if n.dtype.kind == "i" and n.size and int(n.min()) < 0:
        i = int(np.argmax(n < 0))
        raise ValueError(f"lengths[{i}] is negative: {int(n[i])}")
    nonempty = n != 0
    if np.any(nonempty & ((d == 0) | (s == 0))):
        i = int(np.argmax(nonempty & ((d == 0) | (s == 0))))
        raise ValueError(f"segment {i} has a null address")
    memmove = ctypes.memmove
    for a, b, c in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
        if c:
            memmove(a, b, c)


def copy_segments_c(
    dst: np.ndarray,
    src: np.ndarray,
    lengths: np.ndarray,
    threads: int = 0,
    nontemporal: int = -1,
) -> None:
    """The C implementation with its knobs (for tests and benchmarks).

    ``threads=0`` and ``nontemporal=-1`` let it choose (see ``ems/_memcopy.c``).
    Raises RuntimeError if the extension is not built.
    """
    if _memcopy is None:
        raise RuntimeError("the ems._memcopy extension is not built")
    d, s, n = _checked(dst, src, lengths)
    _memcopy.copy_segments(d, s, n, threads=threads, nontemporal=nontemporal)


def copy_segments(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """For every i: copy ``lengths[i]`` bytes from address ``src[i]`` to address ``dst[i]``.

    The arrays are 1-D integer arrays of equal length (uint64 or int64 are
    passed through without a copy). Raises TypeError/ValueError on malformed
    arguments, before any byte moves.
    """
    if _memcopy is not None:
        d, s, n = _checked(dst, src, lengths)
        _memcopy.copy_segments(d, s, n)
    else:
        copy_segments_ctypes(dst, src, lengths)
