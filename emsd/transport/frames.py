"""Frames of the control protocol between the SDK and its local emsd (sans-I/O).

A frame is::

    +----------------+-----------------+-------------------+------------------+
    | header_len u32 | payload_len u32 | header (msgpack)  | payload (raw)    |
    +----------------+-----------------+-------------------+------------------+

both lengths little-endian. The header is a msgpack map with at least ``v``
(protocol version), ``id`` (request id, echoed in the response) and ``op``
(an ``Op``) in requests, ``st`` (a ``Status``) in responses. Bulk arrays
(keys, sizes, offsets, handles) travel in the payload as packed
little-endian integers, never as msgpack lists: decoding them is a
``numpy.frombuffer``, not a loop.

Limits are checked before anything is buffered: a header over
``MAX_HEADER`` or a payload over ``MAX_PAYLOAD`` is a ``FrameError``, and the
peer sending it is disconnected after one error response, so a hostile or
broken client costs at most one frame of memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

from emsd.pool.keys import KT_INT, KT_TAGGED, TAGGED_ITEMSIZE, KeyBatch, KeyError_

PROTOCOL_VERSION = 1
PREFIX = struct.Struct("<II")
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 8 * 1024 * 1024
MAX_BATCH_KEYS = 65536
SOCKET_NAME = "emsd.sock"


class Op(IntEnum):
    """Request opcodes. One line each: what it asks."""

    HELLO = 1  # authenticate; the response carries the pool's fd (and the shared index's: SCM_RIGHTS)
    NAMESPACE = 2  # map a namespace name to its id for this connection
    RESERVE = 3  # places for (key, size) x n; PENDING until committed
    COMMIT = 4  # make reserved blocks readable (and abort others)
    PIN = 5  # pin the leading present blocks for reading
    RELEASE = 6  # drop pins taken by PIN
    EXISTS = 7  # count the leading present blocks; no pin, no LRU touch
    STATS = 8  # node and pool statistics
    PING = 9  # liveness
    OWNER = 10  # which nodes own these keys (operators: emsctl owner)
    DRAIN = 11  # leave the ring and move owned blocks to their new owners, a batch per call
    DROP = 12  # retire a namespace: its blocks are found no more, here and on every member
    GRANT = 13  # chunks of one size held for this connection's next saves (and give some back)
    PUT = 14  # store (key, size) x n in granted chunks already written, committed at once
    PLACEMENT = 15  # rewrite the cluster's placement record: vnodes, replicas (emsctl placement set)
    TOUCH = 16  # the leading present blocks count as used now (read through the shared index)
    RING = 17  # the ring's members and a read pass: read blocks straight from their owners


class PeerOp(IntEnum):
    """Opcodes between daemons (``emsd.transport.peer``), numbered apart from ``Op``."""

    CHALLENGE = 101  # the server's nonce, first on every connection
    AUTH = 102  # the client's node id, nonce and MAC over both nonces
    GET = 103  # the leading present blocks of keys, their bytes after the answer
    PUT = 104  # store blocks whose bytes follow the request
    RDMA_QP = 105  # exchange queue pair numbers (emsd.transport.rdma)
    RDMA_PIN = 106  # pin blocks for the client's RDMA READs
    RDMA_UNPIN = 107  # release a pin token
    RDMA_RESERVE = 108  # reserve chunks for the client's RDMA WRITEs
    RDMA_COMMIT = 109  # commit (or abort) a reservation token
    HAS = 110  # how many leading keys the peer holds (a cluster-wide exists)
    DROP = 111  # drop a namespace on the peer (a cluster-wide DROP)
    READ = 112  # an SDK client's read pass, in place of AUTH: its connection may GET its tenant's blocks


RDMA_OPS = frozenset((PeerOp.RDMA_QP, PeerOp.RDMA_PIN, PeerOp.RDMA_UNPIN, PeerOp.RDMA_RESERVE,
                      PeerOp.RDMA_COMMIT))


class Status(IntEnum):
    """Response status; values equal ``ems.EmsErrorCode`` one-to-one."""

    OK = 0
    INVALID_ARGUMENT = 1
    IO_ERROR = 2
    TIMEOUT = 3
    INTERNAL = 4
    RECOVERING = 5


class FrameError(Exception):
    """A frame that breaks the protocol. ``status`` is what to answer."""

    def __init__(self, message: str, status: Status = Status.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes


def encode(header: dict[str, Any], payload: bytes | memoryview = b"") -> bytes:
    """One frame as bytes. The caller keeps header and payload within limits."""
    head = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(head), len(payload)) + head + bytes(payload)


def encode_parts(header: dict[str, Any], *payload: bytes | memoryview) -> list[bytes | memoryview]:
    """A frame as a list of buffers for ``sendmsg``/``writelines`` (no joining copy)."""
    head = msgpack.packb(header, use_bin_type=True)
    size = sum(len(p) for p in payload)
    return [PREFIX.pack(len(head), size), head, *payload]


def decode_header(raw: bytes | memoryview) -> dict[str, Any]:
    """Unpack and sanity-check a header; raises ``FrameError``."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise FrameError("header is not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {header.get('v')!r} != {PROTOCOL_VERSION}")
    rid = header.get("id")
    if type(rid) is not int or not 0 <= rid < 1 << 63:
        raise FrameError("request id missing or not a non-negative int")
    return header


