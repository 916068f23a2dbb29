"""The ops between the SDK and its local emsd: value types with encode, decode and limits.

Each request has ``encode()``, which gives the frame's header fields (the
sender adds ``v``, ``id`` and ``op``: ``DaemonClient.call``) and payload
parts, and ``decode(header, payload)``, which checks a received request and
raises ``FrameError`` (INVALID_ARGUMENT) on anything out of bounds; the daemon
answers that request with the error and keeps the connection
(``Service.handle``). Each answer has ``encode()`` for an OK answer and
``decode(header, payload, asked)`` given the request's key or handle count,
raising ``FrameError`` for an answer that does not fit it (the SDK makes it an
``EMS_IO_ERROR``). An error answer (``st`` not OK) is not decoded: the caller
reads its ``msg``.

The types are ``NamedTuple``s, not frozen dataclasses as in
``emsd.protocol.peer``: one is built per call on the one-block paths, and a
tuple costs a quarter of a frozen dataclass's construction there. Those paths
(a one-block PUT, its answer) also have scalar forms here (``PutRequest.one``,
``PutAnswer.one``) that build no array.

Keys are ``emsd.pool.keys`` batches, split from the payload by
``frames.split_keys`` (n keys of type ``kt``). A keyed request's ``decode``
takes the split already made as ``split`` when the caller keeps one
(``Service._keys`` parses a request looked at twice once). Common header
fields: ``ns`` the namespace id of a NAMESPACE answer; ``to`` milliseconds
the daemon may spend on peers; ``pk`` the key before the first one of the
request in its chain (8 bytes: an int key; 33: a tagged key); ``lo`` this node
only (no peers); ``wr`` false: copies fetched or forwarded are not kept as
read cache (write_rcache off). Fields equal to their defaults are left out.

Layouts (little-endian, n keys; ``H`` a handle, u32; offsets and sizes u64):

- RESERVE  ``ReserveRequest``  ``{ns, n, kt, to?, pk?}`` + keys + sizes x n (a size the pool
           cannot hold is FAILED in the answer, not refused). In a cluster, keys found here only
           as read-cache copies are checked with their owners before the answer, within ``to``.
           ``ReserveAnswer``   ``{n}`` + offsets x n + handles x n + status u8 x n
           (``emsd.pool.store.Status``: NEW, to write then COMMIT; PRESENT; FAILED).
- COMMIT   ``CommitRequest``   ``{c, a, wr?, to?}`` + handles x c to commit, then x a to abort.
           ``CommitAnswer``    ``{committed, reached?}``: in a cluster ``reached`` has one byte per
           committed handle, 1 when the block is at its owner.
- PIN      ``PinRequest``      ``{ns, n, kt, lo?, wr?, to?, pk?, br?}`` + keys; ``br``: at most
           this many keys after the leading ones here are brought here (fetched from their
           owners, read from the disk tier) for this PIN.
           ``PinAnswer``       ``{count, more?}`` + offsets x count + lengths x count + handles x
           count: the leading blocks present (fetched from their owners first, in a cluster),
           pinned until released; ``more`` when fewer than asked because blocks fetched for it
           found no room, or it stopped at a key past the ``br`` brought (pin the rest again
           once these are released).
- RELEASE  ``ReleaseRequest``  ``{}`` + handles x n (a handle pinned twice is listed twice).
- TOUCH    ``TouchRequest``    ``{ns, n, kt, x?, pk?}`` + keys: keys the SDK read through the
           shared index, counted as PIN and its RELEASE would; ``x`` keys exists found there.
           ``TouchAnswer``     ``{count}``: the keys READY here (sent without waiting: ``nr``).
- EXISTS   ``ExistsRequest``   ``{ns, n, kt, lo?, to?}`` + keys.
           ``ExistsAnswer``    ``{count}``: leading keys held here or, in a cluster, by their
           owners (asked after the local look).
- GRANT    ``GrantRequest``    ``{size, k, need?}`` + offsets x m of granted chunks given back.
           ``GrantAnswer``     ``{k}`` + offsets x k of chunks for blocks of ``size`` bytes, now
           this connection's: up to the ``k`` asked, none if fewer than ``need`` (default 1)
           fit the daemon's bounds (``emsd.service``: GRANT_SESSION_SHARE, ...).
- PUT      ``PutRequest``      ``{ns, n, kt, wr?, to?, pk?}`` + keys + offsets x n (chunks granted
           to this connection, already written) + sizes x n. NEW blocks are committed at once.
           ``PutAnswer``       ``{n, reached?}`` + status u8 x n (as RESERVE's); ``reached`` as
           COMMIT's, one byte per NEW key.
- NAMESPACE ``NamespaceRequest`` ``{name}``.      ``NamespaceAnswer`` ``{ns}``.
- DROP     ``DropRequest``     ``{ns, to?}``.     ``DropAnswer``  ``{dropped, missed}``: blocks
           evicted here, members that did not confirm.
- OWNER    ``OwnerRequest``    ``{ns: name, n, kt}`` + keys (1..``OWNER_KEYS``).
           ``OwnerAnswer``     ``{owners}``: node ids per key.
- PLACEMENT ``PlacementRequest`` ``{vnodes, replicas}``. Answer ``{vnodes, replicas, version}``.
- RING     header only.         ``RingAnswer``  ``{pass, ttl, vnodes, replicas, me, prefix,
           members}``: the ring and a read pass, for reads straight from the owners
           (a cluster node of plain TCP peers with ``cluster.direct_reads``; others refuse it).
- PING, STATS, DRAIN ``{to?}``: header only; STATS answers a free-form map of counters, DRAIN
  ``{moved, failed, remaining}``. HELLO is the connection's first frame (``Service.hello``):
  ``{pid, access_id?, access_key?, idx?, operator?}`` (``operator`` true: emsctl without a
  tenant, which a daemon of tenants only serves for operator commands from root or its own
  user); its answer names the node and the pool (``pool_size``, ``region``, ``sparse``, ``page``),
  whether it grants chunks (``grants``), the most bytes one PIN should ask for (``part``,
  ``Service.load_part``; 0: no limit) and whether its PIN answers say ``more`` (``more``) and it
  honours a PIN's ``br`` (``bring``).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, cast

import numpy as np

from emsd.placement import record as placement_record
from emsd.pool.keys import KT_INT, KT_TAGGED, TAGGED_ITEMSIZE, KeyBatch, KeyError_
from emsd.protocol.fields import exact_size, name_field, u64s
from emsd.protocol.fields import int_field as _int
from emsd.transport.frames import MAX_BATCH_KEYS, MAX_PAYLOAD, FrameError, split_keys

MAX_NAME = 4096  # characters of a namespace name a client gives
MAX_NS = (1 << 32) - 1  # a namespace id
MAX_HANDLES = MAX_PAYLOAD // 4  # handles in one COMMIT or RELEASE: a payload's worth
MAX_SIZE = 1 << 40  # bytes of one block a GRANT names (the daemon bounds it by its pages)
MAX_FOUND = 1 << 32  # keys a TOUCH says exists found in the shared index
MAX_COUNT = 1 << 63  # a counter in an answer
OWNER_KEYS = 1024  # keys an OWNER request may name
MAX_MEMBERS = 4096  # members a RING answer may list
MAX_PASS = 1024  # bytes of a read pass (emsd.protocol.readpass)

Encoded = tuple[dict[str, Any], list[bytes]]
Split = tuple[KeyBatch, bytes]  # the keys of a keyed request and the payload after them
ONE_PUT = struct.Struct("<QQ")  # a one-block PUT after its key: the granted chunk's offset, the size
_NO_U8 = np.zeros(0, dtype=np.uint64)
_NO_U4 = np.zeros(0, dtype=np.uint32)


# -- fields -----------------------------------------------------------------------


def _flag(header: dict[str, Any], field: str, default: bool) -> bool:
    value = header.get(field, default)
    if value is not default and type(value) is not bool:
        raise FrameError(f"{field} must be a bool (got {value!r})")
    return value  # type: ignore[no-any-return]


def _budget(header: dict[str, Any]) -> int | None:
    """``to``: milliseconds for peer work (absent: the daemon's default; ``_timeout`` there caps it)."""
    to = header.get("to")
    if to is None or (type(to) is int and 0 <= to < MAX_COUNT):
        return to
    raise FrameError(f"to must be milliseconds, an int >= 0 (got {to!r})")


def ns_id(header: dict[str, Any]) -> int:
    """``ns``: a namespace id (which the daemon checks this connection opened)."""
    return _int(header, "ns", 0, MAX_NS)


def prev_key(header: dict[str, Any]) -> KeyBatch | None:
    """``pk``: the key before the request's first in its chain, or None."""
    pk = header.get("pk")
    if pk is None:
        return None
    if not isinstance(pk, bytes) or len(pk) not in (8, TAGGED_ITEMSIZE):
        raise FrameError(f"pk must be 8 or {TAGGED_ITEMSIZE} bytes of one key")
    try:
        return KeyBatch.from_wire(KT_INT if len(pk) == 8 else KT_TAGGED, pk, 1)
    except KeyError_ as exc:
        raise FrameError(f"pk: {exc}") from None


def _name(header: dict[str, Any], field: str) -> str:
    return name_field(header, field, MAX_NAME)


def _u32s(raw: bytes, n: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(raw, dtype="<u4", count=n, offset=offset).astype(np.uint32)


def _keyed(ns: int, keys: KeyBatch) -> tuple[dict[str, Any], list[bytes]]:
    kt, raw = keys.to_wire()
    return {"ns": ns, "n": len(keys), "kt": kt}, [raw]


def _optional(header: dict[str, Any], to: int | None = None, prev: KeyBatch | None = None,
              lo: bool = False, wr: bool = True) -> dict[str, Any]:
    """``header`` with the optional fields that differ from their defaults."""
    if to is not None:
        header["to"] = to
    if prev is not None:
        header["pk"] = prev.to_wire()[1]
    if lo:
        header["lo"] = True
    if not wr:
        header["wr"] = False
    return header


def _head(header: dict[str, Any], payload: bytes, split: Split | None,
          exact: bool) -> tuple[int, KeyBatch, bytes]:
    """A keyed request's namespace id, keys and the payload after them (none with ``exact``),
    in one call: the per-request part of every keyed decode, kept to few steps."""
    ns = header.get("ns")
    if type(ns) is not int or not 0 <= ns <= MAX_NS:
        raise FrameError(f"ns must be an int in 0..{MAX_NS} (got {ns!r})")
    keys, rest = split if split is not None else split_keys(
        header.get("n"), header.get("kt"), payload, MAX_BATCH_KEYS, exact)
    if exact and rest:
        raise FrameError("unexpected bytes after the keys")
    return ns, keys, rest


def _u8_bytes(a: np.ndarray) -> bytes:
    return np.asarray(a, dtype="<u8").tobytes()  # no copy when already so (x86)


def _u4_bytes(a: np.ndarray) -> bytes:
    return np.asarray(a, dtype="<u4").tobytes()


def _st_bytes(a: np.ndarray) -> bytes:
    return np.asarray(a, dtype=np.uint8).tobytes()


def _reached(header: dict[str, Any], n: int) -> bytes | None:
    """``reached`` of a cluster's COMMIT or PUT answer: ``n`` bytes (one per committed block),
    or None when absent (standalone). Anything else is a broken answer (``FrameError``): read
    as "all reached", it would count blocks that are at no owner."""
    reached = header.get("reached")
    if reached is None or (type(reached) is bytes and len(reached) == n):
        return reached
    raise FrameError(f"reached must be {n} bytes, one per committed block")


def _count(header: dict[str, Any], field: str, asked: int) -> int:
    return _int(header, field, 0, asked)


# -- RESERVE, COMMIT ----------------------------------------------------------------


class ReserveRequest(NamedTuple):
    """Places for blocks of ``sizes`` bytes under ``keys``; PENDING until committed."""

    ns: int
    keys: KeyBatch
    sizes: np.ndarray  # u64 x n
    prev: KeyBatch | None = None
    to: int | None = None

    def encode(self) -> Encoded:
        header, parts = _keyed(self.ns, self.keys)
        return _optional(header, self.to, self.prev), [*parts, _u8_bytes(self.sizes)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, split: Split | None = None) -> ReserveRequest:
        ns, keys, rest = _head(header, payload, split, False)
        n = len(keys)
        exact_size(rest, 8 * n, "sizes")
        return cls(ns, keys, u64s(rest, n), prev_key(header), _budget(header))


class ReserveAnswer(NamedTuple):
    """Per key: its place, its handle and whether it is NEW, PRESENT or FAILED."""

    offsets: np.ndarray  # u64 x n
    handles: np.ndarray  # u32 x n
    status: np.ndarray  # u8 x n

    def encode(self) -> Encoded:
        n = len(self.status)
        return {"n": n}, [_u8_bytes(self.offsets), _u4_bytes(self.handles), _st_bytes(self.status)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> ReserveAnswer:
        exact_size(payload, 13 * asked, "RESERVE answer")
        return cls(np.frombuffer(payload, dtype="<u8", count=asked),
                   np.frombuffer(payload, dtype="<u4", count=asked, offset=8 * asked),
                   np.frombuffer(payload, dtype=np.uint8, count=asked, offset=12 * asked))


class CommitRequest(NamedTuple):
    """Make the reserved blocks ``commit`` readable and abort ``abort`` (handles of RESERVE)."""

    commit: np.ndarray  # u32
    abort: np.ndarray = _NO_U4  # u32
    wr: bool = True
    to: int | None = None

    def encode(self) -> Encoded:
        nc, na = len(self.commit), len(self.abort)
        handles = self.commit if not na else self.abort if not nc else np.concatenate(
            (self.commit, self.abort))
        return _optional({"c": nc, "a": na}, self.to, wr=self.wr), [_u4_bytes(handles)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> CommitRequest:
        nc, na = _int(header, "c", 0, MAX_HANDLES, 0), _int(header, "a", 0, MAX_HANDLES, 0)
        exact_size(payload, 4 * (nc + na), "handles")
        return cls(_u32s(payload, nc), _u32s(payload, na, 4 * nc), _flag(header, "wr", True),
                   _budget(header))


class CommitAnswer(NamedTuple):
    committed: int  # distinct blocks made readable
    reached: bytes | None = None  # in a cluster: 1 per committed handle as listed, at its owner

    def encode(self) -> Encoded:
        header: dict[str, Any] = {"committed": self.committed}
        if self.reached is not None:
            header["reached"] = self.reached
        return header, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> CommitAnswer:
        return cls(_count(header, "committed", asked), _reached(header, asked))


# -- PIN, RELEASE, TOUCH, EXISTS ---------------------------------------------------------


class PinRequest(NamedTuple):
    """Pin the leading blocks of ``keys`` present (in a cluster, fetched first) for reading.
    ``bring``: at most this many keys after the leading ones found here are brought here for
    it (fetched from their owners, read from the disk tier); None: no limit."""

    ns: int
    keys: KeyBatch
    prev: KeyBatch | None = None
    lo: bool = False
    wr: bool = True
    to: int | None = None
    bring: int | None = None

    def encode(self) -> Encoded:
        header, parts = _keyed(self.ns, self.keys)
        if self.bring is not None:
            header["br"] = self.bring
        return _optional(header, self.to, self.prev, self.lo, self.wr), parts

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, split: Split | None = None) -> PinRequest:
        ns, keys, _ = _head(header, payload, split, True)
        return cls(ns, keys, prev_key(header), _flag(header, "lo", False), _flag(header, "wr", True),
                   _budget(header), bring_field(header))


def bring_field(header: dict[str, Any]) -> int | None:
    """``br``: the most keys a PIN may bring here (``PinRequest.bring``), or None."""
    return None if header.get("br") is None else _int(header, "br", 1, MAX_BATCH_KEYS)


class PinAnswer(NamedTuple):
    """The ``count`` leading blocks pinned: where they are, their lengths, their handles; ``more``:
    the pin stopped short because blocks fetched for it found no room here, or at a key past
    those its ``bring`` let it bring (another PIN of the rest, once these are released, may
    load more), not at a block that is nowhere."""

    offsets: np.ndarray  # u64 x count
    lengths: np.ndarray  # u64 x count
    handles: np.ndarray  # u32 x count
    more: bool = False

    def encode(self) -> Encoded:
        header: dict[str, Any] = {"count": len(self.handles)}
        if self.more:
            header["more"] = 1
        return header, [_u8_bytes(self.offsets), _u8_bytes(self.lengths), _u4_bytes(self.handles)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> PinAnswer:
        count = _count(header, "count", asked)
        exact_size(payload, 20 * count, "PIN answer")
        return cls(np.frombuffer(payload, dtype="<u8", count=count),
                   np.frombuffer(payload, dtype="<u8", count=count, offset=8 * count),
                   np.frombuffer(payload, dtype="<u4", count=count, offset=16 * count),
                   header.get("more") == 1)


class ReleaseRequest(NamedTuple):
    """Drop pins taken by PIN on this connection (no answer fields)."""

    handles: np.ndarray  # u32

    def encode(self) -> Encoded:
        return {}, [_u4_bytes(self.handles)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> ReleaseRequest:
        if len(payload) % 4:
            raise FrameError("handles payload is not a multiple of 4")
        return cls(_u32s(payload, len(payload) // 4))


class TouchRequest(NamedTuple):
    """``keys`` read through the shared index count as used now; ``found`` keys exists found there."""

    ns: int
    keys: KeyBatch
    prev: KeyBatch | None = None
    found: int = 0

    def encode(self) -> Encoded:
        header, parts = _keyed(self.ns, self.keys)
        if self.found:
            header["x"] = self.found
        return _optional(header, prev=self.prev), parts

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, split: Split | None = None) -> TouchRequest:
        ns, keys, _ = _head(header, payload, split, True)
        return cls(ns, keys, prev_key(header), _int(header, "x", 0, MAX_FOUND, 0))


class ExistsRequest(NamedTuple):
    """How many leading ``keys`` are held (here, or in a cluster by their owners); no pin, no touch."""

    ns: int
    keys: KeyBatch
    lo: bool = False
    to: int | None = None

    def encode(self) -> Encoded:
        header, parts = _keyed(self.ns, self.keys)
        return _optional(header, self.to, lo=self.lo), parts

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, split: Split | None = None) -> ExistsRequest:
        ns, keys, _ = _head(header, payload, split, True)
        return cls(ns, keys, _flag(header, "lo", False), _budget(header))


class CountAnswer(NamedTuple):
    """The answer of EXISTS and TOUCH: ``held``, the leading keys found (of the ``asked``),
    in the header field ``count`` (a tuple's field cannot be named so)."""

    held: int

    def encode(self) -> Encoded:
        return {"count": self.held}, []

    @staticmethod
    def encode_of(held: int) -> Encoded:
        """``CountAnswer(held).encode()`` without building the tuple (every EXISTS and TOUCH)."""
        return {"count": held}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> CountAnswer:
        return cls(_count(header, "count", asked))


ExistsAnswer = TouchAnswer = CountAnswer


# -- GRANT, PUT ---------------------------------------------------------------------


class GrantRequest(NamedTuple):
    """Up to ``k`` chunks for blocks of ``size`` bytes (none if fewer than ``need``); gives
    back the granted chunks at ``back`` first."""

    size: int
    k: int
    need: int = 1
    back: np.ndarray = _NO_U8  # u64 offsets

    def encode(self) -> Encoded:
        header = {"size": self.size, "k": self.k, "need": self.need}
        return header, [_u8_bytes(self.back)] if len(self.back) else []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> GrantRequest:
        size = _int(header, "size", 1, MAX_SIZE)
        k, need = _int(header, "k", 0, MAX_BATCH_KEYS), _int(header, "need", 0, MAX_BATCH_KEYS, 1)
        if len(payload) % 8:
            raise FrameError("offsets given back: not a multiple of 8 bytes")
        return cls(size, k, need, u64s(payload, len(payload) // 8))


class GrantAnswer(NamedTuple):
    """Offsets of the chunks granted, now the connection's."""

    offsets: np.ndarray  # u64 x k

    def encode(self) -> Encoded:
        return {"k": len(self.offsets)}, [_u8_bytes(self.offsets)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int = MAX_BATCH_KEYS) -> GrantAnswer:
        k = _count(header, "k", asked)
        exact_size(payload, 8 * k, "GRANT answer")
        return cls(u64s(payload, k))


class PutRequest(NamedTuple):
    """Store blocks of ``sizes`` bytes under ``keys``, already written into the granted chunks
    at ``at``; NEW ones are committed at once."""

    ns: int
    keys: KeyBatch
    at: np.ndarray  # u64 x n
    sizes: np.ndarray  # u64 x n
    prev: KeyBatch | None = None
    wr: bool = True
    to: int | None = None

    def encode(self) -> Encoded:
        header, parts = _keyed(self.ns, self.keys)
        return (_optional(header, self.to, self.prev, wr=self.wr),
                [*parts, _u8_bytes(self.at), _u8_bytes(self.sizes)])

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, split: Split | None = None) -> PutRequest:
        ns, keys, rest = _head(header, payload, split, False)
        n = len(keys)
        exact_size(rest, 16 * n, "offsets and sizes")
        return cls(ns, keys, u64s(rest, n), u64s(rest, n, 8 * n), prev_key(header),
                   _flag(header, "wr", True), _budget(header))

    @staticmethod
    def encode_one(ns: int, keys: KeyBatch, at: int, size: int, prev: KeyBatch | None = None,
                   wr: bool = True, to: int | None = None) -> Encoded:
        """``encode`` of a one-block PUT (``keys`` one key, its chunk ``at`` and ``size`` in
        scalars): the same header and payload bytes, without the arrays."""
        header, parts = _keyed(ns, keys)
        return _optional(header, to, prev, wr=wr), [*parts, ONE_PUT.pack(at, size)]

    @staticmethod
    def one(header: dict[str, Any], rest: bytes) -> tuple[int, int, KeyBatch | None]:
        """A one-block PUT's (chunk offset, size, ``prev``) in scalars, from its header and the
        payload after its key (split by the caller): ``decode``'s checks without its arrays."""
        if len(rest) != ONE_PUT.size:
            raise FrameError(f"offsets and sizes: expected {ONE_PUT.size} bytes, got {len(rest)}")
        at, size = ONE_PUT.unpack(rest)
        if "wr" in header:
            _flag(header, "wr", True)
        if "to" in header:
            _budget(header)
        return at, size, prev_key(header)


class PutAnswer(NamedTuple):
    """Per key NEW (stored now), PRESENT or FAILED, as RESERVE's; ``reached`` as COMMIT's."""

    status: np.ndarray  # u8 x n
    reached: bytes | None = None  # in a cluster: 1 per NEW key at its owner

    def encode(self) -> Encoded:
        header: dict[str, Any] = {"n": len(self.status)}
        if self.reached is not None:
            header["reached"] = self.reached
        return header, [_st_bytes(self.status)]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> PutAnswer:
        exact_size(payload, asked, "PUT answer")
        status = np.frombuffer(payload, dtype=np.uint8)
        return cls(status, _reached(header, int(np.count_nonzero(status == 0))))

    @staticmethod
    def encode_one(status: int) -> Encoded:
        """``encode`` of a one-block PUT's answer, from its status in a scalar."""
        return {"n": 1}, [bytes((status,))]

    @staticmethod
    def one(header: dict[str, Any], payload: bytes) -> tuple[int, bool]:
        """A one-block PUT's answer in scalars: (status, whether the block reached its owner:
        true unless the answer's ``reached`` says it did not)."""
        if len(payload) != 1:
            raise FrameError("PUT answer: expected 1 byte")
        status = payload[0]
        return status, _reached(header, int(status == 0)) != b"\0"


# -- header-only ops -------------------------------------------------------------------


class NamespaceRequest(NamedTuple):
    """The id of namespace ``name`` (of the connection's tenant) on this connection."""

    name: str

    def encode(self) -> Encoded:
        return {"name": self.name}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> NamespaceRequest:
        return cls(_name(header, "name"))


class NamespaceAnswer(NamedTuple):
    ns: int

    def encode(self) -> Encoded:
        return {"ns": self.ns}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> NamespaceAnswer:
        return cls(ns_id(header))


class DropRequest(NamedTuple):
    """Retire namespace ``ns`` here and, in a cluster, on every member."""

    ns: int
    to: int | None = None

    def encode(self) -> Encoded:
        return _optional({"ns": self.ns}, self.to), []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> DropRequest:
        return cls(ns_id(header), _budget(header))


class DropAnswer(NamedTuple):
    dropped: int  # blocks evicted here
    missed: int = 0  # members that did not confirm in time

    def encode(self) -> Encoded:
        return {"dropped": self.dropped, "missed": self.missed}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> DropAnswer:
        return cls(_int(header, "dropped", 0, MAX_COUNT, 0), _int(header, "missed", 0, MAX_COUNT, 0))


class OwnerRequest(NamedTuple):
    """Which nodes own ``keys`` of namespace ``name`` (1..``OWNER_KEYS`` keys)."""

    name: str
    keys: KeyBatch

    def encode(self) -> Encoded:
        header, parts = _keyed(0, self.keys)
        header["ns"] = self.name
        return header, parts

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> OwnerRequest:
        name = _name(header, "ns")
        keys, _ = split_keys(header.get("n"), header.get("kt"), payload, OWNER_KEYS, exact=True)
        if not keys:
            raise FrameError(f"n must be 1..{OWNER_KEYS}")
        return cls(name, keys)


class OwnerAnswer(NamedTuple):
    owners: list[list[str]]  # node ids per key, primary first

    def encode(self) -> Encoded:
        return {"owners": self.owners}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> OwnerAnswer:
        owners = header.get("owners")
        if not (isinstance(owners, list) and len(owners) == asked
                and all(isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids)
                        for ids in owners)):
            raise FrameError(f"owners must be {asked} non-empty lists of node ids")
        return cls(owners)


class PlacementRequest(NamedTuple):
    """Rewrite the cluster's placement record (``emsd.placement.record`` bounds both)."""

    vnodes: int
    replicas: int

    def encode(self) -> Encoded:
        return {"vnodes": self.vnodes, "replicas": self.replicas}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> PlacementRequest:
        vnodes, replicas = header.get("vnodes"), header.get("replicas")
        why = placement_record.invalid(vnodes, replicas)
        if why is not None:
            raise FrameError(why)
        assert type(vnodes) is int and type(replicas) is int
        return cls(vnodes, replicas)


class RingAnswer(NamedTuple):
    """What a client needs to read blocks straight from their owners (``ems.direct``): the
    ring's members and parameters, this node's id, the prefix the daemon puts before the
    client's namespace names (its tenant's: placement hashes the whole name) and a read pass
    (``emsd.protocol.readpass``) good for ``ttl`` seconds. The request is header only."""

    read_pass: bytes
    ttl: int
    vnodes: int
    replicas: int
    me: str
    prefix: str
    members: list[tuple[str, int, str]]  # (node id, capacity, peer "host:port"), sorted by id

    def encode(self) -> Encoded:
        return {"pass": self.read_pass, "ttl": self.ttl, "vnodes": self.vnodes, "replicas": self.replicas,
                "me": self.me, "prefix": self.prefix, "members": [list(m) for m in self.members]}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int = 0) -> RingAnswer:
        read_pass, me, prefix, members = (header.get(f) for f in ("pass", "me", "prefix", "members"))
        vnodes, replicas = header.get("vnodes"), header.get("replicas")
        why = placement_record.invalid(vnodes, replicas)
        if why is not None:
            raise FrameError(why)
        if not isinstance(read_pass, bytes) or not 0 < len(read_pass) <= MAX_PASS:
            raise FrameError(f"pass must be 1..{MAX_PASS} bytes")
        if not isinstance(me, str) or not isinstance(prefix, str) or len(prefix) > MAX_NAME:
            raise FrameError("me and prefix must be strings")
        if not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS:
            raise FrameError(f"members must be a list of 1..{MAX_MEMBERS}")
        out = []
        for m in members:
            if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and m[0]
                    and type(m[1]) is int and m[1] > 0 and isinstance(m[2], str)):
                raise FrameError("each member must be [node id, capacity > 0, peer address]")
            out.append((m[0], m[1], m[2]))
        if len({m[0] for m in out}) != len(out):
            raise FrameError("members must have distinct node ids")
        ttl = _int(header, "ttl", 1, 1 << 31)
        return cls(read_pass, ttl, cast(int, vnodes), cast(int, replicas), me, prefix, out)
