"""The data ops between daemons and their answers: value types with encode, decode and limits.

Each request is a frozen dataclass with ``encode()``, which gives the
frame's header map (the sender adds the request ``id``) and payload parts,
and ``decode(header, payload)``, which checks a received frame and raises
``FrameError`` (INVALID_ARGUMENT) on anything out of bounds: a server answers
that once and hangs up. Each answer has ``encode()`` for an OK answer and
``decode(header, payload, asked)`` given the request's key count; a client
turns its ``FrameError`` into a failed link. An error answer (``st`` not OK)
is not decoded: the caller reads its ``msg``. Block bytes do not travel in
these frames: a GET's answer and a PUT announce them in ``bulk`` and they
follow the frame on the stream.

Layouts (keys as ``emsd.pool.keys`` puts them on the wire; lengths u64 LE):

- ``GetRequest``  ``{op: GET, ns, n, kt}`` + keys.
  ``GetAnswer``   ``{count, bulk}`` + lengths x count, then the blocks' bytes.
- ``PutRequest``  ``{op: PUT, ns, n, kt, bulk}`` + keys + lengths x n, then the bytes.
  ``PutAnswer``   ``{stored}``: leading keys now held by the server.
- ``HasRequest``  ``{op: HAS, ns, n, kt}`` + keys.   ``HasAnswer``  ``{count}``.
- ``DropRequest`` ``{op: DROP, ns}``.                ``DropAnswer`` ``{dropped}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from emsd.pool.keys import KeyBatch
from emsd.protocol.fields import int_field, name_field
from emsd.transport.frames import FrameError, PeerOp, Status, split_keys

MAX_BULK = 1 << 34  # block bytes in one request or answer: far above any batch, far below a wrap
MAX_NAME = 8192  # characters of a namespace name (a client's 4,096 and its tenant's prefix)

Encoded = tuple[dict[str, Any], list[bytes]]


def _name(header: dict[str, Any]) -> str:
    return name_field(header, "ns", MAX_NAME)


def _count(header: dict[str, Any], field: str, most: int) -> int:
    return int_field(header, field, 0, most)


def block_lengths(raw: bytes, n: int) -> np.ndarray:
    """``n`` block lengths (u64 LE, each at least 1, at most ``MAX_BULK`` in all) from ``raw``,
    which holds exactly them; raises ``FrameError``. One block (a block a call) in scalar steps."""
    if len(raw) != 8 * n:
        raise FrameError("lengths must be n little-endian u64")
    if n == 1:
        one = int.from_bytes(raw, "little")
        if not 0 < one <= MAX_BULK:
            raise FrameError("block lengths out of range")
        return np.array((one,), dtype=np.uint64)
    lengths = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    if n and (int(lengths.min()) == 0 or int(lengths.sum()) > MAX_BULK):
        raise FrameError("block lengths out of range")
    return lengths


def _total(lengths: np.ndarray) -> int:
    """The bytes of blocks of ``lengths`` (one block: in a scalar)."""
    return int(lengths[0]) if lengths.size == 1 else int(lengths.sum())


def _bulk(header: dict[str, Any], lengths: np.ndarray) -> None:
    """Check the ``bulk`` field: the sum of ``lengths``."""
    if header.get("bulk") != _total(lengths):
        raise FrameError("bulk does not match the lengths")


def keyed(op: PeerOp, ns: str, keys: KeyBatch) -> Encoded:
    """The header and payload of a request of ``op`` about ``keys`` of namespace ``ns``."""
    kt, raw = keys.to_wire()
    return {"op": op, "ns": ns, "n": len(keys), "kt": kt}, [raw]


def named_keys(header: dict[str, Any], payload: bytes) -> tuple[str, KeyBatch]:
    """The namespace name and keys of a request that carries nothing else (``keyed``)."""
    ns = _name(header)
    keys, _ = split_keys(header.get("n"), header.get("kt"), payload, exact=True)
    return ns, keys


def sized_keys(header: dict[str, Any], payload: bytes) -> tuple[str, KeyBatch, np.ndarray]:
    """The namespace name, keys and block lengths of a request that carries keys then one
    length each (PUT, RDMA RESERVE)."""
    ns = _name(header)
    keys, rest = split_keys(header.get("n"), header.get("kt"), payload)
    return ns, keys, block_lengths(rest, len(keys))


@dataclass(frozen=True)
class GetRequest:
    """The leading blocks of ``keys`` that the server holds, with their bytes."""

    ns: str
    keys: KeyBatch

    def encode(self) -> Encoded:
        return keyed(PeerOp.GET, self.ns, self.keys)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> GetRequest:
        return cls(*named_keys(header, payload))


@dataclass(frozen=True)
class GetAnswer:
    """``count`` leading blocks pinned on the server, of ``lengths`` bytes; the bytes follow."""

    count: int
    lengths: np.ndarray  # u64 x count

    @property
    def bulk(self) -> int:
        """The bytes of the blocks that follow the frame."""
        return _total(self.lengths)

    def encode(self) -> Encoded:
        lengths = self.lengths.astype("<u8")
        return {"st": int(Status.OK), "count": self.count, "bulk": self.bulk}, [lengths.tobytes()]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> GetAnswer:
        count = _count(header, "count", asked)
        lengths = block_lengths(payload, count)
        _bulk(header, lengths)
        return cls(count, lengths)


@dataclass(frozen=True)
class PutRequest:
    """Store blocks of ``lengths`` bytes under ``keys``; their bytes follow the frame."""

    ns: str
    keys: KeyBatch
    lengths: np.ndarray  # u64 x n

    def encode(self) -> Encoded:
        header, parts = keyed(PeerOp.PUT, self.ns, self.keys)
        lengths = self.lengths.astype("<u8")
        header["bulk"] = _total(lengths)
        return header, [*parts, lengths.tobytes()]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> PutRequest:
        ns, keys, lengths = sized_keys(header, payload)
        _bulk(header, lengths)
        return cls(ns, keys, lengths)


@dataclass(frozen=True)
class PutAnswer:
    """How many leading keys of the PUT the server now holds."""

    stored: int

    def encode(self) -> Encoded:
        return {"st": int(Status.OK), "stored": self.stored}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> PutAnswer:
        return cls(_count(header, "stored", asked))


@dataclass(frozen=True)
class HasRequest:
    """How many leading ``keys`` the server holds; nothing moves, nothing is pinned."""

    ns: str
    keys: KeyBatch

    def encode(self) -> Encoded:
        return keyed(PeerOp.HAS, self.ns, self.keys)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> HasRequest:
        return cls(*named_keys(header, payload))


@dataclass(frozen=True)
class HasAnswer:
    count: int

    def encode(self) -> Encoded:
        return {"st": int(Status.OK), "count": self.count}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> HasAnswer:
        return cls(_count(header, "count", asked))


@dataclass(frozen=True)
class DropRequest:
    """Drop namespace ``ns`` on the server (a cluster-wide DROP)."""

    ns: str

    def encode(self) -> Encoded:
        return {"op": PeerOp.DROP, "ns": self.ns}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> DropRequest:
        if payload:
            raise FrameError("DROP takes a namespace name and nothing else")
        return cls(_name(header))


@dataclass(frozen=True)
class DropAnswer:
    dropped: int  # blocks the server evicted

    def encode(self) -> Encoded:
        return {"st": int(Status.OK), "dropped": self.dropped}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int = 0) -> DropAnswer:
        return cls(_count(header, "dropped", MAX_BULK))