def check_lengths(header_len: int, payload_len: int) -> None:
    if not 0 < header_len <= MAX_HEADER:
        raise FrameError(f"header length {header_len} outside 1..{MAX_HEADER}")
    if payload_len > MAX_PAYLOAD:
        raise FrameError(f"payload length {payload_len} over the limit {MAX_PAYLOAD}")


def split_keys(n: Any, kt: Any, payload: bytes, most: int = MAX_BATCH_KEYS,
               exact: bool = False) -> tuple[KeyBatch, bytes]:
    """The ``n`` keys of wire type ``kt`` (0: 8-byte ints, 1: 33-byte tagged keys) at
    the start of ``payload``, and the bytes after them (none allowed with ``exact``).

    ``n`` and ``kt`` come straight from a decoded header, so any type is checked.
    Raises ``FrameError`` (INVALID_ARGUMENT) unless ``0 <= n <= most``, ``kt`` is 0 or
    1 and ``payload`` holds the keys, all of them valid.
    """
    if type(n) is not int or not 0 <= n <= most:
        raise FrameError(f"n must be an int in 0..{most} (got {n!r})")
    if type(kt) is not int or kt not in (KT_INT, KT_TAGGED):
        raise FrameError(f"unknown key type {kt!r}")
    size = (8 if kt == KT_INT else TAGGED_ITEMSIZE) * n
    if len(payload) < size or (exact and len(payload) != size):
        raise FrameError(f"keys: expected {size} bytes, got {len(payload)}")
    try:
        keys = KeyBatch.from_wire(kt, payload[:size] if len(payload) > size else payload, n)
    except KeyError_ as exc:
        raise FrameError(f"keys: {exc}") from None
    return keys, payload[size:]


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes, get whole frames.

    After a ``FrameError`` the stream is out of sync and the decoder refuses
    further input; the owner answers once and closes the connection.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """The whole frames completed by ``data`` (which the caller may reuse after).

        With nothing buffered (the usual case: one read, whole requests), frames are
        parsed straight from ``data`` and only an incomplete tail is kept.
        """
        if self._broken:
            raise FrameError("stream already broken")
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray | memoryview = buf
        else:
            src = data
        frames: list[Frame] = []
        pos = 0
        try:
            while True:
                frame, end = self._next(src, pos)
                if frame is None:
                    break
                frames.append(frame)
                pos = end
        except FrameError:
            self._broken = True
            buf.clear()
            raise
        if src is buf:
            del buf[:pos]
        elif pos < len(src):
            buf += src[pos:]
        return frames

    @staticmethod
    def _next(buf: bytes | bytearray | memoryview, pos: int) -> tuple[Frame | None, int]:
        """The frame at ``pos`` of ``buf`` and where it ends, or (None, pos) if incomplete."""
        if len(buf) - pos < PREFIX.size:
            return None, pos
        header_len, payload_len = PREFIX.unpack_from(buf, pos)
        check_lengths(header_len, payload_len)
        start = pos + PREFIX.size
        end = start + header_len + payload_len
        if len(buf) < end:
            return None, pos
        header = decode_header(bytes(buf[start : start + header_len]))
        return Frame(header, bytes(buf[start + header_len : end])), end

    @property
    def buffered(self) -> int:
        return len(self._buf)
