"""The ledger: what a restarted daemon needs to serve its pool again (warm restart).

The pool's bytes live in a file that outlives the daemon (``Region`` with a
path). The ledger is a second file beside it, mapped shared, holding for
every committed block the row a restarted daemon needs to index it again:

=========  =============================================================
header     4 KiB: magic, format version, the pool's geometry (size, page
           size, alignment) and identity (device and inode of the pool
           file), the record capacity, and (format 3) a random epoch
names      format 2: ``NS_SLOTS`` slots of ``NS_SLOT`` bytes, namespace id ->
           name (u16 length + UTF-8), for ids below 4,096 and names of at
           most 254 bytes; format 3 leaves this area unused
records    one 56-byte row per index entry id: the key (``w0`` and the
           ``rest`` row of ``emsd.pool.index``), chunk offset in ``align``
           units, length, the read-cache flag, ``state`` (1 = committed)
           and the block's checksum (0: none; ``emsd.pool.checksum``)
=========  =============================================================

Format 3 keeps the names in a log beside the ledger (``<ledger>.names``,
``emsd.pool.namelog``) bound to the ledger by the epoch: any id, any name
length. A format-2 ledger (an older emsd's) is upgraded in place when
opened: its names are copied into a new log, then the epoch and the format
are written, so an upgraded daemon keeps the cache it had (a crash midway
leaves a format-2 ledger, upgraded again at the next start). An older emsd
given a format-3 ledger starts empty and says why.

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
from emsd.pool.namelog import NameLog

MAGIC = b"EMSDLEDG"
FORMAT = 3  # 2: rows carry a checksum; 3: names in a log beside the ledger, any id
READS = (2, 3)  # formats this emsd attaches (a format-2 ledger is upgraded when opened)
HEADER = 4096
_HEAD = struct.Struct("<8sIIQQQQQQ")  # magic, format, unused, pool size, page, align, dev, ino, capacity
_FORMAT = struct.Struct("<I")  # at offset 8
_EPOCH = struct.Struct("<Q")  # at offset _HEAD.size (format 3): binds the names log to this ledger
NS_SLOTS = nametable.SLOTS
NS_SLOT = nametable.SLOT
_NAMES = nametable.SIZE
RECORDS = HEADER + _NAMES
ROW = np.dtype([("w0", "<u8"), ("rest", "<u4", (7,)), ("offset", "<u4"), ("length", "<u4"),
                ("cached", "u1"), ("state", "u1"), ("pad", "u1", (2,)), ("sum", "<u8")])
COMMITTED = 1
_MIN_CAPACITY = 1024
_BODY = struct.Struct("<Q7IIIB")  # a row's w0, rest, offset, length and cached, from its start
_SUM = struct.Struct("<Q")
_FIELDS = ROW.fields
assert _FIELDS is not None
_STATE_AT, _SUM_AT = _FIELDS["state"][1], _FIELDS["sum"][1]  # byte offsets in a row
assert _BODY.size == _FIELDS["cached"][1] + 1 == _STATE_AT


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
    def __init__(self, path: Path, fd: int, mm: mmap.mmap, geometry: Geometry, names: NameLog) -> None:
        self.path = path
        self.fd = fd
        self.mm = mm
        self.geometry = geometry
        self.namelog = names
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
        try:
            names, outcome = _names(mm, names_path(path), outcome)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        return cls(path, fd, mm, geometry, names), outcome

    def close(self) -> None:
        self.rows = np.zeros(0, dtype=ROW)  # drop the view so that the map can close
        self.namelog.close()
        if not self.mm.closed:
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- namespaces -----------------------------------------------------------------

    def names(self) -> dict[int, str]:
        """Namespace id -> name, for the ids that have one."""
        return dict(self.namelog.names)

    def add_namespace(self, ns: int, name: str) -> bool:
        """Remember ``name`` for id ``ns`` (the latest name of an id wins); False when it cannot
        be kept (an empty name, or one past ``namelog.MAX_NAME`` bytes). A write torn by a
        crash reads as the id's previous name, or none (``emsd.pool.namelog``)."""
        return bool(name) and self.namelog.add(ns, name)

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

    def record_one(self, i: int, w0: int, rest: list[int], offset: int, length: int, cached: int,
                   digest: int) -> None:
        """``record`` of the single entry ``i``, its fields as ints (``rest``: its seven u32),
        written into the map with ``struct`` in the same order: ``state`` cleared, the body,
        ``state`` set (a row torn by a crash reads as not committed)."""
        self._ensure(i + 1)
        at, mm = RECORDS + i * ROW.itemsize, self.mm
        mm[at + _STATE_AT] = 0
        _BODY.pack_into(mm, at, w0, *rest, offset, length, cached)
        _SUM.pack_into(mm, at + _SUM_AT, digest)
        mm[at + _STATE_AT] = COMMITTED

    def set_cached(self, ids: np.ndarray, cached: np.ndarray) -> None:
        ids = ids[ids < self.rows.size]
        self.rows["cached"][ids] = cached[: ids.size]

    def forget(self, ids: np.ndarray) -> None:
        """The entries ``ids`` are gone: their rows no longer count."""
        if ids.size == 1:  # one block a call
            if int(ids[0]) < self.rows.size:
                self.rows[int(ids[0])]["state"] = 0
            return
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
    if fmt not in READS:
        return f"rebuilt: ledger format {fmt}, this emsd reads formats {READS[0]}-{READS[-1]}"
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
                             geometry.dev, geometry.ino, _MIN_CAPACITY) + _EPOCH.pack(_new_epoch()), 0)


def names_path(path: Path) -> Path:
    """Where the names log of the ledger at ``path`` is."""
    return path.with_name(path.name + ".names")


def _names(mm: mmap.mmap, path: Path, outcome: str) -> tuple[NameLog, str]:
    """The names log of a ledger opened with ``outcome``, and the outcome as it now stands.

    A ledger formatted anew gets an empty log; a format-2 ledger's names move into a new
    log (``_upgrade``); a format-3 ledger whose log is missing or of another epoch is
    "rebuilt" (its blocks have no names: the caller clears them), with an empty log.
    """
    epoch = _EPOCH.unpack_from(mm, _HEAD.size)[0]
    if outcome != "attached":
        return NameLog.open(path, epoch, fresh=True)[0], outcome
    if _FORMAT.unpack_from(mm, 8)[0] == 2:
        return _upgrade(mm, path), outcome
    log, why = NameLog.open(path, epoch)
    return log, outcome if why is None else f"rebuilt: {why}"


def _upgrade(mm: mmap.mmap, path: Path) -> NameLog:
    """Move a format-2 ledger's names into a new log, then make the ledger format 3: the log
    first, then the epoch, then the format (a crash midway leaves a format-2 ledger)."""
    epoch = _new_epoch()
    log, _ = NameLog.open(path, epoch, fresh=True)
    for ns, name in sorted(nametable.read_names(mm, HEADER).items()):
        log.add(ns, name)
    _EPOCH.pack_into(mm, _HEAD.size, epoch)
    _FORMAT.pack_into(mm, 8, FORMAT)
    return log


def _new_epoch() -> int:
    return int.from_bytes(os.urandom(8), "little") | 1  # never 0: a format-2 header's bytes there
