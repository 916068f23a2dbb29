"""The daemon's cluster: membership, placement and the peers, and the requests that fan out to them.

``Cluster`` ties the parts together for one daemon:

- it serves its pool to peers (``emsd.transport.peer.PeerServer``);
- it registers and watches members (``ZooKeeperMembership``; kazoo's thread
  hands each view and placement record to the event loop with
  ``call_soon_threadsafe``) and feeds them to its placement view
  (``emsd.placement.view.PlacementView``: the ring, who disagrees);
- it reaches other daemons through a pool of links
  (``emsd.transport.pool.PeerPool``: dialing, backoff, one retry on a fresh
  link, faults, per-peer metrics), each link a ``SelectingLink`` that moves
  data over RDMA or TCP per ``cluster.transport`` (docs/transports.md),
  unless another ``Dialer`` is given.

What this module adds is the fan-out. ``fetch`` brings blocks owned by
other nodes into the local pool (they stay as a read cache); ``push`` sends
locally committed blocks to their owners (every owner, with
``replicas > 1``); ``exists`` asks owners what they hold; ``drop`` has every
member drop a namespace. A batch for one peer is cut into one part per link
and the parts move in parallel. All are bounded by a deadline and turn every
peer failure into "not fetched" / "not pushed": a dead or slow peer costs
misses, never a hang.

Seams for the deterministic simulation (tests/sim/): ``membership`` and
``dialer`` may be given instead of ZooKeeper and TCP, ``join()`` joins
without serving peers over TCP, and every deadline and backoff reads the
running event loop's clock (``loop.time()``, which is ``time.monotonic()``
in the default loop), so a loop with a virtual clock makes them virtual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from emsd.config import ClusterConfig
from emsd.membership.base import Membership, MembershipState, NodeInfo
from emsd.membership.zookeeper import ZooKeeperMembership
from emsd.metrics import Metrics
from emsd.placement.agreement import advertised
from emsd.placement.record import NotWritten, Record
from emsd.placement.view import PlacementView
from emsd.pool.keys import KeyBatch
from emsd.protocol import readpass
from emsd.protocol.local import RingAnswer
from emsd.tenants import Tenants
from emsd.transport.busypoll import BusyPoll
from emsd.transport.link import Dialer
from emsd.transport.owner import BlockOwner
from emsd.transport.peer import PEER_PROTOCOL, PeerConnection, PeerServer, Promoting
from emsd.transport.pool import BACKOFF, PeerPool, split_endpoint
from emsd.transport.rdma import RdmaEndpoint, SelectingLink
from emsd.transport.rdma_desc import EXTRA_KEY, DescriptorError, RdmaDescriptor
from emsd.transport.selection import PeerPath, PeerTransports
from emsd.transport.tls import PeerTls

log = logging.getLogger("emsd.cluster")

__all__ = ["BACKOFF", "Cluster"]

PLACEMENT_WRITE_TIMEOUT = 10.0  # seconds emsctl placement set waits for ZooKeeper


def _leading_true(mask: np.ndarray) -> int:
    """Length of the run of True at the start of ``mask``."""
    off = np.flatnonzero(~mask)
    return int(off[0]) if off.size else int(mask.size)


def _now() -> float:
    """The running loop's clock: deadlines are measured on it."""
    return asyncio.get_running_loop().time()


