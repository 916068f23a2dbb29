"""Request handling: decoded control frames in, responses out (sans-I/O).

``Service.handle`` takes one request of one client ``Session`` and returns
the response header and payload. It never awaits and never touches a socket,
so the transport (``emsd.transport.unix``) stays a thin shell and the whole
protocol can be driven from tests without a process. Work with other nodes
around a request (a PIN's fetch first, a COMMIT's forward after) is named by
``remote_fetch`` and ``follow_up`` and carried out by ``emsd.coordinator``.

A ``Session`` is what the daemon knows of one client connection: its tenant,
the namespaces it opened, the reservations it has not committed yet and the
pins it holds. Handles sent by a client are checked against its own session,
so one client can never commit, abort or release another's blocks. When the
connection closes, ``Service.close`` aborts its reservations and drops its
pins: a client killed mid-save or mid-load leaks nothing.

Requests are decoded and answers encoded through ``emsd.protocol.local``, whose
docstring holds the layouts of every op; a request it refuses (``FrameError``) is
answered with its status like a ``RequestError``, and the connection stays.

Grants are bounded: a connection holds at most 1/``GRANT_SESSION_SHARE`` of the
pool, all connections together 1/``GRANT_TOTAL_SHARE``; a GRANT past either bound
gets fewer chunks (the SDK then saves with RESERVE and COMMIT). A closed
connection's grants go back to the pool.

Uncommitted bytes are bounded too (issue 25): a connection holds at most
``connection_uncommitted`` bytes reserved and granted (``pool.connection_uncommitted``,
default half the pool), and a tenant's quota counts its committed bytes plus its
connections' reserved and granted ones (``_quota_held``; ``handle`` keeps the
per-tenant total from each session's ``uncommitted`` with integer arithmetic).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import select
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from emsd.faults import FAULTS
from emsd.logs import Once
from emsd.metrics import Metrics
from emsd.placement import record as placement_record

if TYPE_CHECKING:
    from emsd.cluster import Cluster
    from emsd.tier.stack import TierStack
from emsd.pool.checksum import Checksums
from emsd.pool.index import FIRST_ID, READY
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Pinned
from emsd.pool.store import Status as SlotStatus
from emsd.protocol.local import (
    CommitAnswer,
    CommitRequest,
    CountAnswer,
    DropAnswer,
    DropRequest,
    ExistsRequest,
    GrantAnswer,
    GrantRequest,
    NamespaceAnswer,
    NamespaceRequest,
    OwnerAnswer,
    OwnerRequest,
    PinAnswer,
    PinRequest,
    PlacementRequest,
    PutAnswer,
    PutRequest,
    ReleaseRequest,
    ReserveAnswer,
    ReserveRequest,
    TouchRequest,
)
from emsd.tenants import DEFAULT as DEFAULT_TENANT
from emsd.tenants import PREFIX as TENANT_PREFIX
from emsd.tenants import Tenants
from emsd.transport.frames import MAX_BATCH_KEYS, PROTOCOL_VERSION, FrameError, Op, Status, split_keys

log = logging.getLogger("emsd.service")

MAX_NAMESPACES_PER_SESSION = 1024
MAX_NAMESPACES_PER_TENANT = 1024  # default tenants.max_namespaces
FREED = "\0free"  # the name of a namespace id freed for reuse (_free_unused)
RETIRED = "\0dropped"  # the ledger's name for a dropped namespace id (see drop_namespace)
DRAIN_BATCH = 256  # blocks pushed per step of a drain
# Slot statuses as numpy scalars: comparing an array with one skips the enum's slow lookup.
_NEW, _FAILED, _PRESENT = (np.uint8(st) for st in (SlotStatus.NEW, SlotStatus.FAILED, SlotStatus.PRESENT))
GRANT_SESSION_SHARE = 64  # a connection holds at most 1/64 of the pool in granted chunks
GRANT_TOTAL_SHARE = 16  # all connections together at most 1/16
CONNECTION_UNCOMMITTED_SHARE = 2  # default pool.connection_uncommitted: half the pool


class RequestError(Exception):
    """A request the daemon refuses; ``status`` is the code to answer with."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    """One client connection's state."""

    peer_pid: int = 0
    authenticated: bool = False
    namespaces: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    pins: Counter[int] = field(default_factory=Counter)
    tenant: str = DEFAULT_TENANT  # who the HELLO proved to be
    fetched: set[int] = field(default_factory=set)  # copies fetched for the PIN being handled
    transient: set[int] = field(default_factory=set)  # pinned copies to drop on release (wr off)
    parsed: tuple[bytes, tuple[Any, Any, Any], tuple[int, KeyBatch, bytes]] | None = None  # Service._keys
    granted: dict[int, int] = field(default_factory=dict)  # byte offset -> chunk size, chunks granted
    granted_bytes: int = 0
    pending_bytes: int = 0  # block lengths of ``pending``
    put: np.ndarray | None = None  # entries the PUT being handled committed (for forward_commit)
    copies: tuple[int, KeyBatch] | None = None  # keys the save being handled found here as copies
    closed: bool = False  # Service.close has released what it held

    @property
    def uncommitted(self) -> int:
        """Bytes this connection holds that no quota counted as committed: pending and granted."""
        return self.pending_bytes + self.granted_bytes

    def forget_grants(self, offsets: list[int]) -> None:
        """Chunks ``offsets``, granted to this session, are its no more (used for a block, or
        given back to the store by the caller)."""
        for o in offsets:
            self.granted_bytes -= self.granted.pop(o)


Response = tuple[dict[str, Any], list[bytes]]


