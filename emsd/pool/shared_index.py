"""The shared index: where the pool's readable blocks are, for SDK clients to read themselves.

A load of a block that is in the pool and an ``exists`` of keys that are all
there need no round trip to the daemon when the client can look the keys up
itself. The daemon publishes every READY block (key, namespace, byte offset,
length) in a table in a memfd of its own, which it alone writes; a client of
the pool maps it read-only (``F_SEAL_FUTURE_WRITE``: no writable mapping of it
can be made after the daemon's own) and looks keys up there
(``emsd.pool._shared_index``, C).

The table is a hint, never the truth: a key not found in it is asked of the
daemon as before (a key whose probe window was full is not published; blocks
on the disk tier, on other nodes or PENDING are not there). A key found in it
is as good as a PIN, by optimistic concurrency, as one-sided RDMA key-value
stores read: every slot is a sequence lock, and the daemon retracts a block's
slot (its seq moves on) before the block's chunk can be reused (eviction,
drop, page stealing). A client copies the block out of the pool, then checks
that every slot it used still has the seq it saw (``check``); if one moved,
what it copied may be another block's bytes and it asks the daemon instead.
A client also checks that its connection is still up after the copy: a
daemon that died (and a new one that may reuse the kept pool) never updated
this table again, but its death closed the connection first.

What it costs the daemon: one C call per commit and per eviction, the table
(64 bytes a slot; ``slots_for``: two slots per 32 KiB of pool, at most
2**24). What a client does not do: pin (the daemon may evict a block a client
is reading: the check catches it), refresh the LRU (the SDK sends the keys it
loaded, without waiting, as ``TOUCH``), or count in the daemon's metrics
(``TOUCH`` counts the hits).

The table's pages are allocated in the background from the start
(``emsd.pool.prefault``, one thread; ``filled`` says when it is done): a page
of a new memfd is otherwise allocated at its first write, and a publish into
a page no publish had touched took a page fault (about 3 us here: 32 blocks
took 75-120 us to publish in a new table of 64-256 MiB, 8-9 us in a filled
one), which in a large pool's table goes on for millions of commits.

What a client can see: the keys, namespace ids, offsets and lengths of every
published block. So the table is offered only where every client maps the
whole pool anyway, that is without tenants (with tenants a client maps only
its tenant's blocks: ``emsd.pool.tenancy``; a table per tenant is not built),
and not with ``pool.checksum`` (a load through the daemon checks digests;
this path would not).

Namespaces retired by a drop are retracted whole and not published again
(``hide``) until their id is freed (``show``); keys saved by connections
that name such an id go to the name's new id, which the client learns by
asking the daemon when it finds nothing.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import NamedTuple

import numpy as np

from emsd.pool import prefault
from emsd.pool.index import BlockIndex
from emsd.pool.keys import KeyBatch

try:
    from emsd.pool import _shared_index as _c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - extension not built: no table is offered
    _c = None

MAGIC = 0x3130584449534D45  # "EMSIDX01"
HEADER = 64
SLOT = 64
WINDOW = 8
MIN_BITS, MAX_BITS = 12, 24
F_SEAL_FUTURE_WRITE = 0x10
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | F_SEAL_FUTURE_WRITE
_SLOT = np.dtype([("seq", "<u8"), ("w", "<u8", (4,)), ("tag", "<u4"), ("length", "<u4"),
                  ("offset", "<u8"), ("unused", "<u8")])
assert _SLOT.itemsize == SLOT


def available() -> bool:
    """Whether the C table is built (without it no table is offered; the SDK asks the daemon)."""
    return _c is not None


def slots_for(pool_size: int) -> int:
    """log2 of the home slots for a pool: two slots per 32 KiB, within 2**12..2**24."""
    want = max(1, 2 * (pool_size >> 15))
    return min(MAX_BITS, max(MIN_BITS, (want - 1).bit_length()))


def table_bytes(bits: int) -> int:
    return HEADER + ((1 << bits) + WINDOW) * SLOT


class SharedIndex:
    """The daemon's side: a sealed memfd holding the table, written only here.

    ``fd`` is handed to clients (``HELLO``); ``size`` is its length. ``publish`` and
    ``retract`` take entries of a ``BlockIndex`` by id. ``unpublished`` counts the
    blocks that found no free slot in their window (they are served by the daemon only).
    """

    def __init__(self, bits: int) -> None:
        if _c is None:
            raise RuntimeError("emsd.pool._shared_index is not built")
        self.size = table_bytes(bits)
        self.fd = os.memfd_create("emsd-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            os.close(self.fd)
            raise
        self.table = np.frombuffer(self._map, dtype=np.uint8)
        head = self.table[:HEADER].view(np.uint32)
        head[:2] = (MAGIC & 0xFFFFFFFF, MAGIC >> 32)
        head[2:4] = (bits, WINDOW)
        self.slots = self.table[HEADER:].view(_SLOT)  # a new file reads 0: every slot free
        self.unpublished = 0
        self._hidden: set[int] = set()
        self._filler = self._fill()

    def _fill(self) -> prefault.Prefaulter | None:
        """Allocate every page of the table in the background (None where the kernel cannot)."""
        if not prefault.supported(self._map):
            return None
        return prefault.Prefaulter(self.table.ctypes.data, self.size, threads=1,
                                   name="the shared index").start()

    def filled(self) -> bool:
        """Whether the table's background allocation has ended (or there is none to wait for)."""
        return self._filler is None or self._filler.progress().finished

    def publish(self, index: BlockIndex, ids: np.ndarray, unit: int) -> None:
        """Publish entries ``ids`` (READY now) of ``index``; ``unit``: bytes per offset unit."""
        if ids.size == 0:
            return
        if self._hidden:
            ids = ids[~np.isin(index.nstag[ids] >> 8, list(self._hidden))]
        done = _c.publish(self.table, index.w0, index.rest, np.ascontiguousarray(ids, dtype=np.uint32),
                          index.offset, index.length, unit)
        self.unpublished += int(ids.size) - done

    def retract(self, index: BlockIndex, ids: np.ndarray) -> None:
        """Retract entries ``ids`` of ``index`` (before their chunks may be reused)."""
        if ids.size:
            _c.retract(self.table, index.w0, index.rest, np.ascontiguousarray(ids, dtype=np.uint32))

    def hide(self, ns: int) -> None:
        """Namespace ``ns`` is retired: retract all of it, publish none of it from now on."""
        self._hidden.add(ns)
        _c.retract_ns(self.table, ns)

    def show(self, ns: int) -> None:
        """Namespace id ``ns`` is free (no entry): it may be published again when reused."""
        self._hidden.discard(ns)

    def published(self) -> int:
        """Slots in use (a scan: for tests and stats, not the request path)."""
        return int(np.count_nonzero(self.slots["tag"]))

    def close(self) -> None:
        if self._filler is not None:  # before the table is unmapped
            self._filler.stop()
        self.slots = self.table = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is alive somewhere; the GC unmaps it later
            pass
        os.close(self.fd)


