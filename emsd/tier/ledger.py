"""The disk tier's persistent index: which block is in which slot of the data file.

A file beside the data file (``emsd-disk.index``), mapped shared, so that a
daemon started after a crash or a reboot serves the blocks on disk again:

=========  =============================================================
header     4 KiB: magic, format, the data file's size and extent size,
           the row capacity
names      ``emsd.pool.nametable``: 4,096 slots of 256 bytes, the tier's
           namespace id -> name (u16 length + UTF-8). The pool's namespace ids do not
           survive a reboot (its ledger is in shared memory), so the tier
           keeps names of its own.
rows       one 64-byte row per row id: the key (four u64 words and the
           tag of ``emsd.pool.keys``), the namespace id, the slot's byte
           offset, the block's length, its xxh3-64 digest and ``state``
           (1 = the slot holds these bytes)
=========  =============================================================

Order of writes, so that a crash or power loss at any point never serves
wrong bytes: a row's ``state`` is set only after the block's bytes are on
disk (the O_DIRECT write returned), and cleared before its slot is given to
another block. The map is flushed (its file's fdatasync) by the tier's flusher
thread on a timer, outside the tier's lock (a slow flush stalls no load),
and at a clean shutdown; rows lost with the page cache are blocks lost, not
wrong ones. What the order cannot rule out (a row that reached the disk
while a slot's new bytes did, in another order than written) the digest
catches: ``emsd.tier.disk`` checks every block read against it, and a
mismatch is a miss.

``DiskLedger.open`` says how it went: ``"new"``, ``"attached"``, or
``"rebuilt: <why>"`` (another format or geometry: reset empty, never served).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from emsd.faults import FAULTS, io_fault
from emsd.files import open_own
from emsd.pool import nametable, rowfile
from emsd.pool.keys import KeyBatch

MAGIC = b"EMSDDISK"
FORMAT = 1
HEADER = 4096
_HEAD = struct.Struct("<8sIIQQQ")  # magic, format, unused, data size, extent, capacity
NS_SLOTS = nametable.SLOTS
RECORDS = HEADER + nametable.SIZE
ROW = np.dtype([("words", "<u8", (4,)), ("tag", "u1"), ("state", "u1"), ("ns", "<u2"),
                ("length", "<u4"), ("offset", "<u8"), ("sum", "<u8"), ("pad", "u1", (8,))])
COMMITTED = 1
_MIN_CAPACITY = 1024


class LedgerBusy(OSError):
    """Another live daemon has this disk tier open."""


class DiskLedger:
    """Rows of the blocks on disk, in a shared map of ``path``."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.rows = self._view()
        self.dirty = False  # rows changed since the last flush
        self._fd_lock = threading.Lock()  # a flush's, and the close's: no fd closed under a flush

    @classmethod
    def open(cls, path: Path, data_size: int, extent: int) -> tuple[DiskLedger, str]:
        """Open or create the ledger at ``path`` for a data file of this geometry.

        Returns (ledger, outcome). Raises ``LedgerBusy`` if another process holds
        it, ``OSError`` if it cannot be made.
        """
        fd = open_own(path, os.O_RDWR | os.O_CREAT)  # never through a symlink (emsd.files)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LedgerBusy(f"another emsd holds {path}") from None
            size = os.fstat(fd).st_size
            outcome = "new" if size == 0 else _check(fd, size, data_size, extent)
            if outcome != "attached":
                _format(fd, data_size, extent)
                size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm), outcome

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self.fd < 0:
            return
        self.flush()
        with self._fd_lock:
            self.rows = np.zeros(0, dtype=ROW)
            self.mm.close()
            os.close(self.fd)
            self.fd = -1

    def flush(self) -> None:
        """Write the changed rows to the disk. Needs no lock of the caller's: it may run in one
        thread while another records and forgets rows, or grows the map (a row changed during
        it is written by the next flush). ``fdatasync`` of the file is the writeback that
        ``msync(MS_SYNC)`` of a shared map does on Linux (mm/msync.c: ``vfs_fsync_range``),
        without touching the map, which a resize may move meanwhile."""
        with self._fd_lock:
            if self.fd >= 0 and self.dirty:
                self.dirty = False
                if FAULTS is not None:
                    io_fault("disk.flush")
                os.fdatasync(self.fd)

    # -- namespaces -------------------------------------------------------------------

    def names(self) -> dict[int, str]:
        """The tier's namespace id -> name, for the ids that have one."""
        return nametable.read_names(self.mm, HEADER)

    def set_name(self, ns: int, name: str) -> bool:
        """Name the tier's namespace id ``ns`` (empty: unused); False if it cannot be kept."""
        if not nametable.write_name(self.mm, HEADER, ns, name.encode()):
            return False
        self.dirty = True
        return True

    # -- rows ---------------------------------------------------------------------------

    def record(self, row: int, words: np.ndarray, tag: int, ns: int, offset: int, length: int,
               digest: int) -> None:
        """Row ``row`` now says: the slot at ``offset`` holds this block (its bytes are on disk)."""
        self._ensure(row + 1)
        r = self.rows
        r["state"][row] = 0
        r["words"][row] = words
        r["tag"][row] = tag
        r["ns"][row] = ns
        r["offset"][row] = offset
        r["length"][row] = length
        r["sum"][row] = digest
        r["state"][row] = COMMITTED  # last: a torn row reads as absent
        self.dirty = True

    def forget(self, row: int) -> None:
        """Row ``row`` no longer counts (before its slot is written again)."""
        if row < self.rows.size:
            self.rows["state"][row] = 0
            self.dirty = True

    def committed(self) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, rows) of every committed row."""
        ids = np.flatnonzero(self.rows["state"] == COMMITTED)
        return ids, self.rows[ids]

    def committed_keys(self) -> tuple[np.ndarray, KeyBatch]:
        """(namespace ids, keys) of every committed row, read column by column: no copy of the
        rows' other fields."""
        ids = np.flatnonzero(self.rows["state"] == COMMITTED)
        words = self.rows["words"][ids].astype(np.uint64, copy=False)
        return self.rows["ns"][ids], KeyBatch(words, self.rows["tag"][ids])

    def _ensure(self, capacity: int) -> None:
        if capacity <= self.rows.size:
            return
        new = max(capacity, 2 * self.rows.size)
        self.rows = np.zeros(0, dtype=ROW)  # no view may be alive across the resize
        rowfile.grow(self.fd, self.mm, ROW, RECORDS, _HEAD.size - 8, new)
        self.rows = self._view()

    def _view(self) -> np.ndarray:
        return rowfile.view(self.mm, ROW, RECORDS, _HEAD.size - 8)


def _check(fd: int, size: int, data_size: int, extent: int) -> str:
    """"attached" when the file is a whole ledger of this format and geometry, else why not."""
    if size < RECORDS:
        return "rebuilt: the index file is truncated"
    magic, fmt, _, dsize, ext, capacity = _HEAD.unpack(os.pread(fd, _HEAD.size, 0))
    if magic != MAGIC:
        return "rebuilt: not an emsd disk index"
    if fmt != FORMAT:
        return f"rebuilt: index format {fmt}, this emsd writes format {FORMAT}"
    if (dsize, ext) != (data_size, extent):
        return f"rebuilt: the tier's geometry changed (size {dsize} -> {data_size}, extent {ext} -> {extent})"
    if size != RECORDS + capacity * ROW.itemsize:
        return "rebuilt: the index's size does not match its header"
    return "attached"


def _format(fd: int, data_size: int, extent: int) -> None:
    os.ftruncate(fd, 0)
    os.ftruncate(fd, RECORDS + _MIN_CAPACITY * ROW.itemsize)
    os.pwrite(fd, _HEAD.pack(MAGIC, FORMAT, 0, data_size, extent, _MIN_CAPACITY), 0)
