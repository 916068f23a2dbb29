"""A table of namespace names in a mapped file, shared by the pool's ledger and the disk tier's
index: ``SLOTS`` fixed slots of ``SLOT`` bytes from an offset, each a little-endian u16 length
then the name's UTF-8 bytes (length 0: no name).

A name is written with its length zeroed first and set last, so that a write torn by a crash
(no fsync: only the process dies) reads as no name, never as a mix of an old and a new one.
"""

from __future__ import annotations

import mmap
import struct

SLOTS = 4096
SLOT = 256
SIZE = SLOTS * SLOT
_LEN = struct.Struct("<H")


def read_names(buf: mmap.mmap | bytearray, base: int) -> dict[int, str]:
    """Namespace id -> name for the slots of the table at ``base`` that hold a valid one."""
    out: dict[int, str] = {}
    for ns in range(SLOTS):
        at = base + ns * SLOT
        (n,) = _LEN.unpack_from(buf, at)
        if 0 < n <= SLOT - 2:
            try:
                out[ns] = bytes(buf[at + 2 : at + 2 + n]).decode()
            except UnicodeDecodeError:
                continue
    return out


def write_name(buf: mmap.mmap | bytearray, base: int, ns: int, raw: bytes) -> bool:
    """Put ``raw`` (empty: no name) in slot ``ns`` of the table at ``base``; False (nothing
    written) when ``ns`` is out of range or ``raw`` longer than a slot holds."""
    if not 0 <= ns < SLOTS or len(raw) > SLOT - 2:
        return False
    at = base + ns * SLOT
    _LEN.pack_into(buf, at, 0)  # absent while the bytes change
    buf[at + 2 : at + 2 + len(raw)] = raw
    _LEN.pack_into(buf, at, len(raw))
    return True
