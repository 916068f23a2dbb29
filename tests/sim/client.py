"""A simulated SDK client: saves and loads through a node's real ``Service`` handlers.

Every request goes through the node's real ``emsd.coordinator.Coordinator``,
as ``emsd/transport/unix.py`` sends a connection's: RESERVE, write the bytes
into the pool, COMMIT (answered once the push to the owners is done); for a
load, PIN (answered once the fetch from the owners is done), read the bytes,
RELEASE; DRAIN for a node leaving the ring. Each call is one
client session, closed at the end (``Service.close``), and a client may
also die half-way (its session closed with reservations or pins held).

Block bytes encode their key: ``content(ns, key)`` is a keyed digest of the
namespace and key repeated to a length that depends on the key, so a load
can check every byte it gets without remembering what was saved.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from emsd.coordinator import Coordinator
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import (
    CommitAnswer,
    CommitRequest,
    NamespaceAnswer,
    NamespaceRequest,
    PinAnswer,
    PinRequest,
    ReleaseRequest,
    ReserveAnswer,
    ReserveRequest,
)
from emsd.service import Response, Service, Session
from emsd.transport.frames import FrameError, Op, Status
from tests import messages

SIZES = (300, 700, 1500, 3000)  # four size classes, all below the simulation's page size


class SimFailure(AssertionError):
    """An invariant broke; the message says which (the simulation adds the seed and step)."""


@lru_cache(maxsize=4096)
def content(ns: str, key: int) -> bytes:
    """The bytes saved under ``key`` in ``ns``: its length and every byte follow from the key."""
    size = SIZES[key % len(SIZES)]
    seed = hashlib.blake2b(f"{ns}/{key}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class CallResult:
    """What one client call did, for the trace and the checks."""

    op: str
    node: str
    keys: tuple[int, ...]
    count: int  # save: blocks committed; load: leading blocks found
    reached: tuple[int, ...]  # save: 1 per committed block that reached an owner
    elapsed: float  # virtual seconds
    timeout: float


class Client:
    """One client connection to one node's ``Service``."""

    def __init__(self, service: Service, ns_name: str) -> None:
        self.service = service
        self.ns_name = ns_name
        self.session = Session()
        self.coordinator = Coordinator(service)
        self._ids = 0
        service.hello(self.session, {"op": int(Op.HELLO)})
        self.ns = NamespaceAnswer.decode(*self.call(Op.NAMESPACE, NamespaceRequest(ns_name))).ns

    def call(self, op: Op, message: messages.Message) -> tuple[dict[str, Any], bytes]:
        """One request answered at once (no work with other nodes around it): the answer's
        header and payload."""
        header, payload = messages.request(op, message)
        answer = self._serve(header, payload)
        if not isinstance(answer, tuple):
            raise SimFailure(f"{op.name} on {self.service.node_id} was not answered at once")
        return self._checked(header, answer)

    async def request(self, op: Op, message: messages.Message) -> tuple[dict[str, Any], bytes]:
        """One request, with the work around it that the coordinator does (fetch, forward)."""
        return await self._requested(*messages.request(op, message))

    async def _requested(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        answer = self._serve(header, payload)
        return self._checked(header, answer if isinstance(answer, tuple) else await answer)

    def _serve(self, header: dict[str, Any], payload: bytes) -> Response | Awaitable[Response]:
        self._ids += 1
        header["id"] = self._ids
        return self.coordinator.serve(self.session, header, payload)

    def _checked(self, header: dict[str, Any], answer: Response) -> tuple[dict[str, Any], bytes]:
        """The answer's header and payload; an error answer is an invariant failure."""
        resp, parts = answer
        if resp.get("st", 0) != Status.OK:
            raise SimFailure(f"{Op(header['op']).name} on {self.service.node_id} answered "
                             f"{Status(resp['st']).name}: {resp.get('msg')}")
        return resp, b"".join(parts)

    def close(self) -> None:
        self.service.close(self.session)

    async def save(self, keys: list[int], timeout_ms: int, keep: bool = True,
                   die_before_commit: bool = False) -> CallResult:
        """RESERVE, write, COMMIT and the push to the owners (``keep``: write_rcache); the
        COMMIT's budget is what the RESERVE left of ``timeout_ms``, as the SDK's."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        sizes = np.array([len(content(self.ns_name, k)) for k in keys], dtype=np.uint64)
        reserve = ReserveRequest(self.ns, KeyBatch.from_user(keys), sizes, to=timeout_ms)
        offsets, handles, status = ReserveAnswer.decode(*await self.request(Op.RESERVE, reserve), len(keys))
        new = np.flatnonzero(status == 0)
        pool = self.service.cluster.pool if self.service.cluster else None
        assert pool is not None
        for i in new.tolist():
            data = content(self.ns_name, keys[i])
            off = int(offsets[i])
            pool[off : off + len(data)] = data
        if die_before_commit:
            return CallResult("save-died", self.service.node_id, tuple(keys), 0, (), 0.0, timeout_ms / 1000)
        left = max(1, int((start + timeout_ms / 1000 - loop.time()) * 1000))  # as the SDK sends it
        resp, payload = await self.request(Op.COMMIT, CommitRequest(handles[new], wr=keep, to=left))
        try:
            committed = CommitAnswer.decode(resp, payload, new.size)
        except FrameError as exc:  # e.g. a reached of the wrong size
            raise SimFailure(f"COMMIT on {self.service.node_id} answered {resp!r}: {exc}") from None
        reached = tuple(committed.reached if committed.reached is not None else b"\x01" * new.size)
        return CallResult("save", self.service.node_id, tuple(keys), committed.committed, reached,
                          loop.time() - start, timeout_ms / 1000)

    async def load(self, keys: list[int], timeout_ms: int, keep: bool = True,
                   die_holding_pins: bool = False, bring: int | None = None) -> CallResult:
        """The fetch from the owners, PIN, check every byte, RELEASE (``keep``: write_rcache;
        ``bring``: at most that many keys fetched, ``PinRequest.bring``)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        pin = PinRequest(self.ns, KeyBatch.from_user(keys), wr=keep, to=timeout_ms, bring=bring)
        offsets, lengths, handles, _ = PinAnswer.decode(*await self.request(Op.PIN, pin), len(keys))
        count = len(handles)
        assert self.service.cluster is not None
        pool = self.service.cluster.pool
        for i in range(count):
            want = content(self.ns_name, keys[i])
            off, n = int(offsets[i]), int(lengths[i])
            got = bytes(pool[off : off + n])
            if got != want:
                raise SimFailure(f"wrong bytes: load of key {keys[i]} on {self.service.node_id} returned "
                                 f"{n} bytes that differ from the {len(want)} saved under it")
        elapsed = loop.time() - start
        if not die_holding_pins and count:
            self.call(Op.RELEASE, ReleaseRequest(handles))
        return CallResult("load", self.service.node_id, tuple(keys), count, (), elapsed, timeout_ms / 1000)

    async def drain(self, timeout_ms: int) -> tuple[dict[str, Any], CallResult]:
        """DRAIN (emsctl drain): leave the ring and push a batch of owned blocks to their new owners."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        resp, _ = await self._requested({"op": int(Op.DRAIN), "to": timeout_ms}, b"")  # header only
        return resp, CallResult("drain", self.service.node_id, (), int(resp.get("moved", 0)), (),
                                loop.time() - start, timeout_ms / 1000)
