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
from emsd.service import Response, Service, Session
from emsd.transport.frames import Op, Status

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
        self.ns = int(self.call({"op": int(Op.NAMESPACE), "name": ns_name})[0]["ns"])

    def call(self, header: dict[str, Any], payload: bytes = b"") -> Response:
        """One request answered at once (no work with other nodes around it)."""
        answer = self._serve(header, payload)
        if not isinstance(answer, tuple):
            raise SimFailure(f"{Op(header['op']).name} on {self.service.node_id} was not answered at once")
        return self._checked(header, answer)

    async def request(self, header: dict[str, Any], payload: bytes = b"") -> Response:
        """One request, with the work around it that the coordinator does (fetch, forward)."""
        answer = self._serve(header, payload)
        return self._checked(header, answer if isinstance(answer, tuple) else await answer)

    def _serve(self, header: dict[str, Any], payload: bytes) -> Response | Awaitable[Response]:
        self._ids += 1
        header["id"] = self._ids
        return self.coordinator.serve(self.session, header, payload)

    def _checked(self, header: dict[str, Any], answer: Response) -> Response:
        """The answer; an error answer is an invariant failure."""
        resp, _ = answer
        if resp.get("st", 0) != Status.OK:
            raise SimFailure(f"{Op(header['op']).name} on {self.service.node_id} answered "
                             f"{Status(resp['st']).name}: {resp.get('msg')}")
        return answer

    def close(self) -> None:
        self.service.close(self.session)

    async def save(self, keys: list[int], timeout_ms: int, keep: bool = True,
                   die_before_commit: bool = False) -> CallResult:
        """RESERVE, write, COMMIT and the push to the owners (``keep``: write_rcache); the
        COMMIT's budget is what the RESERVE left of ``timeout_ms``, as the SDK's."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        raw = np.array(keys, dtype="<u8").tobytes()
        sizes = np.array([len(content(self.ns_name, k)) for k in keys], dtype="<u8")
        resp, parts = await self.request({"op": int(Op.RESERVE), "ns": self.ns, "n": len(keys), "kt": 0,
                                          "to": timeout_ms}, raw + sizes.tobytes())
        offsets = np.frombuffer(parts[0], dtype="<u8")
        handles = np.frombuffer(parts[1], dtype="<u4")
        status = np.frombuffer(parts[2], dtype=np.uint8)
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
        header = {"op": int(Op.COMMIT), "c": int(new.size), "a": 0, "to": left, "wr": keep}
        payload = handles[new].astype("<u4").tobytes()
        resp, _ = await self.request(header, payload)
        reached = tuple(resp.get("reached", b"\x01" * new.size))
        return CallResult("save", self.service.node_id, tuple(keys), int(resp["committed"]), reached,
                          loop.time() - start, timeout_ms / 1000)

    async def load(self, keys: list[int], timeout_ms: int, keep: bool = True,
                   die_holding_pins: bool = False) -> CallResult:
        """The fetch from the owners, PIN, check every byte, RELEASE (``keep``: write_rcache)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        raw = np.array(keys, dtype="<u8").tobytes()
        header = {"op": int(Op.PIN), "ns": self.ns, "n": len(keys), "kt": 0, "to": timeout_ms, "wr": keep}
        resp, parts = await self.request(header, raw)
        count = int(resp["count"])
        offsets = np.frombuffer(parts[0], dtype="<u8")
        lengths = np.frombuffer(parts[1], dtype="<u8")
        handles = np.frombuffer(parts[2], dtype="<u4")
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
            self.call({"op": int(Op.RELEASE)}, handles.astype("<u4").tobytes())
        return CallResult("load", self.service.node_id, tuple(keys), count, (), elapsed, timeout_ms / 1000)

    async def drain(self, timeout_ms: int) -> tuple[dict[str, Any], CallResult]:
        """DRAIN (emsctl drain): leave the ring and push a batch of owned blocks to their new owners."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        header = {"op": int(Op.DRAIN), "to": timeout_ms}
        resp, _ = await self.request(header)
        return resp, CallResult("drain", self.service.node_id, (), int(resp.get("moved", 0)), (),
                                loop.time() - start, timeout_ms / 1000)