class Cluster:
    def __init__(self, cfg: ClusterConfig, node_id: str, capacity: int, owner: BlockOwner,
                 pool: memoryview, secret: bytes, dialer: Dialer | None = None,
                 metrics: Metrics | None = None, rdma: RdmaEndpoint | None = None, rdma_reason: str = "",
                 membership: Membership | None = None, tls: PeerTls | None = None,
                 busy: BusyPoll | None = None, promote: Promoting | None = None) -> None:
        """``owner`` keeps the blocks peers send and fetch (``BlockOwner``: the ``Service``) in
        ``pool`` (the whole region, writable); ``promote`` carries out the disk-tier promotion
        a peer's GET needs (``PeerServer``).
        ``rdma``: this node's registered RDMA endpoint (owned from now on), or None and why not.
        ``dialer`` and ``membership`` default to TCP (or RDMA) and ZooKeeper (others: tests/sim/).
        ``tls``: mutual TLS on peer connections (``cluster.tls_*``). ``busy``: the loop's busy
        poll, which the TCP links then use while they wait for answers (``BusyPoll.awaiting``)."""
        self.cfg = cfg
        self.metrics = metrics
        self.rdma = rdma
        self.transports = PeerTransports(cfg.transport, "" if rdma is not None
                                         else rdma_reason or "no RDMA endpoint was opened")
        self.node_id = node_id
        self.pool = pool  # the whole region (tests/sim reads blocks through it)
        extra = advertised(cfg.vnodes, cfg.replicas, follows_record=membership is None)  # None: ZooKeeper
        if rdma is not None:
            extra[EXTRA_KEY] = rdma.descriptor.to_extra()
        self.me = NodeInfo(node_id, cfg.advertised, capacity, PEER_PROTOCOL, extra)
        self.placement = PlacementView(self.me, (cfg.vnodes, cfg.replicas))
        control = None if rdma is None else (lambda: rdma.serving(owner))
        self.server = PeerServer(owner, pool, node_id, secret, control=control, tls=tls,
                                 socket_buffer=cfg.peer_socket_buffer, promote=promote)
        dial: Dialer = dialer or (lambda: SelectingLink(
            PeerConnection(owner, pool, node_id, secret, tls, cfg.peer_socket_buffer, busy), rdma,
            self.transports, self._advert, self._report))
        self.peers = PeerPool(dial, self._address, cfg.peer_connections, metrics)
        self.on_ring: Callable[[], None] | None = None  # called after every new ring (``emsd.handoff``)
        self.handed: dict[str, float] = {"passes": 0, "moved": 0, "kept": 0, "seconds": 0.0}  # emsd.handoff
        # start() binds peer_listen before joining: a registration with our advertised endpoint
        # that is still alive can only be our own previous process.
        self.membership: Membership = membership or ZooKeeperMembership(
            cfg.zookeeper, cfg.name, self.me, cfg.session_timeout, endpoint_is_mine=True,
            placement=(cfg.vnodes, cfg.replicas))

    def read_ring_offered(self) -> bool:
        """Whether clients may read from the owners now (``read_ring``)."""
        return self.cfg.direct_reads and not self.cfg.tls and not self.placement.alone()

    def read_ring(self, tenant: str) -> RingAnswer | None:
        """The ring and a fresh read pass for a client of ``tenant`` (local op RING), or None
        where clients may not read from the owners themselves: ``direct_reads`` off, TLS peers
        (a client holds no certificate), or no other member to read from."""
        view = self.placement
        if not self.read_ring_offered():
            return None
        ttl = readpass.PASS_TTL
        members = [(m.node_id, m.capacity, m.peer_addr)
                   for m in sorted(view.members, key=lambda m: m.node_id)]
        return RingAnswer(readpass.issue(self.server.secret, tenant, int(time.time()) + ttl), ttl,
                          *view.params, self.node_id, Tenants.qualify(tenant, ""), members)

    async def start(self) -> None:
        """Listen for peers and join; raises ``DuplicateNodeError`` if the id is taken."""
        host, port = split_endpoint(self.cfg.peer_listen)
        await self.server.start(host, port)
        await self.join()

    async def join(self) -> None:
        """Join the membership and follow its view (``start`` without serving peers over TCP)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.membership.start)
        self.membership.on_change(lambda view: self._from_thread(loop, view))
        if isinstance(self.membership, ZooKeeperMembership):  # static members share no record
            if self.membership.record is not None:  # read while joining: the first ring uses it
                self.adopt(self.membership.record)
            self.membership.on_placement(lambda rec: self._record_from_thread(loop, rec))
        self.set_view(self.membership.members())

    def _from_thread(self, loop: asyncio.AbstractEventLoop, view: tuple[NodeInfo, ...]) -> None:
        loop.call_soon_threadsafe(self.set_view, view)

    def _record_from_thread(self, loop: asyncio.AbstractEventLoop, record: Record) -> None:
        loop.call_soon_threadsafe(self.adopt, record)

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.membership.stop)
        self.peers.close()
        await self.server.close()
        if self.rdma is not None:  # after every QP is gone: deregisters the pool
            self.rdma.close()
            self.rdma = None

    @property
    def state(self) -> MembershipState:
        return self.membership.state

    def adopt(self, record: Record) -> None:
        """Place keys by the cluster's placement record (``emsd.placement.record``) from now on."""
        if self.placement.adopt(record):
            self.set_view(self.membership.members())

    @property
    def shares_placement(self) -> bool:
        """The membership keeps a cluster-wide placement record (ZooKeeper; static members do not)."""
        return isinstance(self.membership, ZooKeeperMembership)

    async def set_placement(self, vnodes: int, replicas: int) -> Record:
        """Rewrite the cluster's placement record (``emsctl placement set``); every node's watch,
        this one's included, then adopts it. Raises ``NotWritten``."""
        assert isinstance(self.membership, ZooKeeperMembership)
        write = asyncio.get_running_loop().run_in_executor(
            None, self.membership.set_placement, vnodes, replicas)
        try:
            rec = await asyncio.wait_for(write, PLACEMENT_WRITE_TIMEOUT)
        except TimeoutError:
            raise NotWritten(f"ZooKeeper did not answer in {PLACEMENT_WRITE_TIMEOUT:g} s") from None
        log.warning("placement record set to vnodes=%d replicas=%d (version %d) through this node",
                    *rec.params, rec.version)
        return rec

    def transport_summary(self) -> str:
        """How this node reaches peers, for its start-up line: the transport, and why not RDMA."""
        why = f" ({self.transports.local_reason})" if self.rdma is None else ""
        return self.transport_name + why

    def stats(self) -> dict[str, Any]:
        """STATS' cluster fields: the view, the ring's parameters and who disagrees, transports."""
        p = self.placement
        return {"transport": self.transport_name, "peer_transports": self.transports.snapshot(),
                "share": p.share(), "draining": p.draining,
                "vnodes": p.params[0], "replicas": p.params[1],
                "placement_record": None if p.record is None else p.record.version,
                "placement_config": {"vnodes": self.cfg.vnodes, "replicas": self.cfg.replicas},
                "placement_config_differs": p.config_differs,
                "placement_differs": {node: {"vnodes": v, "replicas": r}
                                      for node, (v, r) in p.disagree.items()},
                "handoff": dict(self.handed),
                "direct_reads": {"offered": self.read_ring_offered(), "served": self.server.reads},
                "view": [{"id": n.node_id, "capacity": n.capacity, "peer": n.peer_addr} for n in p.members]}

    def set_view(self, view: tuple[NodeInfo, ...]) -> None:
        """Adopt a membership view: rebuild the ring, drop the links to departed nodes, then
        tell ``on_ring``."""
        for gone in self.peers.retain(self.placement.update(view)):
            self.transports.forget(gone)
        if self.on_ring is not None:
            self.on_ring()

    async def leave(self) -> None:
        """Leave the ring for good (drain): deregister, then place nothing here any more."""
        if self.placement.draining:
            return
        self.placement.draining = True
        await asyncio.get_running_loop().run_in_executor(None, self.membership.stop)
        self.set_view(self.placement.members)
        log.info("left the ring: new saves and owned blocks go to the other %d members",
                 len(self.placement.members))

    async def fetch(self, ns_name: str, keys: KeyBatch, deadline: float) -> np.ndarray:
        """Bring keys owned elsewhere into the local pool: batched per owner, parts in parallel.
        Returns True per key that other nodes own and this one does not, by the ring the fetch
        used (what it fetched is a read-cache copy here).

        The primaries are asked first; keys a primary did not have (a node
        that joined since the save, or restarted) go to the next replica, and
        so on, all within ``deadline``. Every rank uses the ring the fetch
        started with: the view may change while a rank is on the wire.
        """
        view = self.placement
        if len(keys) == 0 or view.alone():
            return np.zeros(len(keys), dtype=bool)
        ring = view.ring
        owners, me = ring.owners(ns_name, keys), view.my_index(ring)
        elsewhere = ~(owners == me).any(axis=1)
        pending = np.flatnonzero(elsewhere)
        for rank in range(owners.shape[1]):
            if pending.size == 0 or _now() >= deadline:
                break
            missed: list[np.ndarray] = []
            jobs = [self._fetch_part(node, ns_name, keys, part, missed)
                    for node, idx in view.group(ring, owners[pending, rank], pending).items()
                    for part in self._parts(idx)]
            await self._bounded(deadline, *jobs)
            pending = np.sort(np.concatenate(missed)) if missed else pending[:0]
        return elsewhere

    async def _fetch_part(self, node: str, ns_name: str, keys: KeyBatch, sel: np.ndarray,
                          missed: list[np.ndarray]) -> None:
        """GET ``keys[sel]`` from ``node``; what it did not deliver goes to ``missed``."""
        got = 0
        try:
            part = keys.take(sel)
            got = await self.peers.call(node, "get", lambda conn: conn.get(ns_name, part),
                                        moved=lambda conn, _: int(getattr(conn, "last_bytes", 0)))
        finally:
            missed.append(sel[got:])

    async def exists(self, ns_name: str, keys: KeyBatch, here: np.ndarray, deadline: float) -> int:
        """How many leading ``keys`` are held, here (``here``: per key, READY locally) or by their
        owners; no bytes move.

        A key neither here nor owned by another node is absent. The others go
        to their owners, batched per owner, primaries first and then the next
        replica for what a primary lacked, within ``deadline``. An owner that
        does not answer in time counts as not having its keys.
        """
        n, view = len(keys), self.placement
        present = np.asarray(here, dtype=bool).copy()
        if n == 0 or present.all() or view.alone():
            return _leading_true(present)
        ring = view.ring  # every rank uses the ring the call started with
        owners, me = ring.owners(ns_name, keys), view.my_index(ring)
        elsewhere = ~present & ~(owners == me).any(axis=1)
        stop = np.flatnonzero(~present & ~elsewhere)  # owned here and not here: the answer ends there
        limit = int(stop[0]) if stop.size else n
        pending = np.flatnonzero(elsewhere[:limit])
        for rank in range(owners.shape[1]):
            if pending.size == 0 or _now() >= deadline:
                break
            answers: list[tuple[np.ndarray, int]] = []
            jobs = [self._has_part(node, ns_name, keys, idx, answers)
                    for node, idx in view.group(ring, owners[pending, rank], pending).items()]
            await self._bounded(deadline, *jobs)
            for sel, got in answers:
                present[sel[:got]] = True
            pending = pending[~present[pending]]
        return _leading_true(present[:limit])

    async def _has_part(self, node: str, ns_name: str, keys: KeyBatch, sel: np.ndarray,
                        answers: list[tuple[np.ndarray, int]]) -> None:
        got = 0
        try:
            part = keys.take(sel)
            got = await self.peers.call(node, "exists", lambda conn: conn.exists(ns_name, part))
        finally:
            answers.append((sel, got))

    async def drop(self, ns_name: str, deadline: float) -> int:
        """Have every other member of the current view drop namespace ``ns_name``, in parallel,
        within ``deadline``; returns how many did not confirm it (0: all did).

        A node outside the view (down, or not joined yet) is not asked: with a
        warm restart it comes back with the namespace's blocks.
        """
        others = self.placement.others()
        done: list[str] = []

        async def one(node: str) -> None:
            if await self.peers.call(node, "drop", lambda conn: conn.drop(ns_name)):
                done.append(node)

        await self._bounded(deadline, *(one(node) for node in others))
        return len(others) - len(done)

    async def push(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray,
                   deadline: float) -> np.ndarray:
        """Send blocks to every other owner; True per key now held by at least one owner.

        A key owned here counts as reached at once; replicas beyond the first
        owner to answer are best effort.
        """
        view = self.placement
        if len(keys) == 0 or view.alone():
            return np.ones(len(keys), dtype=bool)
        ring = view.ring
        owners, me = ring.owners(ns_name, keys), view.my_index(ring)
        reached = (owners == me).any(axis=1)
        all_keys = np.arange(len(keys))

        async def one(node: str, sel: np.ndarray) -> None:
            part, offs, lens = keys.take(sel), offsets[sel], lengths[sel]
            stored = await self.peers.call(node, "put", lambda conn: conn.put(ns_name, part, offs, lens),
                                           moved=lambda conn, got: int(lens[:got].sum()))
            reached[sel[:stored]] = True

        jobs = [one(node, part) for rank in range(owners.shape[1])
                for node, idx in view.group(ring, owners[:, rank], all_keys).items()
                for part in self._parts(idx)]
        await self._bounded(deadline, *jobs)
        return reached

    # -- helpers ------------------------------------------------------------------

    def _parts(self, idx: np.ndarray) -> list[np.ndarray]:
        """A batch for one peer cut into one part per connection, to move in parallel."""
        k = max(1, min(self.cfg.peer_connections, idx.size))
        if k == 1:  # one key, or one link a peer
            return [idx] if idx.size else []
        return [p for p in np.array_split(idx, k) if p.size]

    async def _bounded(self, deadline: float, *jobs: Coroutine[Any, Any, None]) -> None:
        """Run ``jobs`` side by side until they end or ``deadline`` strikes, then cancel the rest;
        a job's failure is logged (at debug: peers failing mean misses), never raised. One job
        (one peer, one part: a block a call) runs in this task, without a task of its own."""
        if not jobs:
            return
        if len(jobs) == 1:
            try:
                async with asyncio.timeout_at(deadline):
                    await jobs[0]
            except Exception as exc:  # the deadline's TimeoutError included; a cancel goes on up
                log.debug("peer job failed: %s", exc)
            return
        tasks = [asyncio.ensure_future(job) for job in jobs]
        try:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - _now()))
        finally:  # deadline or our own cancellation: stop the rest, and wait until they have
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            if pending:  # a cancelled PUT reads blocks the caller has pinned until its bulk thread
                await asyncio.wait(pending)  # stops, which is at once (the socket is shut down)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.debug("peer job failed: %s", task.exception())

    def _address(self, node: str) -> str | None:
        """``node``'s peer endpoint, while it is a member of the view."""
        info = self.placement.member(node)
        return None if info is None else info.peer_addr

    @property
    def transport_name(self) -> str:
        """"rdma" when this node serves RDMA (peers may still be on TCP), else "tcp"."""
        return "rdma" if self.rdma is not None else "tcp"

    def _advert(self, node: str) -> tuple[RdmaDescriptor | None, str]:
        """``node``'s RDMA descriptor from the view, or (None, why it was rejected)."""
        info = self.placement.member(node)
        if info is None:
            return None, ""
        try:
            return RdmaDescriptor.from_extra(info.extra, info.capacity), ""
        except DescriptorError as exc:
            return None, str(exc)

    def _report(self, node: str) -> None:
        """``node``'s transport changed: log it once and count it."""
        st = self.transports.state(node)
        if st.path is PeerPath.RDMA:
            log.info("peer %s: transport rdma", node)
        elif st.kind in ("config", "no_local_device", "no_advert") and self.cfg.transport != "rdma":
            log.info("peer %s: transport tcp (%s)", node, st.reason)
        else:
            log.warning("peer %s: transport tcp (%s)", node, st.reason)
        if self.metrics is not None:
            self.metrics.transport(node, st.transport, st.kind)