class Service:
    """The daemon's request handlers over one ``BlockStore``."""

    def __init__(self, store: BlockStore, node_id: str, region_kind: str, metrics: Metrics,
                 tenants: Tenants | None = None) -> None:
        self.store = store
        self.checksums: Checksums | None = None  # set when pool.checksum is on
        self.grants = True  # pool.grants: GRANT hands out chunks (else it is refused)
        self.tenants = tenants or Tenants([])
        self._tenant_ns: dict[str, set[int]] = {}  # namespaces of each tenant (for quotas)
        self._uncommitted: dict[str, int] = {}  # tenant -> its sessions' pending + granted bytes
        # tenant -> the slab group whose pages hold its blocks (``emsd.pool.tenancy``; 0: the
        # pool's own memory, everyone's without tenants)
        self.tenant_group: Callable[[str], int] = lambda tenant: 0
        self.sparse = False  # clients map a memfd holding their tenant's pages only (HELLO says so)
        self.connection_uncommitted = store.capacity // CONNECTION_UNCOMMITTED_SHARE  # pool.*
        self.node_id = node_id
        self.region_kind = region_kind
        self.metrics = metrics
        self._ns_ids: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._retired: dict[int, int] = {}  # dropped namespace id -> the id its name has now
        self.max_namespaces = MAX_NAMESPACES_PER_TENANT  # tenants.max_namespaces
        self._ns_open: Counter[int] = Counter()  # namespace id -> sessions that opened it
        self._free_ids: list[int] = []  # freed namespace ids, a heap: the lowest is reused first
        self._may_free: set[str] = set()  # tenants with a session closed since _free_unused looked
        # (pidfd, what it held) of connections closed for silence whose process lives on: their
        # reservations and grants stay out of use until it exits (close, release_quarantined)
        self._quarantined: list[tuple[int, Session]] = []
        self._unkept = Once(60.0)  # "namespace will not survive a restart", at most once a minute
        self.started = time.time()
        self.cluster: Cluster | None = None  # set when the node runs in a cluster
        self.tiers: TierStack | None = None  # set when the disk tier is on ([disk])
        self.prefault: Callable[[], dict[str, Any]] | None = None  # background prefault's progress
        self.info: dict[str, Any] = {}  # start-up facts STATS reports (restart outcome, metrics address)
        self.sessions = 0  # connections past HELLO
        self._pressure = Once(60.0)  # "evicting under pressure", at most once a minute

    # -- entry points ---------------------------------------------------------

    def hello(self, session: Session, header: dict[str, Any]) -> dict[str, Any]:
        """Authenticate a new connection (single tenant until tenants are configured)."""
        if header.get("op") != Op.HELLO:
            raise RequestError(Status.INVALID_ARGUMENT, "the first request must be HELLO")
        pid = header.get("pid", 0)
        session.peer_pid = pid if type(pid) is int else 0
        tenant = self.tenants.authenticate(header.get("access_id"), header.get("access_key"))
        if tenant is None:
            log.warning("refused client pid %s: unknown tenant %r or wrong access key",
                        session.peer_pid, str(header.get("access_id"))[:64])
            raise RequestError(Status.INVALID_ARGUMENT, "unknown tenant or wrong access key")
        session.tenant = tenant
        session.authenticated = True
        self.sessions += 1
        info = {"node": self.node_id, "pool_size": self.store.stats().capacity,
                "region": self.region_kind, "server_pid": os.getpid(), "grants": self.grants,
                "sparse": self.sparse, "page": self.store.page_size}
        if header.get("idx") is True and self.store.shared is not None:
            info["idx"] = self.store.shared.size  # its fd follows the pool's
        return info

    def handle(self, session: Session, header: dict[str, Any], payload: bytes) -> Response:
        """Answer one request; never raises for bad input (answers with a status)."""
        op = header.get("op")
        start = time.perf_counter()
        name = _op_name(op)
        try:
            handler = self._handlers.get(op) if type(op) is int else None  # type: ignore[call-overload]
            if handler is None:
                raise RequestError(Status.INVALID_ARGUMENT, f"unknown op {op!r}")
            held = session.uncommitted
            try:
                resp, parts = handler(self, session, header, payload)
            finally:
                if session.uncommitted != held:  # RESERVE, COMMIT, GRANT, PUT: the tenant's total follows
                    self._hold(session.tenant, session.uncommitted - held)
            resp.setdefault("st", Status.OK)
            result = "ok"
        except (RequestError, FrameError) as exc:  # a refused request; the connection stays
            resp, parts, result = {"st": int(exc.status), "msg": str(exc)}, [], "error"
        except Exception:  # a bug must not take the daemon down; say so loudly
            log.exception("internal error handling %s", name)
            resp, parts, result = {"st": int(Status.INTERNAL), "msg": "internal error"}, [], "error"
        self.metrics.observe_op(name, result, time.perf_counter() - start)
        resp["v"] = PROTOCOL_VERSION
        resp["id"] = header.get("id", 0)
        return resp, parts

    def close(self, session: Session, expired: bool = False) -> None:
        """Release everything a closed connection held.

        ``expired``: the connection was closed for silence (``node.client_lease``) while its
        process may live on, stopped or hung. Its pins go now (a read it resumes fails at its
        RELEASE, so it never uses what it copied), but the chunks it may still write into (its
        reservations and granted chunks) stay out of use until that process has exited
        (``release_quarantined``): a client that resumes must not write into a chunk that holds
        another block by then.
        """
        session.closed = True
        if expired and (session.pending or session.granted):
            self._quarantine(session)
        if session.authenticated:
            session.authenticated = False
            self.sessions -= 1
        self._hold(session.tenant, -session.uncommitted)
        if session.pending:
            self.store.abort(np.fromiter(session.pending, dtype=np.uint32))
            session.pending.clear()
            session.pending_bytes = 0
        if session.granted:
            self.store.ungrant(np.fromiter(session.granted, dtype=np.uint64))
            session.granted.clear()
            session.granted_bytes = 0
        if session.pins:
            held = np.repeat(
                np.fromiter(session.pins.keys(), dtype=np.uint32),
                np.fromiter(session.pins.values(), dtype=np.int64),
            )
            self.store.release(held)
            session.pins.clear()
        self._drop_transient(session, session.transient)
        if session.namespaces:
            self._ns_open.subtract(session.namespaces)
            self._may_free.add(session.tenant)
            session.namespaces.clear()

    def _quarantine(self, session: Session) -> None:
        """Move ``session``'s reservations and grants aside until its process exits."""
        try:
            pidfd = os.pidfd_open(session.peer_pid)
        except (OSError, ValueError):  # gone already (or no pid): nothing can write any more
            return
        kept = Session(peer_pid=session.peer_pid, tenant=session.tenant, pending=session.pending,
                       granted=session.granted, granted_bytes=session.granted_bytes,
                       pending_bytes=session.pending_bytes)
        session.pending, session.granted = set(), {}
        session.granted_bytes = session.pending_bytes = 0
        self._quarantined.append((pidfd, kept))

    def release_quarantined(self) -> int:
        """Release what expired connections of processes that have exited since kept out of
        use; returns how many connections' worth. Call now and then (the lease sweep does)."""
        done = 0
        for pidfd, kept in list(self._quarantined):
            exited, _, _ = select.select([pidfd], [], [], 0)
            if exited:
                self._quarantined.remove((pidfd, kept))
                os.close(pidfd)
                self.close(kept)
                done += 1
        return done

    # -- cluster hooks (async work around a synchronous handler) ----------------

    def remote_fetch(self, session: Session, header: dict[str, Any],
                     payload: bytes) -> Awaitable[None] | None:
        """For a PIN whose keys are not all here: promoting the next ones from the disk tier,
        then fetching the rest from their owners.

        The transport awaits it, then handles the PIN as usual (the fetched
        blocks are local by then, kept as read cache). None: nothing to fetch
        (standalone without a disk tier, ``lo`` = read_local_only without one,
        all present, or a bad request that the synchronous handler will refuse).
        """
        remote = self.cluster is not None and not header.get("lo")
        if header.get("op") != Op.PIN or not (remote or self.tiers is not None):
            return None
        try:
            ns, keys, _ = self._keys(session, header, payload)
        except RequestError:
            return None
        count = self.store.exists(ns, keys)
        if count == len(keys):
            return None
        deadline = _now() + _timeout(header)
        keep = header.get("wr", True) is not False
        if self.tiers is not None and self.tiers.wanted(ns, keys, count):
            return self._promote(session, ns, keys, count, deadline, keep if remote else None)
        if not remote:
            return None
        return self._fetch(session, ns, keys.take(slice(count, None)), deadline, keep)

    async def _promote(self, session: Session, ns: int, keys: KeyBatch, count: int, deadline: float,
                       keep: bool | None) -> None:
        """Blocks from the disk tier, then (``keep`` not None: in a cluster) the rest from owners."""
        assert self.tiers is not None
        await self.tiers.promote(ns, keys, count, deadline)
        count = self.store.exists(ns, keys)
        if keep is not None and count < len(keys) and _now() < deadline:
            await self._fetch(session, ns, keys.take(slice(count, None)), deadline, keep)

    async def _fetch(self, session: Session, ns: int, keys: KeyBatch, deadline: float, keep: bool) -> None:
        """Fetch ``keys`` from their owners; copies stay as read cache, or (``keep`` off) until released."""
        assert self.cluster is not None
        name = self.namespace_name(ns)
        before = None if keep else self.store.index.find(ns, keys)
        await self.cluster.fetch(name, keys, deadline)
        remote = self._remote(name, keys)
        self.store.mark_cached(ns, keys if remote.all() else keys.take(remote))
        if before is not None:
            after = self.store.index.find(ns, keys)
            new = (after != before) & (after >= FIRST_ID) & remote
            session.fetched = set(after[new].tolist())

    def follow_up(self, session: Session, header: dict[str, Any], payload: bytes,
                  resp: dict[str, Any]) -> Awaitable[dict[str, Any]] | None:
        """Asynchronous work that completes a handled request before it is answered, or None.

        COMMIT or PUT in a cluster: forward the blocks to their owners. A RESERVE or
        PUT that found keys here only as read-cache copies: check that their owners still
        hold them (``_refresh_owners``). EXISTS that did not find every key here: ask the
        owners of the rest. DRAIN: leave the ring and move a batch of owned blocks. DROP:
        the other members drop the namespace too.
        """
        copies, session.copies = session.copies, None
        if self.cluster is None or resp.get("st"):
            return None
        op = header.get("op")
        if op == Op.DRAIN:
            return self._drain_batch(_now() + _timeout(header), resp)
        if op == Op.DROP:
            return self._drop_elsewhere(header, resp)
        if op == Op.PLACEMENT:
            return self._set_placement(header, resp)
        if op == Op.EXISTS and not header.get("lo") and resp.get("count", 0) < header.get("n", 0):
            return self._exists_remote(session, header, payload, resp)
        forward = self.forward_commit(header, payload, resp, session)
        if copies is None:
            return forward
        return self._refresh_owners(copies, _now() + _timeout(header), forward, resp)

    async def _refresh_owners(self, copies: tuple[int, KeyBatch], deadline: float,
                              forward: Awaitable[dict[str, Any]] | None,
                              resp: dict[str, Any]) -> dict[str, Any]:
        """A save (RESERVE or PUT) that found keys here only as read-cache copies: after its own
        forward (``forward``), ask their owners whether they still hold them (no bytes move) and
        push the copies from the first one they lack (an owner that restarted cold or evicted
        them gets them back). Best effort within ``deadline``: the answer does not change."""
        assert self.cluster is not None
        if forward is not None:
            resp = await forward
        ns, keys = copies
        name = self.namespace_name(ns)
        held = await self.cluster.exists(name, keys, np.zeros(len(keys), dtype=bool), deadline)
        if held == len(keys) or _now() >= deadline:
            return resp
        pinned = self.pin_checked(ns, keys.take(slice(held, None)))
        try:
            got = await self.cluster.push(name, keys.take(slice(held, held + pinned.count)),
                                          pinned.offsets, pinned.lengths, deadline)
        finally:
            self.store.release(pinned.handles)
        log.debug("a save found %d copies whose owners lacked %d: %d pushed", len(keys),
                  len(keys) - held, int(np.count_nonzero(got)))
        return resp

    async def _exists_remote(self, session: Session, header: dict[str, Any], payload: bytes,
                             resp: dict[str, Any]) -> dict[str, Any]:
        """Extend an EXISTS answer with the keys other nodes hold (nothing moves, nothing pinned)."""
        assert self.cluster is not None
        ns, keys, _ = self._keys(session, header, payload)
        here = self.store.present(ns, keys) if self.tiers is None else self.tiers.present(ns, keys)
        resp["count"] = await self.cluster.exists(self.namespace_name(ns), keys, here,
                                                  _now() + _timeout(header))
        return resp

    async def _set_placement(self, header: dict[str, Any], resp: dict[str, Any]) -> dict[str, Any]:
        """Rewrite the cluster's placement record (checked by ``_placement``); every node's watch
        then rebuilds its ring. Answers the new record."""
        assert self.cluster is not None
        try:
            rec = await self.cluster.set_placement(int(header["vnodes"]), int(header["replicas"]))
        except placement_record.NotWritten as exc:
            resp.update(st=int(Status.IO_ERROR), msg=f"the placement record was not written: {exc}")
            return resp
        resp.update(vnodes=rec.vnodes, replicas=rec.replicas, version=rec.version)
        return resp

    async def _drop_elsewhere(self, header: dict[str, Any], resp: dict[str, Any]) -> dict[str, Any]:
        """A DROP done here: the other members of the view drop the namespace too; ``missed``
        counts those that did not answer in time (their blocks may still be found)."""
        assert self.cluster is not None
        name = self.namespace_name(self._live(int(header["ns"])))
        resp["missed"] = await self.cluster.drop(name, _now() + _timeout(header))
        return resp

    async def _drain_batch(self, deadline: float, resp: dict[str, Any]) -> dict[str, Any]:
        """Leave the ring, then push owned blocks (oldest namespaces first) until the deadline.

        Each pushed block becomes a read-cache copy here; ``remaining`` counts
        the owned blocks still to move, ``moved`` those that reached an owner
        in this call, ``failed`` those no owner took.
        """
        assert self.cluster is not None
        await self.cluster.leave()
        moved = failed = 0
        idx = self.store.index
        while _now() < deadline:
            owned = self._owned_here()
            if owned.size == 0:
                break
            ns = int(idx.nstag[owned[0]] >> 8)
            batch = owned[(idx.nstag[owned] >> 8) == ns][:DRAIN_BATCH]
            keys = idx.keys_of(batch)
            pinned = self.pin_checked(ns, keys)
            try:
                got = await self.cluster.push(self.namespace_name(ns), keys.take(slice(0, pinned.count)),
                                              pinned.offsets, pinned.lengths, deadline)
            finally:
                self.store.release(pinned.handles)
            self.store.mark_cached(ns, keys)  # moved or not: this node owns nothing now
            moved += int(np.count_nonzero(got))
            failed += len(keys) - int(np.count_nonzero(got))
        remaining = int(self._owned_here().size)
        resp.update(moved=moved, failed=failed, remaining=remaining)
        log.info("drain: %d blocks moved, %d not taken, %d to go", moved, failed, remaining)
        return resp

    def _owned_here(self) -> np.ndarray:
        """Ids of the READY blocks this node owns (not read-cache copies) in live namespaces:
        what a drain moves (a dropped namespace's leftovers must not reach another node)."""
        idx = self.store.index
        hw = idx.high_water
        owned = np.flatnonzero((idx.state[:hw] == READY) & (idx.cached[:hw] == 0)).astype(np.uint32)
        if self._retired:
            owned = owned[~np.isin(idx.ns_of(owned), list(self._retired))]
        return owned

    def forward_commit(self, header: dict[str, Any], payload: bytes, resp: dict[str, Any],
                       session: Session | None = None) -> Awaitable[dict[str, Any]] | None:
        """For a COMMIT or a PUT in a cluster: send the committed blocks to their owners.

        The answer gains ``reached``: one byte per committed handle (COMMIT) or
        NEW key (PUT, whose handles its handler left in ``session.put``), 1 when
        the block is now at its owner (or is owned here). With ``wr`` false
        (write_rcache off) the local copies of blocks that reached another
        owner are dropped.
        """
        op = header.get("op")
        if self.cluster is None or resp.get("st") or op not in (Op.COMMIT, Op.PUT):
            return None
        if op == Op.PUT:
            handles = session.put if session is not None else None
            if handles is None or handles.size == 0:
                return None
        else:
            nc = header.get("c", 0)
            if not nc:
                return None
            handles = np.frombuffer(payload, dtype="<u4", count=nc).astype(np.uint32)
        resp["reached"] = bytes(handles.size)  # what the answer says if forwarding fails outright
        return self._push(handles, bool(header.get("wr", True)), _now() + _timeout(header), resp)

    async def _push(self, handles: np.ndarray, keep: bool, deadline: float,
                    resp: dict[str, Any]) -> dict[str, Any]:
        assert self.cluster is not None
        reached = np.zeros(handles.size, dtype=np.uint8)
        nss = self.store.index.ns_of(handles)
        for ns in np.unique(nss).tolist():
            if ns in self._retired:  # reserved before a drop: not pushed, not "reached"
                continue
            sel = np.flatnonzero(nss == ns)
            keys = self.store.index.keys_of(handles[sel])
            pinned = self.pin_checked(ns, keys)  # hold them while they are sent
            try:
                got = await self.cluster.push(self.namespace_name(ns), keys.take(slice(0, pinned.count)),
                                              pinned.offsets, pinned.lengths, deadline)
            finally:
                self.store.release(pinned.handles)
            reached[sel[: pinned.count]] = got
            sent = keys.take(slice(0, pinned.count))
            moved = sent.take(np.flatnonzero(got & self._remote(self.namespace_name(ns), sent)))
            if keep:
                self.store.mark_cached(ns, moved)  # now a read-cache copy of the owner's block
            else:
                self.store.discard(ns, moved)
        resp["reached"] = reached.tobytes()
        return resp

    def _remote(self, ns_name: str, keys: KeyBatch) -> np.ndarray:
        """True per key that other nodes own and this one does not (its copy is a read cache)."""
        assert self.cluster is not None
        return ~self.cluster.placement.owned_here(ns_name, keys)

    # -- handlers -------------------------------------------------------------

    def restore_namespaces(self, names: dict[int, str]) -> None:
        """Take back the namespace ids of a warm restart (ids without a name stay unused).

        Ids dropped before the restart (``drop_namespace``: named ``RETIRED`` in
        the ledger) stay unreachable and their blocks are evicted now.
        """
        top = max(names, default=-1) + 1
        self._ns_names = [names.get(ns, f"\0unnamed-{ns}") for ns in range(top)]
        live = {ns: name for ns, name in names.items() if name != RETIRED}
        self._ns_ids = {name: ns for ns, name in live.items()}
        for ns, name in live.items():
            self._name(ns, name)
        gone = self.store.drop_namespaces([ns for ns in names if ns not in live])
        if gone:
            log.info("warm restart: %d blocks of dropped namespaces evicted", gone)
        in_use = self.store.namespaces_in_use()  # a dropped id's pinned blocks are gone after a restart
        self._free_ids = [ns for ns in range(top) if ns not in live and ns not in in_use]
        for ns in self._free_ids:
            self._ns_names[ns] = FREED

    def namespace_id(self, name: str) -> int:
        """The local id of namespace ``name``, created on first use (ids are per daemon)."""
        ns = self._ns_ids.get(name)
        if ns is None:
            ns = heapq.heappop(self._free_ids) if self._free_ids else len(self._ns_names)
            ledger = self.store.ledger
            if ledger is not None and not ledger.add_namespace(ns, name) and self._unkept.due():
                log.warning("namespace %d (%d bytes of name) will not survive a restart (nor may others "
                            "for a minute: this is said once a minute)", ns, len(name))
            self._ns_ids[name] = ns
            if ns < len(self._ns_names):
                self._ns_names[ns] = name
            else:
                self._ns_names.append(name)
            self._name(ns, name)
        return ns

    def _name(self, ns: int, name: str) -> None:
        """Namespace ``ns`` is ``name``: its tenant's, on its tenant's pages, with the admission
        threshold its name gives."""
        tenant = Tenants.tenant_of(name)
        self._tenant_ns.setdefault(tenant, set()).add(ns)
        self.store.set_group(ns, self.tenant_group(tenant))
        self.store.name_namespace(ns, name)

    def namespace_name(self, ns: int) -> str:
        return self._ns_names[ns]

    def drop_namespace(self, name: str) -> int:
        """Retire namespace ``name`` on this node: from now on nothing finds its blocks.

        The name gets a new, empty id; requests naming the old id (sessions
        opened before) go to the new one, so a load after the drop misses and
        a save stores afresh. The old id's READY, unpinned blocks are evicted
        now (returns how many); blocks pinned by a load in flight, or still
        being written by a save that reserved before the drop, stay under the
        old id, unreachable, until they are evicted like any other. A name
        never opened here has nothing to drop (0).
        """
        old = self._ns_ids.pop(name, None)
        if old is None:
            return 0
        new = self.namespace_id(name)
        for gone, now in self._retired.items():
            if now == old:
                self._retired[gone] = new
        self._retired[old] = new
        ledger = self.store.ledger
        if ledger is not None:
            ledger.add_namespace(old, RETIRED)  # a warm restart must not bring its blocks back
        dropped = self.store.drop_namespaces([old])
        if self.tiers is not None:
            dropped += self.tiers.drop(name)
        log.info("namespace %r dropped: id %d -> %d, %d blocks evicted", name, old, new, dropped)
        return dropped

    def _live(self, ns: int) -> int:
        """The id a request naming ``ns`` uses: ``ns``, or after a drop the name's new id."""
        return self._retired.get(ns, ns)

    def _namespace(self, s: Session, h: dict[str, Any], _p: bytes) -> Response:
        name = NamespaceRequest.decode(h, _p).name
        if s.tenant == DEFAULT_TENANT and name.startswith(TENANT_PREFIX):
            raise RequestError(Status.INVALID_ARGUMENT,
                               f"namespace names starting {TENANT_PREFIX!r} are reserved")
        qualified = Tenants.qualify(s.tenant, name)
        ns = self._ns_ids.get(qualified)
        if ns is None or ns not in s.namespaces:
            if len(s.namespaces) >= MAX_NAMESPACES_PER_SESSION:
                raise RequestError(Status.INVALID_ARGUMENT, "too many namespaces on one connection")
            if ns is None:
                self._room_for_namespace(s.tenant)
                ns = self.namespace_id(qualified)
            s.namespaces.add(ns)
            self._ns_open[ns] += 1
        return NamespaceAnswer(ns).encode()

    def _room_for_namespace(self, tenant: str) -> None:
        """Make sure ``tenant`` may open one more namespace: at most ``max_namespaces`` live at
        once (freeing its unused ones first, ``_free_unused``); raises ``RequestError``."""
        if self._live_count(tenant) < self.max_namespaces:
            return
        if tenant in self._may_free:
            self._free_unused(tenant)
        if self._live_count(tenant) >= self.max_namespaces:
            raise RequestError(Status.INVALID_ARGUMENT,
                               f"this tenant has {self.max_namespaces} namespaces in use on this node "
                               "(tenants.max_namespaces): close connections or drop namespaces")

    def _live_count(self, tenant: str) -> int:
        """Namespaces of ``tenant`` a NAMESPACE request can reach (dropped ids do not count)."""
        mine = self._tenant_ns.get(tenant, ())
        return len(mine) - sum(1 for ns in self._retired if ns in mine)

    def _free_unused(self, tenant: str) -> int:
        """Free ``tenant``'s unused namespaces; returns how many.

        Unused: no connection has it open, no entry (PENDING or READY, so no pin
        either) is in it, and no dropped id leads to it or is it (``_retired``:
        sessions may still name those). Its id goes back to ``_free_ids`` for the
        next new name, and its ledger slot is overwritten then: the namespace had
        no committed block, so no ledger row names the id and a warm restart
        cannot give a block to the wrong name. Peer transfers resolve a name to
        its id and reserve in the same step (no await between), so their
        blocks in flight are PENDING entries here. One scan of the index, done
        only when the tenant is at its cap and one of its connections closed
        since the last scan.
        """
        self._may_free.discard(tenant)
        in_use = self.store.namespaces_in_use()
        pinned = set(self._retired) | set(self._retired.values())
        mine = self._tenant_ns.get(tenant, set())
        unused = [ns for ns in mine
                  if ns not in in_use and ns not in pinned and self._ns_open[ns] <= 0]
        for ns in unused:
            mine.discard(ns)
            del self._ns_ids[self._ns_names[ns]]
            self._ns_names[ns] = FREED
            self._ns_open.pop(ns, None)
            self.store.forget_namespace(ns)
            if self.store.ledger is not None:  # its old name must not come back with the next name's blocks
                self.store.ledger.add_namespace(ns, RETIRED)
            heapq.heappush(self._free_ids, ns)
        if unused:
            log.info("tenant %r at its namespace cap: %d unused namespaces freed", tenant, len(unused))
        return len(unused)

    def _reserve(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        ns, keys, rest = self._keys(s, h, p)
        req = ReserveRequest.decode(h, p, (keys, rest))
        n, sizes = len(keys), req.sizes
        fit = min(self._fit_quota(s.tenant, ns, keys, sizes), self._fit_connection(s, sizes))
        if FAULTS is not None and FAULTS.at("pool.reserve") is not None:
            fit = 0  # injected: as if the pool were full of pinned blocks
        evicted = self.store.evicted_total
        res = self.store.reserve(ns, keys if fit == n else keys.take(slice(0, fit)), sizes[:fit],
                                 admit=True, prev=req.prev)
        if fit < n:  # over the tenant's quota even after evicting its own blocks: the rest fail
            res = res.padded(n)
        if self.store.evicted_total > evicted and self._pressure.due():
            st = self.store.stats()
            log.info("evicting under pressure: %s blocks evicted since start (%d MiB used of %d)",
                     dict(st.evictions), st.bytes_used >> 20, st.capacity >> 20)
        if not res.status.any():  # every key NEW (0): the usual save of new blocks
            s.pending.update(res.handles.tolist())
            nbytes = int(sizes.sum())
            self.metrics.reserved(n, nbytes, 0)
        else:
            new = res.status == _NEW
            s.pending.update(res.handles[new].tolist())
            nbytes = int(sizes[new].sum())
            self.metrics.reserved(int(new.sum()), nbytes, int((res.status == _FAILED).sum()))
        s.pending_bytes += nbytes
        self._note_copies(s, ns, keys, res.status)
        return ReserveAnswer(res.offsets, res.handles, res.status).encode()

    def _grant(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        if not self.grants:
            raise RequestError(Status.INVALID_ARGUMENT, "grants are off on this node (pool.grants)")
        size, k, need, back = GrantRequest.decode(h, p)
        if size > self.store.max_block:
            raise RequestError(Status.INVALID_ARGUMENT, f"size must be an int in 1..{self.store.max_block}")
        _granted_chunks(s, back.tolist())
        self._ungrant(s, back)
        chunk = self.store.slabs.chunk_for(size)
        cap = self.store.capacity
        room = min(cap // GRANT_SESSION_SHARE - s.granted_bytes,
                   cap // GRANT_TOTAL_SHARE - self.store.granted_bytes,
                   self.connection_uncommitted - s.uncommitted) // chunk
        if room >= need and k:
            room = self._fit_quota_grant(s.tenant, chunk, min(k, room))
        got = self.store.grant(size, min(k, room) if room >= need else 0, self.tenant_group(s.tenant))
        s.granted.update(dict.fromkeys(got.tolist(), chunk))
        s.granted_bytes += chunk * got.size
        return GrantAnswer(got).encode()

    def _ungrant(self, s: Session, offsets: np.ndarray) -> None:
        """Give back chunks granted to ``s`` (checked by the caller)."""
        if offsets.size:
            s.forget_grants(offsets.tolist())
            self.store.ungrant(offsets)

    def _put(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        ns, keys, rest = self._keys(s, h, p)
        n = len(keys)
        s.put = None
        if n == 1 and self.store.scalar_paths and self.tenants.quota(s.tenant) is None:
            return self._put_one(s, h, ns, keys, rest)
        req = PutRequest.decode(h, p, (keys, rest))
        at, sizes = req.at, req.sizes
        align = self.store.slabs.align
        chunks = _granted_chunks(s, at.tolist())
        for size, chunk in zip(sizes.tolist(), chunks, strict=True):
            _check_fits(size, chunk, align)
        # The chunks named are counted (granted) already: only the blocks' own bytes are new.
        fit = self._fit_quota(s.tenant, ns, keys, sizes, counted=sum(chunks))
        res = self.store.reserve(ns, keys if fit == n else keys.take(slice(0, fit)), sizes[:fit],
                                 admit=True, prev=req.prev, at=at[:fit])
        if fit < n:
            res = res.padded(n)
        new = np.flatnonzero(res.status == _NEW)
        handles = res.handles[new]
        s.forget_grants(at[new].tolist())
        if self.checksums is not None:
            self.checksums.seal(handles)  # written before the PUT was sent: digest before READY
        self.store.commit_reserved(handles)
        s.put = handles
        self._note_copies(s, ns, keys, res.status)
        self.metrics.reserved(int(new.size), int(sizes[new].sum()),
                              int((res.status == _FAILED).sum()), "put")
        return PutAnswer(res.status).encode()

    def _put_one(self, s: Session, h: dict[str, Any], ns: int, keys: KeyBatch, rest: bytes) -> Response:
        """``_put`` of one block for a tenant without a quota (a one-block save): the same
        checks, answer and effects in scalar steps."""
        at, size, prev = PutRequest.one(h, rest)
        _check_fits(size, _granted_chunks(s, [at])[0], self.store.slabs.align)
        status, handle = self.store.reserve_granted_one(ns, keys, size, at, prev)
        new = status == _NEW
        handles = np.array((handle,) if new else (), dtype=np.uint32)
        if new:
            s.forget_grants([at])
            if self.checksums is not None:
                self.checksums.seal(handles)  # written before the PUT was sent: digest before READY
            self.store.commit_reserved(handles)
        s.put = handles
        answer = PutAnswer.encode_one(status)
        self._note_copies(s, ns, keys, np.frombuffer(answer[1][0], dtype=np.uint8))
        self.metrics.reserved(int(new), size if new else 0, int(status == _FAILED), "put")
        return answer

    def hold_quota(self, ns: int, nbytes: int) -> None:
        """Namespace ``ns``'s tenant holds ``nbytes`` more (or, negative, fewer) bytes reserved
        without a session here: blocks a peer is sending or a promotion is reading
        (``PoolAccess.reserve``), counted by its quota until committed or aborted."""
        self._hold(Tenants.tenant_of(self.namespace_name(ns)), nbytes)

    def fit_quota(self, ns: int, keys: KeyBatch, sizes: np.ndarray) -> int:
        """How many leading blocks of ``keys`` (``sizes`` bytes) this node may store for
        namespace ``ns``'s tenant, after evicting that tenant's own LRU blocks: the
        quota check of every path that stores bytes without a client session here
        (a forwarded save or a replica from a peer, a read-cache copy of a remote
        fetch, a promotion from the disk tier; see ``PoolAccess.reserve``)."""
        return self._fit_quota(Tenants.tenant_of(self.namespace_name(ns)), ns, keys, sizes)

    def _fit_quota(self, tenant: str, ns: int, keys: KeyBatch, sizes: np.ndarray, counted: int = 0) -> int:
        """How many leading keys of a save fit the tenant's quota (all without one), after
        evicting its own LRU blocks.

        The quota holds the tenant's committed bytes and the bytes its connections
        hold uncommitted (reserved or granted: ``_hold``), less ``counted`` (granted
        chunks this save fills: already in the uncommitted total).
        """
        quota = self.tenants.quota(tenant)
        if quota is None:
            return len(keys)
        want = int(sizes.sum())
        held = self._quota_held(tenant) - counted
        if held + want > quota:
            present = self.store.index.find(ns, keys)
            held -= self._evict_own(tenant, held + want - quota, present[present >= FIRST_ID])
        room = np.cumsum(sizes.astype(np.int64)) <= quota - held
        return int(room.argmin()) if not room.all() else len(keys)

    def _fit_quota_grant(self, tenant: str, chunk: int, k: int) -> int:
        """How many of ``k`` chunks of ``chunk`` bytes a GRANT may hand tenant ``tenant`` (all
        without a quota): granted chunks count against the quota until used or given back.

        Only from room the quota has free: a GRANT never evicts. It is speculative (the SDK
        asks after each save for the next one's worth, and more), so evicting for it would
        drop the blocks just saved; a tenant at its quota gets none and saves with RESERVE,
        which evicts its own LRU blocks as a commit over the quota does.
        """
        quota = self.tenants.quota(tenant)
        if quota is None:
            return k
        return max(0, min(k, (quota - self._quota_held(tenant)) // chunk))

    def _note_copies(self, s: Session, ns: int, keys: KeyBatch, status: np.ndarray) -> None:
        """In a cluster, remember the keys of a save that are here only as read-cache copies
        (PRESENT, READY and marked cached) for ``follow_up``: their owners may have lost them."""
        s.copies = None
        if self.cluster is None:
            return
        present = np.flatnonzero(status == _PRESENT)
        if present.size == 0:  # the usual save: every key new
            return
        idx = self.store.index
        ids = idx.find(ns, keys.take(present))
        copy = ids >= FIRST_ID
        copy[copy] = (idx.cached[ids[copy]] != 0) & (idx.state[ids[copy]] == READY)
        if copy.any():
            s.copies = (ns, keys.take(present[copy]))

    def _fit_connection(self, s: Session, sizes: np.ndarray) -> int:
        """How many leading blocks of ``sizes`` a RESERVE of ``s`` may hold pending: a connection
        holds at most ``connection_uncommitted`` bytes reserved and granted."""
        room = self.connection_uncommitted - s.uncommitted
        if int(sizes.sum()) <= room:  # the usual case: one sum, no cumulative array
            return len(sizes)
        return int(np.searchsorted(np.cumsum(sizes.astype(np.int64)), room, side="right"))

    def _quota_held(self, tenant: str) -> int:
        """What tenant ``tenant``'s quota counts now: committed bytes of its namespaces plus the
        pending and granted bytes of its connections."""
        committed = sum(self.store.ns_bytes(ns) for ns in self._tenant_ns.get(tenant, ()))
        return committed + self._uncommitted.get(tenant, 0)

    def _evict_own(self, tenant: str, nbytes: int, keep: np.ndarray) -> int:
        """Evict ``nbytes`` of tenant ``tenant``'s own LRU blocks (never ``keep``); bytes freed."""
        mine = np.fromiter(self._tenant_ns.get(tenant, ()), dtype=np.int64)
        return self.store.evict_within(mine, nbytes, keep)

    def _hold(self, tenant: str, delta: int) -> None:
        """A connection of ``tenant`` holds ``delta`` more bytes reserved or granted."""
        left = self._uncommitted.get(tenant, 0) + delta
        if left:
            self._uncommitted[tenant] = left
        else:
            self._uncommitted.pop(tenant, None)

    def _commit(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        commit, abort, _, _ = CommitRequest.decode(h, p)
        nc, na = len(commit), len(abort)
        listed = commit.tolist() + abort.tolist()
        _own(s.pending, listed[:nc], "commit")
        _own(s.pending, listed[nc:], "abort")
        s.pending.difference_update(listed)
        s.pending_bytes -= self._lengths(listed)
        if nc and self.checksums is not None:
            self.checksums.seal(commit)  # the client has written them: digest before they are READY
        done = 0
        if nc:
            # Reserved by this session and not ended: PENDING entries (only the session ends
            # them). A handle listed twice is committed once.
            distinct = dict.fromkeys(listed[:nc])
            if len(distinct) < nc:
                commit = np.fromiter(distinct, dtype=np.uint32, count=len(distinct))
            done = self.store.commit_reserved(commit)
        if na:
            self.store.abort(abort)
        return CommitAnswer(int(done)).encode()

    def _lengths(self, handles: list[int]) -> int:
        """Total length of the distinct entries ``handles`` (PENDING entries of a session)."""
        if not handles:
            return 0
        ids = np.fromiter(dict.fromkeys(handles), dtype=np.int64)
        return int(self.store.index.length[ids].sum(dtype=np.int64))

    def _pin(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        ns, keys, rest = self._keys(s, h, p)
        req = PinRequest.decode(h, p, (keys, rest))
        pinned = self.pin_checked(ns, keys, req.prev)
        s.pins.update(pinned.handles.tolist())
        if s.fetched:  # fetched for this PIN with write_rcache off: kept only while pinned
            held = s.fetched & set(pinned.handles.tolist())
            s.transient |= held
            self._drop_transient(s, s.fetched - held)
            s.fetched = set()
        self.metrics.looked_up("pin", pinned.count, len(keys) - pinned.count,
                               int(pinned.lengths.sum()))
        return PinAnswer(pinned.offsets, pinned.lengths, pinned.handles).encode()

    def _touch(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        ns, keys, rest = self._keys(s, h, p)
        req = TouchRequest.decode(h, p, (keys, rest))
        count, nbytes = self.store.touch(ns, keys, req.prev)
        self.metrics.looked_up("pin", count, 0, nbytes)  # loads, whichever way they read
        self.metrics.looked_up("exists", req.found, 0, 0)
        return CountAnswer.encode_of(count)

    def pin_checked(self, ns: int, keys: KeyBatch, prev: KeyBatch | None = None) -> Pinned:
        """``store.pin``, cut before the first block whose checksum fails (``pool.checksum``)."""
        pinned = self.store.pin(ns, keys, prev)
        return pinned if self.checksums is None else self.checksums.verified(pinned)

    def _release(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        handles = ReleaseRequest.decode(h, p).handles
        if len(handles) == 1:  # one block a call: scalar steps
            return self._release_one(s, handles)
        need = Counter(handles.tolist())
        for handle, count in need.items():
            if s.pins.get(handle, 0) < count:
                raise RequestError(Status.INVALID_ARGUMENT, f"release of handle {handle} not pinned here")
        s.pins.subtract(need)
        for handle in need:
            if s.pins[handle] <= 0:
                del s.pins[handle]
        self.store.release(handles)
        if s.transient:
            self._drop_transient(s, {h for h in need if h not in s.pins and h in s.transient})
        return {}, []

    def _release_one(self, s: Session, handles: np.ndarray) -> Response:
        """``_release`` of one handle."""
        handle = int(handles[0])
        held = s.pins.get(handle, 0)
        if held < 1:
            raise RequestError(Status.INVALID_ARGUMENT, f"release of handle {handle} not pinned here")
        if held == 1:
            del s.pins[handle]
        else:
            s.pins[handle] = held - 1
        self.store.release(handles)
        if s.transient and held == 1 and handle in s.transient:
            self._drop_transient(s, {handle})
        return {}, []

    def _drop_transient(self, s: Session, handles: set[int]) -> None:
        """Drop copies that were fetched only for this session's reads (still safe: see discard_handles)."""
        drop = list(handles)  # may be s.transient itself
        if drop:
            s.transient.difference_update(drop)
            self.store.discard_handles(np.array(drop, dtype=np.uint32))

    def _exists(self, s: Session, h: dict[str, Any], p: bytes) -> Response:
        ns, keys, rest = self._keys(s, h, p)
        ExistsRequest.decode(h, p, (keys, rest))  # checks the fields the cluster hooks read
        count = self.store.exists(ns, keys)
        if self.tiers is not None:  # blocks on disk count too (a load promotes them)
            count = self.tiers.exists(ns, keys, count)
        self.metrics.looked_up("exists", count, len(keys) - count, 0)
        return CountAnswer.encode_of(count)

    def _stats(self, s: Session, _h: dict[str, Any], _p: bytes) -> Response:
        st = self.store.stats()
        names = self._visible_names(s.tenant)
        return {
            "node": self.node_id,
            "region": self.region_kind,
            "capacity": st.capacity,
            "bytes_used": st.bytes_used,
            "bytes_free": st.bytes_free,
            "entries": st.entries,
            "pending": st.pending,
            "pinned": st.pinned,
            "cached": st.cached,
            "granted": st.granted,
            "evictions": dict(st.evictions),
            "clients": self.sessions,
            "namespaces": len(names),
            "namespace_names": names[:100],
            "uptime_s": time.time() - self.started,
            "membership": "standalone" if self.cluster is None else self.cluster.state.value,
            "members": ([self.node_id] if self.cluster is None
                        else [n.node_id for n in self.cluster.placement.members]),
            **self.info,
            **({"disk": self.tiers.summary()} if self.tiers is not None else {}),
            **({"prefault": self.prefault()} if self.prefault is not None else {}),
            **self._cluster_stats(),
        }, []

    def _visible_names(self, tenant: str) -> list[str]:
        """The live namespace names STATS shows a client of ``tenant``, oldest first: every
        name without a tenants file (one default tenant, the operator's); with one, only
        the tenant's own (the default tenant's too), so no tenant learns another's names."""
        ids = sorted(self._tenant_ns.get(tenant, ())) if self.tenants.enabled else range(len(self._ns_names))
        return [self._ns_names[i] for i in ids
                if i not in self._retired and not self._ns_names[i].startswith("\0")]

    def _cluster_stats(self) -> dict[str, Any]:
        if self.cluster is None:
            return {"transport": "none", "share": {self.node_id: 1.0},
                    "view": [{"id": self.node_id, "capacity": self.store.capacity, "peer": ""}]}
        c, p = self.cluster, self.cluster.placement
        return {"transport": c.transport_name, "peer_transports": c.transports.snapshot(),
                "share": p.share(), "draining": p.draining,
                "vnodes": p.params[0], "replicas": p.params[1],
                "placement_record": None if p.record is None else p.record.version,
                "placement_config": {"vnodes": c.cfg.vnodes, "replicas": c.cfg.replicas},
                "placement_config_differs": p.config_differs,
                "placement_differs": {node: {"vnodes": v, "replicas": r}
                                      for node, (v, r) in p.disagree.items()},
                "view": [{"id": n.node_id, "capacity": n.capacity, "peer": n.peer_addr} for n in p.members]}

    def _owner(self, _s: Session, h: dict[str, Any], p: bytes) -> Response:
        req = OwnerRequest.decode(h, p)
        if self.cluster is None:
            return OwnerAnswer([[self.node_id]] * len(req.keys)).encode()
        return OwnerAnswer(self.cluster.placement.owner_ids(req.name, req.keys)).encode()

    def _drain(self, _s: Session, _h: dict[str, Any], _p: bytes) -> Response:
        if self.cluster is None:
            raise RequestError(Status.INVALID_ARGUMENT, "a standalone node has no ring to leave")
        return {}, []  # the work follows (follow_up)

    def _placement(self, _s: Session, h: dict[str, Any], _p: bytes) -> Response:
        if self.cluster is None or not self.cluster.shares_placement:
            raise RequestError(Status.INVALID_ARGUMENT, "only a ZooKeeper cluster keeps a placement "
                               "record; static members take cluster.vnodes and cluster.replicas from config")
        PlacementRequest.decode(h, _p)
        return {}, []  # the write follows (follow_up): ZooKeeper calls block

    def _ping(self, _s: Session, _h: dict[str, Any], _p: bytes) -> Response:
        return {}, []

    def _drop(self, s: Session, h: dict[str, Any], _p: bytes) -> Response:
        req = DropRequest.decode(h, _p)
        dropped = self.drop_namespace(self.namespace_name(self._live(_opened(s, req.ns))))
        return DropAnswer(dropped).encode()  # in a cluster the other members follow (follow_up)

    # -- helpers ---------------------------------------------------------------

    def _keys(self, s: Session, h: dict[str, Any], p: bytes) -> tuple[int, KeyBatch, bytes]:
        """(namespace, keys, rest of payload) of a keyed request; checks every field.

        A request looked at twice (a PIN by ``remote_fetch`` then its handler, an
        EXISTS by its handler then ``follow_up``) is parsed once: the session keeps
        the last answer with the payload object it came from. Payloads are
        immutable ``bytes`` and a session's namespaces are never closed, so the
        same object with the same fields gives the same answer (an empty payload,
        which may be one shared object, is always parsed). The namespace is
        the one the id names now (``_live``: a dropped id goes to its name's new one).
        """
        ns, n, kt = h.get("ns"), h.get("n"), h.get("kt")
        memo = s.parsed
        if p and memo is not None and memo[0] is p and memo[1] == (ns, n, kt):
            return self._live(memo[2][0]), memo[2][1], memo[2][2]
        ns = _opened(s, ns)
        keys, rest = _split_keys(n, kt, p)
        out = (ns, keys, rest)
        s.parsed = (p, (ns, n, kt), out)
        return self._live(ns), keys, out[2]

    _handlers = {
        Op.NAMESPACE: _namespace,
        Op.RESERVE: _reserve,
        Op.COMMIT: _commit,
        Op.PIN: _pin,
        Op.RELEASE: _release,
        Op.EXISTS: _exists,
        Op.STATS: _stats,
        Op.PING: _ping,
        Op.OWNER: _owner,
        Op.DRAIN: _drain,
        Op.DROP: _drop,
        Op.GRANT: _grant,
        Op.PUT: _put,
        Op.PLACEMENT: _placement,
        Op.TOUCH: _touch,
    }


def _now() -> float:
    """The running loop's clock (``time.monotonic()`` unless a simulation gives it a virtual one)."""
    return asyncio.get_running_loop().time()


def _timeout(header: dict[str, Any]) -> float:
    """Seconds a request's peer work may take: its ``to`` (ms, else 5 s) less a margin to answer.

    The client stops waiting at ``to``: the peer work ends a fifth earlier
    (at most 100 ms), so the answer with whatever arrived still reaches it.
    """
    to = header.get("to")
    budget = to / 1000.0 if type(to) is int and 0 < to <= 3_600_000 else 5.0
    return budget - min(budget / 5, 0.1)


def _opened(s: Session, ns: object) -> int:
    """``ns`` when it is a namespace id this connection opened; else ``RequestError``."""
    if type(ns) is not int or ns not in s.namespaces:
        raise RequestError(Status.INVALID_ARGUMENT, f"namespace {ns!r} not opened on this connection")
    return ns


def _split_keys(n: object, kt: object, p: bytes, most: int = MAX_BATCH_KEYS,
                exact: bool = False) -> tuple[KeyBatch, bytes]:
    """``frames.split_keys`` for a request that may fail alone: a bad field is a
    ``RequestError`` (the connection stays), not a ``FrameError``."""
    try:
        return split_keys(n, kt, p, most, exact)
    except FrameError as exc:
        raise RequestError(exc.status, str(exc)) from None


def _granted_chunks(s: Session, offsets: list[int]) -> list[int]:
    """The chunk size of each of ``offsets``: distinct chunks granted to ``s``; raises
    ``RequestError`` otherwise."""
    try:
        chunks = [s.granted[o] for o in offsets]
    except KeyError as exc:
        raise RequestError(Status.INVALID_ARGUMENT,
                           f"offset {exc.args[0]} is not a chunk granted to this connection") from None
    if len(set(offsets)) != len(offsets):
        raise RequestError(Status.INVALID_ARGUMENT, "a granted chunk is named twice")
    return chunks


def _check_fits(size: int, chunk: int, align: int) -> None:
    """A block of ``size`` bytes fills a granted chunk of ``chunk`` bytes exactly (its class,
    chunks ``align`` apart); ``RequestError`` otherwise."""
    if not 0 < size <= chunk < size + align:
        raise RequestError(Status.INVALID_ARGUMENT, f"a block of {size} bytes does not "
                           f"fit its granted chunk of {chunk} exactly")


def _own(pending: set[int], handles: list[int], what: str) -> None:
    for handle in handles:
        if handle not in pending:
            raise RequestError(Status.INVALID_ARGUMENT, f"{what} of handle {handle} not reserved here")


_OP_NAMES = {int(op): op.name.lower() for op in Op}


def _op_name(op: object) -> str:
    """The metrics label of an opcode ("unknown" for anything else): a dict lookup, far
    cheaper than ``Op(op)`` on every request."""
    try:
        return _OP_NAMES.get(op, "unknown")  # type: ignore[call-overload]
    except TypeError:  # unhashable
        return "unknown"
