"""The ledger: what a restarted daemon needs to serve its pool again (warm restart).

The pool's bytes live in a file that outlives the daemon (``Region`` with a
path). The ledger is a second file beside it, mapped shared, holding for
every committed block the row a restarted daemon needs to index it again:

=========  =============================================================
header     4 KiB: magic, format version, the pool's geometry (size, page
           size, alignment) and identity (device and inode of the pool
           file), the record capacity
names      ``NS_SLOTS`` slots of ``NS_SLOT`` bytes: namespace id -> name
           (u16 length + UTF-8); longer names are not kept, and their
           blocks are not restored
records    one 56-byte row per index entry id: the key (``w0`` and the
           ``rest`` row of ``emsd.pool.index``), chunk offset in ``align``
           units, length, the read-cache flag, ``state`` (1 = committed)
           and the block's checksum (0: none; ``emsd.pool.checksum``)
=========  =============================================================

Crash consistency without fsync (the files are in tmpfs or hugetlbfs, and
only the daemon process dies, not the host): a row's body is written before
its ``state`` byte and its ``state`` byte is cleared before anything else
when the block goes away, so a daemon killed at any instruction leaves rows
that are either whole and committed or ignored. PENDING blocks are never
recorded: after a crash they are simply gone, and their chunks free.

``Ledger.open`` says how it went: ``"new"`` (no ledger was there),
``"attached"`` (a ledger of this format for this very pool file), or
``"rebuilt: <why>"`` (a ledger of another format, geometry or pool file, or
an unreadable one: it is reset empty, never served).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emsd.files import open_own
from emsd.pool import nametable, rowfile

MAGIC = b"EMSDLEDG"
FORMAT = 2  # 2: rows carry a checksum
HEADER = 4096
_HEAD = struct.Struct("<8sIIQQQQQQ")  # magic, format, unused, pool size, page, align, dev, ino, capacity
NS_SLOTS = nametable.SLOTS
NS_SLOT = nametable.SLOT
_NAMES = nametable.SIZE
RECORDS = HEADER + _NAMES
ROW = np.dtype([("w0", "<u8"), ("rest", "<u4", (7,)), ("offset", "<u4"), ("length", "<u4"),
                ("cached", "u1"), ("state", "u1"), ("pad", "u1", (2,)), ("sum", "<u8")])
COMMITTED = 1
_MIN_CAPACITY = 1024


class LedgerBusy(OSError):
    """Another live daemon has this ledger (and so this pool) open."""


@dataclass(frozen=True)
class Geometry:
    """What a ledger must match to be re-used: the pool's shape and its file."""

    pool_size: int
    page_size: int
    align: int
    dev: int
    ino: int


class Ledger:
    def __init__(self, path: Path, fd: int, mm: mmap.mmap, geometry: Geometry) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.geometry = geometry
        self.rows = self._view()

    # -- opening ------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, geometry: Geometry) -> tuple[Ledger, str]:
        """Open or create the ledger at ``path`` for a pool of ``geometry``; (ledger, outcome)."""
        fd = open_own(path, os.O_RDWR | os.O_CREAT)  # never through a symlink (emsd.files)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one daemon per pool, until it exits
            except BlockingIOError:
                raise LedgerBusy(f"another emsd holds {path}") from None
            size = os.fstat(fd).st_size
            outcome = "new" if size == 0 else _check(fd, size, geometry)
            if outcome != "attached":
                _format(fd, geometry)
                size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, geometry), outcome

    def close(self) -> None:
        self.rows = np.zeros(0, dtype=ROW)  # drop the view so that the map can close
        if not self.mm.closed:
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- namespaces -----------------------------------------------------------------

    def names(self) -> dict[int, str]:
        """Namespace id -> name, for the ids that have one."""
        return nametable.read_names(self.mm, HEADER)

    def add_namespace(self, ns: int, name: str) -> bool:
        """Remember ``name`` for id ``ns``; False when it cannot be kept (id or name too large).
        A write torn by a crash reads as no name (``emsd.pool.nametable``)."""
        raw = name.encode()
        return bool(raw) and nametable.write_name(self.mm, HEADER, ns, raw)

    # -- records ------------------------------------------------------------------------

    def record(self, ids: np.ndarray, w0: np.ndarray, rest: np.ndarray, offset: np.ndarray,
               length: np.ndarray, cached: np.ndarray, sums: np.ndarray | int = 0) -> None:
        """Rows for committed entries ``ids`` (fields given per id): body first, then ``state``."""
        if ids.size == 0:
            return
        self._ensure(int(ids.max()) + 1)
        rows = self.rows
        rows["state"][ids] = 0
        rows["w0"][ids] = w0
        rows["rest"][ids] = rest
        rows["offset"][ids] = offset
        rows["length"][ids] = length
        rows["cached"][ids] = cached
        rows["sum"][ids] = sums
        rows["state"][ids] = COMMITTED

    def set_cached(self, ids: np.ndarray, cached: np.ndarray) -> None:
        ids = ids[ids < self.rows.size]
        self.rows["cached"][ids] = cached[: ids.size]

    def forget(self, ids: np.ndarray) -> None:
        """The entries ``ids`` are gone: their rows no longer count."""
        ids = ids[ids < self.rows.size]
        self.rows["state"][ids] = 0

    def committed(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every committed row."""
        ids = np.flatnonzero(self.rows["state"] == COMMITTED)
        return ids, self.rows[ids]

    def clear(self) -> None:
        """Forget every row (the names stay)."""
        self.rows["state"][:] = 0

    def _ensure(self, capacity: int) -> None:
        if capacity <= self.rows.size:
            return
        new = max(capacity, 2 * self.rows.size)
        self.rows = np.zeros(0, dtype=ROW)  # no view may be alive across the resize
        rowfile.grow(self.fd, self.mm, ROW, RECORDS, _HEAD.size - 8, new)
        self.rows = self._view()

    def _view(self) -> np.ndarray:
        return rowfile.view(self.mm, ROW, RECORDS, _HEAD.size - 8)


def _check(fd: int, size: int, geometry: Geometry) -> str:
    """"attached" when the file is a whole ledger of this format for ``geometry``, else why not."""
    if size < RECORDS:
        return "rebuilt: the ledger file is truncated"
    head = os.pread(fd, _HEAD.size, 0)
    magic, fmt, _, pool, page, align, dev, ino, capacity = _HEAD.unpack(head)
    if magic != MAGIC:
        return "rebuilt: not an emsd ledger"
    if fmt != FORMAT:
        return f"rebuilt: ledger format {fmt}, this emsd writes format {FORMAT}"
    if (pool, page, align) != (geometry.pool_size, geometry.page_size, geometry.align):
        return (f"rebuilt: the pool's geometry changed (size {pool} -> {geometry.pool_size}, "
                f"page {page} -> {geometry.page_size})")
    if (dev, ino) != (geometry.dev, geometry.ino):
        return "rebuilt: the ledger belongs to another pool file"
    if size != RECORDS + capacity * ROW.itemsize:
        return "rebuilt: the ledger's size does not match its header"
    return "attached"


def _format(fd: int, geometry: Geometry) -> None:
    os.ftruncate(fd, 0)
    os.ftruncate(fd, RECORDS + _MIN_CAPACITY * ROW.itemsize)
    os.pwrite(fd, _HEAD.pack(MAGIC, FORMAT, 0, geometry.pool_size, geometry.page_size, geometry.align,
                             geometry.dev, geometry.ino, _MIN_CAPACITY), 0)
