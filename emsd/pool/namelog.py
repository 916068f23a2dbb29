"""Namespace names of the pool's ledger (format 3): an append-only log beside it.

The ledger's first formats kept names in a fixed table of 4,096 slots of
256 bytes (``emsd.pool.nametable``), so namespace ids past 4,095 and longer
names did not survive a restart. The log holds any id and any name up to
``MAX_NAME`` bytes::

    header   magic b"EMSDNLOG", u64 epoch (the ledger's: a log written for
             another incarnation of the ledger is not read)
    records  u32 id, u32 length, u32 CRC-32 of (id, length, name), name bytes

The last record of an id wins (a freed id named again, a dropped namespace
renamed ``RETIRED``). Crash consistency without fsync (tmpfs; only the
process dies): a record is appended with one ``write``; a record that is cut
short or fails its CRC ends the log, and ``open`` cuts it off, so later
appends follow a whole prefix. ``open`` rewrites the log with one record per
id (a new file renamed over the old) when it holds more than twice as many
records as ids, so it stays within a small multiple of its names.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

from emsd.files import open_own

MAGIC = b"EMSDNLOG"
_HEAD = struct.Struct("<8sQ")
_REC = struct.Struct("<III")
MAX_NAME = 65536  # bytes of one name (a daemon's names are at most 4 KiB plus a tenant prefix)


class NameLog:
    """Namespace id -> name, kept in an append-only file (see the module docstring)."""

    def __init__(self, path: Path, fd: int, names: dict[int, str]) -> None:
        self.path = path
        self.fd = fd
        self.names = names  # what the log says now

    @classmethod
    def open(cls, path: Path, epoch: int, fresh: bool = False) -> tuple[NameLog, str | None]:
        """The log at ``path`` for ledger ``epoch``, and None; or, when there is no log of that
        epoch (missing, another epoch, not a log), an empty new one and why. ``fresh``: start
        an empty log whatever is there (a ledger formatted anew)."""
        fd = open_own(path, os.O_RDWR | os.O_CREAT)
        try:
            raw = b"" if fresh else _read_all(fd)
            names, end, why = parse(raw, epoch)
            records = _count(raw, end)
            if why is not None or records > 2 * max(len(names), 16):
                os.close(fd)
                fd = -1
                fd = _rewrite(path, epoch, {} if why else names)
                names = {} if why else names
            elif end < len(raw):
                os.ftruncate(fd, end)  # a torn tail: later appends follow the whole prefix
            os.lseek(fd, 0, os.SEEK_END)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return cls(path, fd, names), None if fresh else why

    def add(self, ns: int, name: str) -> bool:
        """Append id ``ns`` -> ``name``; False (nothing written) for an id outside u32 or a name
        longer than ``MAX_NAME`` bytes."""
        raw = name.encode()
        if not 0 <= ns < 1 << 32 or len(raw) > MAX_NAME:
            return False
        _write_all(self.fd, record(ns, raw))
        self.names[ns] = name
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def record(ns: int, raw: bytes) -> bytes:
    """One record's bytes: id ``ns`` named ``raw``."""
    return _REC.pack(ns, len(raw), _crc(ns, raw)) + raw


def header(epoch: int) -> bytes:
    return _HEAD.pack(MAGIC, epoch)


def parse(raw: bytes, epoch: int) -> tuple[dict[int, str], int, str | None]:
    """(id -> name, where the whole records end, None) from a log's bytes; an empty map, 0 and
    why when ``raw`` is not a log of ``epoch``. Records after the first torn or corrupt one
    are not read."""
    if len(raw) < _HEAD.size:
        return {}, 0, "no namespace log" if not raw else "a truncated namespace log"
    magic, got = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        return {}, 0, "not a namespace log"
    if got != epoch:
        return {}, 0, "the namespace log belongs to another ledger"
    names: dict[int, str] = {}
    at = _HEAD.size
    while at + _REC.size <= len(raw):
        ns, n, crc = _REC.unpack_from(raw, at)
        body = raw[at + _REC.size : at + _REC.size + n]
        if n > MAX_NAME or len(body) < n or _crc(ns, body) != crc:
            break
        try:
            names[ns] = body.decode()
        except UnicodeDecodeError:
            break
        at += _REC.size + n
    return names, at, None


def _count(raw: bytes, end: int) -> int:
    """How many records the whole prefix ``raw[:end]`` of a log holds."""
    at, k = _HEAD.size, 0
    while at < end:
        (_, n, _) = _REC.unpack_from(raw, at)
        at += _REC.size + n
        k += 1
    return k


def _crc(ns: int, raw: bytes) -> int:
    return zlib.crc32(raw, zlib.crc32(struct.pack("<II", ns, len(raw))))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _rewrite(path: Path, epoch: int, names: dict[int, str]) -> int:
    """A new log at ``path`` holding ``names`` (written beside it, then renamed over it, so a
    crash leaves the old log or the new one); returns its descriptor, open for appends."""
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)  # a leftover of a crash mid-rewrite
    fd = open_own(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        body = b"".join(record(ns, name.encode()) for ns, name in sorted(names.items()))
        _write_all(fd, header(epoch) + body)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    return fd
