"""The RDMA control messages between daemons and their answers: value types with limits.

RDMA moves block bytes with one-sided READs and WRITEs; what those need (a queue
pair, where the blocks are, a token that holds them) is agreed on the peers'
authenticated TCP connection with the messages here (``emsd.transport.rdma``
sends and serves them). As in ``emsd.protocol.peer``, each request has
``encode()`` (the header map without the request ``id``, and payload parts) and
``decode(header, payload)``, which raises ``FrameError`` (INVALID_ARGUMENT) for
anything out of its limits; each answer has ``encode()`` (the fields and body
of an OK answer: the server adds ``st`` and ``id``) and ``decode(header,
payload, asked)``, given the request's key count, which a client turns into a
failed link when it raises. An error answer is not decoded: the caller reads
its ``msg``.

Layouts (keys as ``emsd.pool.keys`` puts them on the wire; u64 LE):

- ``QpRequest``      ``{op: RDMA_QP, qp}``  ``QpAnswer`` ``{qp}``: the two sides'
  queue pairs (``rdma_desc.qp_to_wire``; checked by ``qp_from_wire`` where used).
- ``PinRequest``     ``{op: RDMA_PIN, ns, n, kt}`` + keys.
  ``PinAnswer``      ``{count, tok}`` + offsets x count + lengths x count: the
  leading blocks pinned on the server, where they are in its pool.
- ``UnpinRequest``   ``{op: RDMA_UNPIN, tok}``; the answer has no fields.
- ``ReserveRequest`` ``{op: RDMA_RESERVE, ns, n, kt}`` + keys + lengths x n.
  ``ReserveAnswer``  ``{tok}`` + status u8 x n (``emsd.pool.store.Status``) +
  offsets x n: where the client may WRITE the NEW ones.
- ``CommitRequest``  ``{op: RDMA_COMMIT, tok, ok}``: commit the reservation's NEW
  blocks (``ok`` true: written) or abort them. ``CommitAnswer`` ``{stored}``:
  the leading keys the server now holds.

A token names what one connection holds (its pins and reservations, at most
``MAX_TOKEN`` of them over its life, which no connection reaches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from emsd.pool.keys import KeyBatch
from emsd.protocol.fields import exact_size, int_field, u64s
from emsd.protocol.peer import Encoded, block_lengths, keyed, named_keys, sized_keys
from emsd.transport.frames import MAX_BATCH_KEYS, FrameError, PeerOp

MAX_TOKEN = (1 << 63) - 1  # a token is a positive int64: msgpack sends it as one


def _token(header: dict[str, Any]) -> int:
    return int_field(header, "tok", 1, MAX_TOKEN)


@dataclass(frozen=True)
class QpRequest:
    """Connect an RC queue pair to the client's ``qp`` (a ``qp_to_wire`` map)."""

    qp: Any

    def encode(self) -> Encoded:
        return {"op": PeerOp.RDMA_QP, "qp": self.qp}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> QpRequest:
        if payload:
            raise FrameError("RDMA_QP takes its queue pair and nothing else")
        return cls(header.get("qp"))


@dataclass(frozen=True)
class QpAnswer:
    """The server's queue pair (a ``qp_to_wire`` map)."""

    qp: Any

    def encode(self) -> Encoded:
        return {"qp": self.qp}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int = 0) -> QpAnswer:
        return cls(header.get("qp"))


@dataclass(frozen=True)
class PinRequest:
    """Pin the leading blocks of ``keys`` the server holds, for the client's READs."""

    ns: str
    keys: KeyBatch

    def encode(self) -> Encoded:
        return keyed(PeerOp.RDMA_PIN, self.ns, self.keys)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> PinRequest:
        return cls(*named_keys(header, payload))


@dataclass(frozen=True)
class PinAnswer:
    """``tok`` holds the ``count`` leading blocks pinned, at ``offsets`` of ``lengths`` bytes
    in the server's pool."""

    tok: int
    offsets: np.ndarray  # u64 x count
    lengths: np.ndarray  # u64 x count

    @property
    def count(self) -> int:
        return len(self.offsets)

    def encode(self) -> Encoded:
        body = self.offsets.astype("<u8").tobytes() + self.lengths.astype("<u8").tobytes()
        return {"count": self.count, "tok": self.tok}, [body]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> PinAnswer:
        count, tok = int_field(header, "count", 0, asked), _token(header)
        exact_size(payload, 16 * count, "RDMA PIN answer")
        return cls(tok, u64s(payload, count), block_lengths(payload[8 * count:], count))


@dataclass(frozen=True)
class UnpinRequest:
    """Release the pins of token ``tok``."""

    tok: int

    def encode(self) -> Encoded:
        return {"op": PeerOp.RDMA_UNPIN, "tok": self.tok}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> UnpinRequest:
        return cls(_token(header))


@dataclass(frozen=True)
class ReserveRequest:
    """Reserve chunks for blocks of ``lengths`` bytes under ``keys``, for the client's WRITEs."""

    ns: str
    keys: KeyBatch
    lengths: np.ndarray  # u64 x n

    def encode(self) -> Encoded:
        header, parts = keyed(PeerOp.RDMA_RESERVE, self.ns, self.keys)
        return header, [*parts, self.lengths.astype("<u8").tobytes()]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> ReserveRequest:
        return cls(*sized_keys(header, payload))


@dataclass(frozen=True)
class ReserveAnswer:
    """``tok`` holds the reservation; per key its status and, for a NEW one, where to WRITE."""

    tok: int
    status: np.ndarray  # u8 x n
    offsets: np.ndarray  # u64 x n

    def encode(self) -> Encoded:
        body = self.status.astype("u1").tobytes() + self.offsets.astype("<u8").tobytes()
        return {"tok": self.tok}, [body]

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int) -> ReserveAnswer:
        tok = _token(header)
        exact_size(payload, 9 * asked, "RDMA RESERVE answer")
        return cls(tok, np.frombuffer(payload, dtype="u1", count=asked), u64s(payload, asked, asked))


@dataclass(frozen=True)
class CommitRequest:
    """Commit (``ok``: the client wrote them) or abort the NEW blocks of reservation ``tok``."""

    tok: int
    ok: bool

    def encode(self) -> Encoded:
        return {"op": PeerOp.RDMA_COMMIT, "tok": self.tok, "ok": self.ok}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes) -> CommitRequest:
        ok = header.get("ok")
        if type(ok) is not bool:
            raise FrameError(f"ok must be true or false (got {ok!r})")
        return cls(_token(header), ok)


@dataclass(frozen=True)
class CommitAnswer:
    """How many leading keys of the reservation the server now holds."""

    stored: int

    def encode(self) -> Encoded:
        return {"stored": self.stored}, []

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes, asked: int = MAX_BATCH_KEYS) -> CommitAnswer:
        return cls(int_field(header, "stored", 0, asked))
