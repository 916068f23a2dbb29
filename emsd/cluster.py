"""The daemon's view of its cluster: membership, placement and peer connections.

``Cluster`` ties the parts together for one daemon: it serves its pool to
peers (``PeerServer``), registers and watches members (``ZooKeeperMembership``),
rebuilds the placement ring whenever the view changes (kazoo's thread hands
the view to the event loop with ``call_soon_threadsafe``), and keeps a few
authenticated links per peer (``emsd.transport.link.PeerLink``; a
``SelectingLink`` that moves data over RDMA or TCP per ``cluster.transport``,
see docs/transports.md, unless another ``Dialer`` is given), opened on first use.

``fetch`` brings blocks owned by other nodes into the local pool (they stay
as a read cache); ``push`` sends locally committed blocks to their owners
(every owner, with ``replicas > 1``). A batch for one peer is cut into one
part per link and the parts move in parallel.
Both are bounded by a deadline and turn every peer failure into "not
fetched" / "not pushed": a dead or slow peer costs misses, never a hang.
A peer that failed is left alone for ``BACKOFF`` seconds; a pooled link
that fails is first replaced once by a fresh one (the peer may have
restarted since it was last used).

Seams for the deterministic simulation (tests/sim/): ``membership`` and
``dialer`` may be given instead of ZooKeeper and TCP, ``join()`` joins
without serving peers over TCP, and every deadline and backoff reads the
running event loop's clock (``loop.time()``, which is ``time.monotonic()``
in the default loop), so a loop with a virtual clock makes them virtual.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from emsd.config import ClusterConfig
from emsd.faults import FAULTS
from emsd.membership.base import Membership, MembershipState, NodeInfo
from emsd.membership.zookeeper import ZooKeeperMembership
from emsd.metrics import Metrics
from emsd.placement.agreement import Params, advertised, disagreeing
from emsd.placement.record import NotWritten, Record
from emsd.placement.ring import ClusterView, Member, Ring
from emsd.pool.keys import KeyBatch
from emsd.transport.link import Dialer, PeerLink
from emsd.transport.peer import PEER_PROTOCOL, PeerConnection, PeerError, PeerServer, PoolAccess
from emsd.transport.rdma import RdmaEndpoint, SelectingLink
from emsd.transport.rdma_desc import EXTRA_KEY, DescriptorError, RdmaDescriptor
from emsd.transport.selection import PeerPath, PeerTransports
from emsd.transport.tls import PeerTls

log = logging.getLogger("emsd.cluster")


async def _inject(site: str, conn: PeerLink) -> None:
    """Apply an injected fault at ``site`` (tests only: ``emsd.faults``)."""
    rule = FAULTS.at(site) if FAULTS is not None else None
    if rule is None:
        return
    if rule.action == "delay":
        await asyncio.sleep(rule.seconds)
        return
    if rule.action == "drop":
        conn.close()
    raise PeerError(f"injected fault at {site}: {rule.action}")

BACKOFF = 1.0
PLACEMENT_WRITE_TIMEOUT = 10.0  # seconds emsctl placement set waits for ZooKeeper


def _leading_true(mask: np.ndarray) -> int:
    """Length of the run of True at the start of ``mask``."""
    off = np.flatnonzero(~mask)
    return int(off[0]) if off.size else int(mask.size)


def _now() -> float:
    """The running loop's clock: deadlines and backoffs are measured on it."""
    return asyncio.get_running_loop().time()


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class Cluster:
    def __init__(self, cfg: ClusterConfig, node_id: str, capacity: int, access: PoolAccess,
                 secret: bytes, dialer: Dialer | None = None, metrics: Metrics | None = None,
                 rdma: RdmaEndpoint | None = None, rdma_reason: str = "",
                 membership: Membership | None = None, tls: PeerTls | None = None) -> None:
        """``rdma``: this node's registered RDMA endpoint (owned from now on), or None and why not.
        ``dialer`` and ``membership`` default to TCP (or RDMA) and ZooKeeper (others: tests/sim/).
        ``tls``: mutual TLS on peer connections (``cluster.tls_*``)."""
        self.cfg = cfg
        self.metrics = metrics
        self.rdma = rdma
        self.transports = PeerTransports(cfg.transport, "" if rdma is not None
                                         else rdma_reason or "no RDMA endpoint was opened")
        self.dial: Dialer = dialer or (lambda: SelectingLink(
            PeerConnection(access, node_id, secret, tls, cfg.peer_socket_buffer), rdma, self.transports,
            self._advert, self._report))
        self.node_id = node_id
        self.access = access
        self.secret = secret
        extra = advertised(cfg.vnodes, cfg.replicas, follows_record=membership is None)  # None: ZooKeeper
        if rdma is not None:
            extra[EXTRA_KEY] = rdma.descriptor.to_extra()
        self.me = NodeInfo(node_id, cfg.advertised, capacity, PEER_PROTOCOL, extra)
        control = None if rdma is None else (lambda: rdma.serving(access))
        self.server = PeerServer(access, node_id, secret, control=control, tls=tls,
                                 socket_buffer=cfg.peer_socket_buffer)
        # start() binds peer_listen before joining: a registration with our advertised endpoint
        # that is still alive can only be our own previous process.
        self.membership: Membership = membership or ZooKeeperMembership(
            cfg.zookeeper, cfg.name, self.me, cfg.session_timeout, endpoint_is_mine=True,
            placement=(cfg.vnodes, cfg.replicas))
        self.record: Record | None = None  # the cluster's placement record (ZooKeeper), once read
        self.view: tuple[NodeInfo, ...] = (self.me,)
        self.ring = Ring.build(ClusterView.of([Member(node_id, capacity)]), cfg.vnodes, cfg.replicas)
        self._conns: dict[str, list[PeerLink]] = {}
        self._next: dict[str, int] = defaultdict(int)
        self._down_until: dict[str, float] = {}
        self._dialing: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.draining = False  # left the ring (emsctl drain): owns nothing, serves what it has
        self._down: set[str] = set()  # peers last seen failing (logged once)
        self._fresh: set[PeerLink] = set()  # links dialed and not used yet
        self.disagree: dict[str, Params] = {}  # members whose ring parameters differ (set_view)
        self._disagree_logged: set[tuple[str, Params]] = set()

    async def start(self) -> None:
        """Listen for peers and join; raises ``DuplicateNodeError`` if the id is taken."""
        host, port = _split(self.cfg.peer_listen)
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
        for conns in self._conns.values():
            for conn in conns:
                conn.close()
        self._conns.clear()
        self._fresh.clear()
        await self.server.close()
        if self.rdma is not None:  # after every QP is gone: deregisters the pool
            self.rdma.close()
            self.rdma = None

    @property
    def state(self) -> MembershipState:
        return self.membership.state

    @property
    def params(self) -> Params:
        """(vnodes, replicas) the ring is built with: the cluster's record, else this node's config."""
        return self.record.params if self.record is not None else (self.cfg.vnodes, self.cfg.replicas)

    @property
    def config_differs(self) -> bool:
        """This node's own ``cluster.vnodes``/``replicas`` differ from the record it places keys by."""
        return self.record is not None and self.record.params != (self.cfg.vnodes, self.cfg.replicas)

    def adopt(self, record: Record) -> None:
        """Place keys by the cluster's placement record from now on (``emsd.placement.record``)."""
        if record == self.record:
            return
        before, self.record = self.params, record
        if self.config_differs:
            log.error("placement: this node's config says vnodes=%d replicas=%d, the cluster's record "
                      "vnodes=%d replicas=%d (version %d): using the record; the config is not used",
                      self.cfg.vnodes, self.cfg.replicas, *record.params, record.version)
        if record.params != before:
            log.warning("placement: ring parameters vnodes=%d replicas=%d -> vnodes=%d replicas=%d "
                        "(record version %d)", *before, *record.params, record.version)
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

    def set_view(self, view: tuple[NodeInfo, ...]) -> None:
        """Adopt a membership view: rebuild the ring, drop connections to departed nodes."""
        if self.draining:
            view = tuple(n for n in view if n.node_id != self.node_id)
        if not view:  # even a drained node needs a ring to place keys on: keep itself
            view = (self.me,)
        self.view = view
        self.ring = Ring.build(ClusterView.of(Member(n.node_id, n.capacity) for n in view), *self.params)
        self._check_placement(view)
        present = {n.node_id for n in view}
        for gone in set(self._conns) - present:
            for conn in self._conns.pop(gone):
                conn.close()
                self._fresh.discard(conn)
            self.transports.forget(gone)
        log.info("placement ring: %d members (%s)", len(view), ", ".join(sorted(present)))

    def _check_placement(self, view: tuple[NodeInfo, ...]) -> None:
        """Name the members that place keys otherwise (``emsd.placement.agreement``): in
        ``self.disagree`` (STATS), and in one error line per member and value. Under the
        cluster's record, members that follow it place keys alike whatever their config says:
        only those that do not (older daemons) are compared, with the record's values."""
        mine = self.params
        self.disagree = disagreeing(view, self.node_id, mine, skip_followers=self.record is not None)
        for node, theirs in self.disagree.items():
            if (node, theirs) not in self._disagree_logged:
                self._disagree_logged.add((node, theirs))
                log.error("placement: node %s uses vnodes=%d replicas=%d, this node vnodes=%d replicas=%d: "
                          "they disagree on owners and loads between them miss; set the same "
                          "cluster.vnodes and cluster.replicas on every node", node, *theirs, *mine)

    def owners(self, ns_name: str, keys: KeyBatch) -> np.ndarray:
        """(n, r) owner indices into ``self.ring.view.members``, primary first (r = min(replicas, N))."""
        return self.ring.owners(ns_name, keys)

    def owned_here(self, ns_name: str, keys: KeyBatch) -> np.ndarray:
        """True per key that this node owns (as primary or as a replica)."""
        me = self._my_index()
        if me < 0 or len(keys) == 0:
            return np.full(len(keys), me >= 0 and not self.draining, dtype=bool)
        return (self.owners(ns_name, keys) == me).any(axis=1)

    def owner_ids(self, ns_name: str, keys: KeyBatch) -> list[list[str]]:
        """The owners' node ids of each key, primary first."""
        return self.ring.owner_ids(ns_name, keys)

    def share(self) -> dict[str, float]:
        """Each member's fraction of the hash space (as primary)."""
        return self.ring.share()

    async def leave(self) -> None:
        """Leave the ring for good (drain): deregister, then place nothing here any more."""
        if self.draining:
            return
        self.draining = True
        await asyncio.get_running_loop().run_in_executor(None, self.membership.stop)
        self.set_view(tuple(n for n in self.view if n.node_id != self.node_id))
        log.info("left the ring: new saves and owned blocks go to the other %d members", len(self.view))

    def _alone(self) -> bool:
        """No other node to talk to."""
        return all(m.node_id == self.node_id for m in self.ring.view.members)

    async def fetch(self, ns_name: str, keys: KeyBatch, deadline: float) -> None:
        """Bring keys owned elsewhere into the local pool: batched per owner, parts in parallel.

        The primaries are asked first; keys a primary did not have (a node
        that joined since the save, or restarted) go to the next replica, and
        so on, all within ``deadline``. Every rank uses the ring the fetch
        started with: the view may change while a rank is on the wire.
        """
        if len(keys) == 0 or self._alone():
            return
        ring = self.ring
        owners, me = ring.owners(ns_name, keys), self._my_index(ring)
        pending = np.flatnonzero(~(owners == me).any(axis=1))
        for rank in range(owners.shape[1]):
            if pending.size == 0 or _now() >= deadline:
                return
            missed: list[np.ndarray] = []
            jobs = [self._fetch_part(node, ns_name, keys, part, missed)
                    for node, idx in self._group(ring, owners[pending, rank], pending).items()
                    for part in self._parts(idx)]
            await self._bounded(deadline, *jobs)
            pending = np.sort(np.concatenate(missed)) if missed else pending[:0]

    async def _fetch_part(self, node: str, ns_name: str, keys: KeyBatch, sel: np.ndarray,
                          missed: list[np.ndarray]) -> None:
        """GET ``keys[sel]`` from ``node``; what it did not deliver goes to ``missed``."""
        got = 0
        try:
            got = await self._get(node, ns_name, keys.take(sel))
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
        n = len(keys)
        present = np.asarray(here, dtype=bool).copy()
        if n == 0 or present.all() or self._alone():
            return _leading_true(present)
        ring = self.ring  # every rank uses the ring the call started with
        owners, me = ring.owners(ns_name, keys), self._my_index(ring)
        elsewhere = ~present & ~(owners == me).any(axis=1)
        stop = np.flatnonzero(~present & ~elsewhere)  # owned here and not here: the answer ends there
        limit = int(stop[0]) if stop.size else n
        pending = np.flatnonzero(elsewhere[:limit])
        for rank in range(owners.shape[1]):
            if pending.size == 0 or _now() >= deadline:
                break
            answers: list[tuple[np.ndarray, int]] = []
            jobs = [self._has_part(node, ns_name, keys, idx, answers)
                    for node, idx in self._group(ring, owners[pending, rank], pending).items()]
            await self._bounded(deadline, *jobs)
            for sel, got in answers:
                present[sel[:got]] = True
            pending = pending[~present[pending]]
        return _leading_true(present[:limit])

    async def _has_part(self, node: str, ns_name: str, keys: KeyBatch, sel: np.ndarray,
                        answers: list[tuple[np.ndarray, int]]) -> None:
        got = 0
        try:
            got = await self._on_link(node, "exists", lambda conn: conn.exists(ns_name, keys.take(sel)))
        finally:
            answers.append((sel, got))

    async def drop(self, ns_name: str, deadline: float) -> int:
        """Have every other member of the current view drop namespace ``ns_name``, in parallel,
        within ``deadline``; returns how many did not confirm it (0: all did).

        A node outside the view (down, or not joined yet) is not asked: with a
        warm restart it comes back with the namespace's blocks.
        """
        if self._alone():
            return 0
        others = [m.node_id for m in self.ring.view.members if m.node_id != self.node_id]
        done: list[str] = []

        async def one(node: str) -> None:
            if await self._on_link(node, "drop", lambda conn: conn.drop(ns_name)):
                done.append(node)

        await self._bounded(deadline, *(one(node) for node in others))
        return len(others) - len(done)

    async def push(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray,
                   deadline: float) -> np.ndarray:
        """Send blocks to every other owner; True per key now held by at least one owner.

        A key owned here counts as reached at once; replicas beyond the first
        owner to answer are best effort.
        """
        if len(keys) == 0 or self._alone():
            return np.ones(len(keys), dtype=bool)
        ring = self.ring
        owners, me = ring.owners(ns_name, keys), self._my_index(ring)
        reached = (owners == me).any(axis=1)
        all_keys = np.arange(len(keys))

        async def one(node: str, sel: np.ndarray) -> None:
            stored = await self._put(node, ns_name, keys.take(sel), offsets[sel], lengths[sel])
            reached[sel[:stored]] = True

        jobs = [one(node, part) for rank in range(owners.shape[1])
                for node, idx in self._group(ring, owners[:, rank], all_keys).items()
                for part in self._parts(idx)]
        await self._bounded(deadline, *jobs)
        return reached

    # -- helpers ------------------------------------------------------------------

    def _my_index(self, ring: Ring | None = None) -> int:
        """This node's index in the (current) ring's members; -1 while the view lacks it (ZooKeeper lost)."""
        ids = [m.node_id for m in (ring or self.ring).view.members]
        return ids.index(self.node_id) if self.node_id in ids else -1

    def _group(self, ring: Ring, owner_idx: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """``positions`` grouped by the node id at ``owner_idx`` (same length; indices into the
        members of ``ring``, the ring they were computed with), skipping this node."""
        members = ring.view.members
        return {members[o].node_id: positions[owner_idx == o]
                for o in np.unique(owner_idx).tolist() if members[o].node_id != self.node_id}

    def _parts(self, idx: np.ndarray) -> list[np.ndarray]:
        """A batch for one peer cut into one part per connection, to move in parallel."""
        k = max(1, min(self.cfg.peer_connections, idx.size))
        return [p for p in np.array_split(idx, k) if p.size]

    async def _bounded(self, deadline: float, *jobs: object) -> None:
        if not jobs:
            return
        tasks = [asyncio.ensure_future(job) for job in jobs]  # type: ignore[call-overload]
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

    async def _get(self, node: str, ns_name: str, keys: KeyBatch) -> int:
        return await self._on_link(node, "get", lambda conn: conn.get(ns_name, keys))

    async def _put(self, node: str, ns_name: str, keys: KeyBatch, offsets: np.ndarray,
                   lengths: np.ndarray) -> int:
        stored = await self._on_link(node, "put", lambda conn: conn.put(ns_name, keys, offsets, lengths))
        if self.metrics is not None and stored:
            self.metrics.peer(node, "put", stored, int(lengths[:stored].sum()), True)
        return stored

    async def _on_link(self, node: str, op: str, call: Callable[[PeerLink], Coroutine[Any, Any, int]]) -> int:
        """``call`` on a link to ``node``; 0 if it fails.

        A pooled link that fails is replaced once by a fresh one before the
        peer counts as down: the peer may have restarted since the link's
        last use, and only a new connection reaches its new process (both
        requests are idempotent: blocks are content-addressed).
        """
        conn = await self._conn(node)
        if conn is None:
            return 0
        fresh = conn in self._fresh
        self._fresh.discard(conn)
        got = await self._guard(node, op, conn, call(conn), stale_ok=not fresh)
        if got is not None:
            return got
        conn = await self._conn(node, new=True)  # not another pooled link: it may be as stale
        if conn is None:
            return 0
        self._fresh.discard(conn)
        return await self._guard(node, op, conn, call(conn)) or 0

    async def _guard(self, node: str, op: str, conn: PeerLink, job: Coroutine[Any, Any, int],
                     stale_ok: bool = False) -> int | None:
        """Run ``job`` on ``conn``: what it returns; 0 if it fails, or None with ``stale_ok`` (try anew)."""
        try:
            if FAULTS is not None:
                await _inject(f"peer.{op}", conn)
            got = int(await job)
        except PeerError as exc:
            if stale_ok:
                log.debug("pooled link to %s failed (%s): trying a fresh one", node, exc)
                self._discard(node, conn)
                return None
            self._mark_down(node, str(exc))
            self._drop(node, conn)
            if self.metrics is not None:
                self.metrics.peer(node, op, 0, 0, False)
            return 0
        finally:
            job.close()  # never started when an injected fault or a cancel came first
        self._mark_up(node)
        if self.metrics is not None and op == "get" and got:
            self.metrics.peer(node, op, got, int(getattr(conn, "last_bytes", 0)), True)
        return got

    @property
    def transport_name(self) -> str:
        """"rdma" when this node serves RDMA (peers may still be on TCP), else "tcp"."""
        return "rdma" if self.rdma is not None else "tcp"

    def _advert(self, node: str) -> tuple[RdmaDescriptor | None, str]:
        """``node``'s RDMA descriptor from the view, or (None, why it was rejected)."""
        info = next((n for n in self.view if n.node_id == node), None)
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

    def _mark_down(self, node: str, why: str) -> None:
        """Log a peer going down once, not once per failed request."""
        if node not in self._down:
            self._down.add(node)
            log.warning("peer %s down: %s", node, why)

    def _mark_up(self, node: str) -> None:
        if node in self._down:
            self._down.discard(node)
            log.info("peer %s up again", node)

    async def _conn(self, node: str, new: bool = False) -> PeerLink | None:
        """A connection to ``node`` (round robin over up to peer_connections; ``new``: one dialed
        now, in place of a pooled one the caller has just dropped); None if unreachable."""
        if _now() < self._down_until.get(node, 0.0):
            return None
        info = next((n for n in self.view if n.node_id == node), None)
        if info is None:
            return None
        conns = self._conns.setdefault(node, [])
        # A call cut off by its deadline closed its link (the stream was out of step) without
        # failing: drop such links here, or the next call would fail on one and back off.
        conns[:] = [c for c in conns if not c.closed]
        if new or len(conns) < self.cfg.peer_connections:
            async with self._dialing[node]:  # parallel jobs must not open more than the limit
                if new or len(conns) < self.cfg.peer_connections:
                    return await self._dial(node, info.peer_addr, conns)
        if not conns:  # another job's dial failed while this one waited
            return None
        self._next[node] += 1
        return conns[self._next[node] % len(conns)]

    async def _dial(self, node: str, addr: str, conns: list[PeerLink]) -> PeerLink | None:
        conn = self.dial()
        try:
            await conn.connect(*_split(addr))
        except PeerError as exc:
            self._mark_down(node, str(exc))
            self._down_until[node] = _now() + BACKOFF
            return None
        conns.append(conn)
        self._fresh.add(conn)
        return conn

    def _drop(self, node: str, conn: PeerLink) -> None:
        """Close and forget a failed link; leave the peer alone for ``BACKOFF`` seconds."""
        self._discard(node, conn)
        self._down_until[node] = _now() + BACKOFF

    def _discard(self, node: str, conn: PeerLink) -> None:
        conn.close()
        self._fresh.discard(conn)
        conns = self._conns.get(node, [])
        if conn in conns:
            conns.remove(conn)