class Found(NamedTuple):
    """The blocks ``find`` found: byte offsets and lengths, and the slots and seqs to ``check``."""

    offsets: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    slots: np.ndarray  # uint32
    seqs: np.ndarray  # uint64


class SharedIndexReader:
    """A client's side: the table mapped read-only from the fd ``HELLO`` passed."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        head = np.frombuffer(self._map[:16], dtype=np.uint32)  # a copy: nothing holds the map
        bits = int(head[2])
        if int(head[0]) | int(head[1]) << 32 != MAGIC or not MIN_BITS <= bits <= MAX_BITS \
                or size < table_bytes(bits):
            self._map.close()
            raise ValueError("not a shared index table")
        self._buf = memoryview(self._map)

    def find(self, ns: int, keys: KeyBatch, limit: int) -> Found:
        """The leading keys of ``keys`` (namespace id ``ns``) published, each block within
        ``limit`` bytes of the pool. Thread-safe: the table is only read."""
        n = len(keys)
        found = Found(np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64),
                      np.empty(n, dtype=np.uint32), np.empty(n, dtype=np.uint64))
        nstag = keys.tags.astype(np.uint32) | np.uint32(ns << 8)
        count = _c.find(self._buf, np.ascontiguousarray(keys.words), nstag, limit, *found)
        return found if count == n else Found(*(a[:count] for a in found))

    def check(self, slots: np.ndarray, seqs: np.ndarray) -> bool:
        """Whether every slot ``find`` gave still holds what it held then (call after the copy)."""
        return bool(_c.check(self._buf, slots, seqs))

    def find_one(self, ns: int, keys: KeyBatch, limit: int) -> tuple[int, int, int, int] | None:
        """``find`` of a batch of one key, in scalars: (offset, length, slot, seq) when it is
        published, else None."""
        w = keys.words[0]
        return _c.find_one(self._buf, int(w[0]), int(w[1]), int(w[2]), int(w[3]),
                           int(keys.tags[0]) | ns << 8, limit)

    def check_one(self, slot: int, seq: int) -> bool:
        """``check`` of the one slot ``find_one`` gave."""
        return bool(_c.check_one(self._buf, slot, seq))

    def close(self) -> None:
        self._buf.release()
        try:
            self._map.close()
        except BufferError:
            pass
