"""A simulated peer network: ``PeerLink``s that move blocks between pools in one process.

``Network`` knows the live nodes by peer address, which pairs of nodes are
cut off from each other (partitions), and the current fault weather: the
chance that a hop fails (the connection drops), that a reply is lost after
the peer acted on the request, and that a hop is slow (seconds, beyond most
calls' timeouts). Every choice comes from the simulation's one
``random.Random``, so the same seed gives the same faults.

``SimLink`` implements ``emsd.transport.link.PeerLink`` with the semantics
of the TCP transport (``emsd.transport.peer``), hop by hop:

- GET: request hop; the peer pins the leading blocks it has; reply hop (the
  pins held); the caller reserves local chunks; bulk hop; the bytes are
  copied from the peer's pool into the reserved chunks, committed; the
  peer's pins released. Returns the leading count now present locally.
- PUT: request hop; the peer reserves; bulk hop; the bytes are copied from
  the caller's pool (which the caller keeps pinned) and committed; reply
  hop. Returns the peer's leading stored count.

Bytes are copied only at the end of the bulk hop, so a block whose pin was
dropped too early, or whose chunk was handed to another block meanwhile,
arrives wrong and the simulation's byte check sees it. A failed or cancelled
call aborts what it reserved on either side, releases what it pinned and
closes the link, as the link contract (``emsd/transport/link.py``) asks.
Every PUT that lands is logged in ``Network.puts`` for the placement checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from emsd.pool.keys import KeyBatch
from emsd.pool.store import Status
from emsd.transport.owner import BlockOwner
from emsd.transport.peer import PeerError

NEW = int(Status.NEW)
FAILED = int(Status.FAILED)


class Endpoint(Protocol):
    """What the network needs of a simulated node."""

    node_id: str
    service: BlockOwner  # stores, lends and drops blocks, as over a real transport
    pool: memoryview
    alive: bool
    drops: bool  # answers DROP (False: refuses it, as a node of a version without DROP)


@dataclass
class Weather:
    """Fault rates per hop; calm by default."""

    fail: float = 0.0  # the connection drops
    lost_reply: float = 0.0  # the peer acted, the answer never comes
    slow: float = 0.0  # the hop takes ``slow_seconds``
    slow_seconds: tuple[float, float] = (0.5, 8.0)
    latency: tuple[float, float] = (0.0002, 0.003)

    @property
    def calm(self) -> bool:
        return self.fail == 0.0 and self.lost_reply == 0.0 and self.slow == 0.0


@dataclass(frozen=True)
class PutRecord:
    """One PUT that landed: who sent which keys to whom, at what virtual time."""

    at: float
    sender: str
    receiver: str
    ns_name: str
    keys: tuple[int, ...]  # int keys (the simulation uses int keys only)


@dataclass
class Network:
    rng: random.Random
    nodes: dict[str, Endpoint] = field(default_factory=dict)  # peer address -> live node
    cut: set[frozenset[str]] = field(default_factory=set)  # node id pairs that cannot talk
    weather: Weather = field(default_factory=Weather)
    puts: list[PutRecord] = field(default_factory=list)
    hops: int = 0
    moved: dict[str, int] = field(default_factory=lambda: {"get": 0, "put": 0})  # blocks copied

    def attach(self, addr: str, node: Endpoint) -> None:
        self.nodes[addr] = node

    def detach(self, addr: str) -> None:
        self.nodes.pop(addr, None)

    def reachable(self, a: Endpoint, b: Endpoint) -> bool:
        return a.alive and b.alive and frozenset((a.node_id, b.node_id)) not in self.cut

    def partition(self, side: list[str], others: list[str]) -> None:
        self.cut.update(frozenset((x, y)) for x in side for y in others)

    def heal(self) -> None:
        self.cut.clear()
        self.weather = Weather()

    def dialer(self, local: Endpoint) -> SimLink:
        return SimLink(self, local)


class SimLink:
    """One link from ``local`` to a peer over a ``Network`` (the ``PeerLink`` protocol)."""

    def __init__(self, net: Network, local: Endpoint) -> None:
        self.net = net
        self.local = local
        self.remote: Endpoint | None = None
        self.peer_id = ""
        self.last_bytes = 0

    async def connect(self, host: str, port: int, timeout: float = 5.0) -> None:
        addr = f"{host}:{port}"
        remote = self.net.nodes.get(addr)
        if remote is None:
            raise PeerError(f"cannot connect to peer {addr}: connection refused")
        self.remote = remote
        try:
            await asyncio.wait_for(self._hop(), timeout)
        except (TimeoutError, PeerError) as exc:
            self.close()
            raise PeerError(f"cannot connect to peer {addr}: {exc or 'timed out'}") from None
        self.peer_id = remote.node_id

    def close(self) -> None:
        self.remote = None

    @property
    def closed(self) -> bool:
        return self.remote is None

    async def get(self, ns_name: str, keys: KeyBatch) -> int:
        remote = self._ready()
        with self._failing(f"GET from {remote.node_id}"):
            await self._hop()
            server = remote.service
            pinned = server.pin_to_lend(server.namespace_id(ns_name), keys)
            try:
                await self._hop()
                local = self.local.service
                ns = local.namespace_id(ns_name)
                res = local.reserve_arriving(ns, keys.take(slice(0, pinned.count)), pinned.lengths,
                                             copy=True)  # a fetched copy, as PeerConnection.get keeps it
                new = np.flatnonzero(res.status == NEW)
                try:
                    await self._hop()
                except BaseException:
                    local.abort_arriving(res.handles[new])
                    raise
                _copy(remote.pool, pinned.offsets[new], self.local.pool, res.offsets[new],
                      pinned.lengths[new])
                local.commit_arrived(res.handles[new])
                self.net.moved["get"] += int(new.size)
            finally:
                server.release_lent(pinned.handles)
        self.last_bytes = int(pinned.lengths.sum())
        failed = np.flatnonzero(res.status == FAILED)
        return int(failed[0]) if failed.size else pinned.count

    async def exists(self, ns_name: str, keys: KeyBatch) -> int:
        remote = self._ready()
        with self._failing(f"EXISTS at {remote.node_id}"):
            await self._hop()
            server = remote.service
            count = server.present_count(server.namespace_id(ns_name), keys)
            await self._hop(reply=True)
        return count

    async def drop(self, ns_name: str) -> int:
        remote = self._ready()
        with self._failing(f"DROP at {remote.node_id}"):
            await self._hop()
            if not remote.drops:  # refused, as PeerConnection.drop: the link stays up
                await self._hop(reply=True)
                return 0
            remote.service.drop_namespace(ns_name)
            await self._hop(reply=True)
        return 1

    async def put(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray) -> int:
        remote = self._ready()
        with self._failing(f"PUT to {remote.node_id}"):
            await self._hop()
            server = remote.service
            res = server.reserve_arriving(server.namespace_id(ns_name), keys, lengths, copy=False)
            new = np.flatnonzero(res.status == NEW)
            try:
                await self._hop()
            except BaseException:
                server.abort_arriving(res.handles[new])
                raise
            _copy(self.local.pool, offsets[new], remote.pool, res.offsets[new], lengths[new])
            server.commit_arrived(res.handles[new])
            self.net.moved["put"] += int(new.size)
            self.net.puts.append(PutRecord(asyncio.get_running_loop().time(), self.local.node_id,
                                           remote.node_id, ns_name,
                                           tuple(int(k) for k in keys.words[:, 0].tolist())))
            await self._hop(reply=True)
        failed = np.flatnonzero(res.status == FAILED)
        return int(failed[0]) if failed.size else len(keys)

    # -- one hop over the simulated wire -----------------------------------------------

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Close the link when the call inside fails (``PeerError``, renamed "<what> failed")
        or is cancelled, as a real link does: either way it is out of step."""
        try:
            yield
        except PeerError as exc:
            self.close()
            raise PeerError(f"{what} failed: {exc}") from None
        except asyncio.CancelledError:
            self.close()
            raise

    def _ready(self) -> Endpoint:
        if self.remote is None:
            raise PeerError("not connected")
        return self.remote

    async def _hop(self, reply: bool = False) -> None:
        """Wait one hop's latency; raise ``PeerError`` if the link broke on the way."""
        net, w = self.net, self.net.weather
        net.hops += 1
        delay = net.rng.uniform(*w.latency)
        if w.slow and net.rng.random() < w.slow:
            delay += net.rng.uniform(*w.slow_seconds)
        fail = w.fail and net.rng.random() < w.fail
        lost = reply and w.lost_reply and net.rng.random() < w.lost_reply
        await asyncio.sleep(delay)
        remote = self.remote
        if remote is None:
            raise PeerError("link closed")
        if fail or lost or not net.reachable(self.local, remote):
            raise PeerError("reply lost" if lost else "connection dropped")


def _copy(src: memoryview, src_off: np.ndarray, dst: memoryview, dst_off: np.ndarray,
          lengths: np.ndarray) -> None:
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(), strict=True):
        dst[d : d + n] = src[s : s + n]
