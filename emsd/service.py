"""Request handling: decoded control frames in, responses out (sans-I/O).

``Service.serve_sync`` takes one request of one client ``Session`` and returns
the response header, its payload and the work with other nodes or the disk
tier that completes the answer, as data (``emsd.effects``). Nothing here
awaits, touches a socket or reads a clock of the event loop: the decisions
(which blocks to forward, which keys to ask the owners about, what to fetch
before a PIN: ``before``) are made from the request and this pool's state,
and ``emsd.remote`` carries them out in the order ``emsd.coordinator`` gives.
Whatever that work needs travels in the effect, not in the session. So the
transport (``emsd.transport.unix``) stays a thin shell and the whole protocol
can be driven from tests without a process; ``handle`` is ``serve_sync``
without the effects, for callers that reach no other node.

A ``Session`` is what the daemon knows of one client connection: its tenant,
the namespaces it opened, the reservations it has not committed yet and the
pins it holds. Handles sent by a client are checked against its own session,
so one client can never commit, abort or release another's blocks. When the
connection closes, ``Service.close`` aborts its reservations and drops its
pins: a client killed mid-save or mid-load leaks nothing.

Blocks that arrive from or leave to peers go through the Service too: the peer
transports (``emsd.transport.peer``, ``emsd.transport.rdma``) hold it as their
``emsd.transport.owner.BlockOwner`` and store, lend, count and drop blocks through
``reserve_arriving``, ``commit_arrived``, ``abort_arriving``, ``pin_to_lend``,
``release_lent``, ``present_count``, ``drop_namespace`` and ``peer_promotion``
(a ``Promote`` they carry out), never through the store. So a tenant's quota,
the checksums and the disk tier's promotions have one home: every path that
stores a tenant's bytes on this node passes a quota check here (a client's save,
a peer's forwarded save or replica, a fetched copy; a disk-tier promotion in
``emsd.tier.stack`` through ``fit_quota`` and ``hold_quota``).

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
connections' reserved and granted ones (``emsd.quota.Quotas``; ``handle`` keeps the
per-tenant total from each session's ``uncommitted`` with integer arithmetic).
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from emsd.effects import (
    NONE,
    AskOwners,
    Before,
    Drain,
    DropElsewhere,
    Effects,
    Fetch,
    Forward,
    Promote,
    RefreshOwners,
    SetPlacement,
)
from emsd.faults import FAULTS
from emsd.logs import Once
from emsd.membership.base import MembershipState
from emsd.metrics import Metrics

if TYPE_CHECKING:
    from emsd.cluster import Cluster
    from emsd.tier.stack import TierStack
from emsd.pool.checksum import Checksums
from emsd.pool.index import FIRST_ID, READY
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Pinned, Reservation
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
    bring_field,
)
from emsd.quota import Quotas
from emsd.solo import Solo
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
OPERATOR_OPS = frozenset((Op.DRAIN, Op.PLACEMENT))  # they change the cluster for every tenant
OPERATOR_SESSION_OPS = OPERATOR_OPS | {Op.STATS, Op.OWNER, Op.PING}  # what an operator-only session may ask
PEER_PROMOTE_BUDGET = 1.0  # seconds a peer's GET may spend reading blocks from the disk tier
# Slot statuses as numpy scalars: comparing an array with one skips the enum's slow lookup.
_NEW, _FAILED, _PRESENT = (np.uint8(st) for st in (SlotStatus.NEW, SlotStatus.FAILED, SlotStatus.PRESENT))
GRANT_SESSION_SHARE = 64  # a connection holds at most 1/64 of the pool in granted chunks
GRANT_TOTAL_SHARE = 16  # all connections together at most 1/16
CONNECTION_UNCOMMITTED_SHARE = 2  # default pool.connection_uncommitted: half the pool


def operator_uid(uid: int) -> bool:
    """Whether a peer of user id ``uid`` (SO_PEERCRED) is root or the daemon's own user."""
    return uid >= 0 and uid in (0, os.geteuid())


class RequestError(Exception):
    """A request the daemon refuses; ``status`` is the code to answer with."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    """One client connection's state."""

    peer_pid: int = 0
    peer_uid: int = -1  # SO_PEERCRED's uid (the Unix socket sets it; -1: not known)
    authenticated: bool = False
    operator_only: bool = False  # admitted for operator commands alone (``Service.hello``)
    namespaces: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    pins: Counter[int] = field(default_factory=Counter)
    tenant: str = DEFAULT_TENANT  # who the HELLO proved to be
    transient: set[int] = field(default_factory=set)  # pinned copies to drop on release (wr off)
    parsed: tuple[bytes, tuple[Any, Any, Any], tuple[int, KeyBatch, bytes]] | None = None  # Service._keys
    granted: dict[int, int] = field(default_factory=dict)  # byte offset -> chunk size, chunks granted
    granted_bytes: int = 0
    pending_bytes: int = 0  # block lengths of ``pending``
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
Planned = tuple[dict[str, Any], list[bytes], Effects]  # a handler's answer and the work after it


class Service:
    """The daemon's request handlers over one ``BlockStore``."""

    def __init__(self, store: BlockStore, node_id: str, region_kind: str, metrics: Metrics,
                 tenants: Tenants | None = None) -> None:
        self.store = store
        self.checksums: Checksums | None = None  # set when pool.checksum is on
        self.grants = True  # pool.grants: GRANT hands out chunks (else it is refused)
        self.tenants = tenants or Tenants([])
        self._tenant_ns: dict[str, set[int]] = {}  # namespaces of each tenant (for quotas)
        self.quotas = Quotas(self.tenants, store, self._tenant_ns)  # tenants' quotas (emsd.quota)
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
        # the node's cluster: one of this node alone (``emsd.solo``) unless it runs in a cluster
        self.cluster: Cluster | Solo = Solo(node_id, store.capacity)
        self.tiers: TierStack | None = None  # set when the disk tier is on ([disk])
        self.prefault: Callable[[], dict[str, Any]] | None = None  # background prefault's progress
        self.info: dict[str, Any] = {}  # start-up facts STATS reports (restart outcome, metrics address)
        self.sessions = 0  # connections past HELLO
        self.copies_refused = 0  # blocks fetched from owners that found no room here (``refusals``)
        self._pressure = Once(60.0)  # "evicting under pressure", at most once a minute

    # -- entry points ---------------------------------------------------------

    def hello(self, session: Session, header: dict[str, Any]) -> dict[str, Any]:
        """Authenticate a new connection (single tenant until tenants are configured)."""
        if header.get("op") != Op.HELLO:
            raise RequestError(Status.INVALID_ARGUMENT, "the first request must be HELLO")
        pid = header.get("pid", 0)
        session.peer_pid = pid if type(pid) is int else 0
        tenant = self.tenants.authenticate(header.get("access_id"), header.get("access_key"))
        if (tenant is None and header.get("operator") is True and header.get("access_id") in (None, "")
                and operator_uid(session.peer_uid)):
            tenant, session.operator_only = DEFAULT_TENANT, True  # emsctl on a node of tenants only
        if tenant is None:
            log.warning("refused client pid %s: unknown tenant %r or wrong access key",
                        session.peer_pid, str(header.get("access_id"))[:64])
            raise RequestError(Status.INVALID_ARGUMENT, "unknown tenant or wrong access key")
        session.tenant = tenant
        session.authenticated = True
        self.sessions += 1
        info = {"node": self.node_id, "pool_size": self.store.stats().capacity,
                "region": self.region_kind, "server_pid": os.getpid(), "grants": self.grants,
                "sparse": self.sparse, "page": self.store.page_size, "part": self.load_part(),
                "more": True, "bring": True}
        if header.get("idx") is True and self.store.shared is not None:
            info["idx"] = self.store.shared.size  # its fd follows the pool's
        return info

    def operator(self, session: Session) -> bool:
        """Whether ``session`` speaks for the operator, who alone may change the cluster (DRAIN,
        PLACEMENT): every client of a node without tenants; with tenants, a connection without
        an access id from root or the daemon's own user (a tenant's client never, whatever its
        user)."""
        if not self.tenants.enabled:
            return True
        return session.tenant == DEFAULT_TENANT and operator_uid(session.peer_uid)

    def load_part(self) -> int:
        """The most bytes of blocks one PIN of a client here should ask for (HELLO's ``part``; 0:
        no limit): in a cluster, the room that copies of other nodes' blocks may take from this
        node's own (``BlockStore.copy_floor``, ``pool.read_cache_share``), so that a load larger
        than that still finds room for every copy; the SDK pins a larger load in parts of at
        most this size, one after the other (a part costs a round trip and the overlap of its
        fetch and copy: a quarter of the room, 16 MiB a part, made a 64 MiB load 35% slower on
        loopback). A standalone node fetches nothing, and with a share of 0 copies never take
        owned room."""
        if isinstance(self.cluster, Solo):
            return 0
        return self.store.copy_floor

    def handle(self, session: Session, header: dict[str, Any], payload: bytes) -> Response:
        """Answer one request from this pool alone (``serve_sync`` without its effects: for
        callers with no other node to reach, such as tests of a handler)."""
        resp, parts, _ = self.serve_sync(session, header, payload)
        return resp, parts

    def serve_sync(self, session: Session, header: dict[str, Any], payload: bytes) -> Planned:
        """Answer one request; never raises for bad input (answers with a status).

        The third value is the work with other nodes that completes the answer
        (``emsd.effects``, in order; empty while this node is alone in its cluster, as a
        standalone node always is (``emsd.solo``), and for an error answer): the
        coordinator runs it and merges its fields into the answer.
        """
        op = header.get("op")
        effects = NONE
        start = time.perf_counter()
        name = _op_name(op)
        try:
            handler = self._handlers.get(op) if type(op) is int else None  # type: ignore[call-overload]
            if handler is None:
                raise RequestError(Status.INVALID_ARGUMENT, f"unknown op {op!r}")
            if op in OPERATOR_OPS and not self.operator(session):
                raise RequestError(Status.INVALID_ARGUMENT, f"{name} is the operator's: run emsctl as "
                                   "root or as the daemon's user, without --access-id")
            if session.operator_only and op not in OPERATOR_SESSION_OPS:
                raise RequestError(Status.INVALID_ARGUMENT, f"{name}: this emsd serves no default tenant "
                                   "(tenants.allow_default); a connection without an access id may "
                                   "only run operator commands here")
            held = session.uncommitted
            try:
                out = handler(self, session, header, payload)
            finally:
                if session.uncommitted != held:  # RESERVE, COMMIT, GRANT, PUT: the tenant's total follows
                    self.quotas.hold(session.tenant, session.uncommitted - held)
            resp, parts = out[0], out[1]
            if len(out) == 3:  # a handler with work after it (in a cluster)
                effects = out[2]
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
        return resp, parts, effects

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
        self.quotas.hold(session.tenant, -session.uncommitted)
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

    # -- work around a handler, named as effects (emsd.effects; carried out by emsd.remote) --

    def before(self, session: Session, header: dict[str, Any], payload: bytes) -> Before | None:
        """The work a PIN whose keys are not all here needs before its handler, or None.

        ``Promote`` when a block of the PIN's run is on the disk tier (its next missing one;
        in a cluster also one after keys other nodes own; then the rest from their owners),
        else ``Fetch`` of the missing tail from the owners; either way at most the PIN's
        ``bring`` keys after the leading ones here. The coordinator runs it, then answers
        with ``after_fetch`` (the fetched blocks are local by then, kept as read cache).
        None: nothing to fetch (not a PIN, alone in the cluster (standalone) without a disk
        tier, ``lo`` = read_local_only without one, all present, or a bad request that the
        handler will refuse).
        """
        remote = not header.get("lo") and not self.cluster.placement.alone()
        if header.get("op") != Op.PIN or not (remote or self.tiers is not None):
            return None
        try:
            ns, keys, _ = self._keys(session, header, payload)
            bring = bring_field(header)
        except (RequestError, FrameError):
            return None
        count = self.store.exists(ns, keys)
        if count == len(keys):
            return None
        budget = _timeout(header)
        keep = header.get("wr", True) is not False
        upto = len(keys) if bring is None else min(len(keys), count + bring)
        if upto < len(keys):
            keys = keys.take(slice(0, upto))
        if self.tiers is not None:
            # in a cluster, this node's disk blocks after keys other nodes own load too
            elsewhere = ~self.cluster.placement.owned_here(self.namespace_name(ns), keys) if remote else None
            if self.tiers.wanted(ns, keys, count, elsewhere):
                return Promote(ns, keys, count, budget, remote, keep, elsewhere)
        if not remote:
            return None
        return Fetch(ns, keys.take(slice(count, None)), budget, keep, upto)

    def after_fetch(self, session: Session, header: dict[str, Any], payload: bytes,
                    fetched: frozenset[int], room: bool = False, upto: int | None = None) -> Planned:
        """``serve_sync`` of a PIN whose ``before`` work has run. ``fetched``: the copies that
        work made with ``wr`` off; those this PIN pins stay only until the session releases
        them (``Session.transient``), the others are dropped now. A PIN that pinned fewer keys
        than it asked for says ``more`` (``PinAnswer``), so that the SDK asks again for the
        rest, when ``room`` (blocks that work brought found no room: ``refusals`` rose
        meanwhile) or when it stopped at or past ``upto`` (the first key that work did not
        bring: its ``bring`` bound); else it stopped at a block that is nowhere, and the load
        ends there."""
        resp, parts, effects = self.serve_sync(session, header, payload)
        count = resp.get("count", 0)
        if resp["st"] == Status.OK and count < header.get("n", 0) and (
                room or (upto is not None and count >= upto)):
            resp["more"] = 1  # PinAnswer.more
        if fetched:
            pinned = np.frombuffer(parts[2], dtype="<u4").tolist() if resp["st"] == Status.OK else []
            held = fetched.intersection(pinned)
            session.transient |= held
            self._drop_transient(session, set(fetched - held))
        return resp, parts, effects

    def drop_fetched(self, session: Session, fetched: frozenset[int]) -> None:
        """Copies fetched with ``wr`` off for a PIN that is not answered (its client left)."""
        self._drop_transient(session, set(fetched))

    def _forward(self, h: dict[str, Any], resp: dict[str, Any], handles: np.ndarray) -> Forward | None:
        """In a cluster, the ``Forward`` of a COMMIT's or PUT's committed ``handles`` (None when
        there are none). The answer says ``reached`` for none of them until the work says more."""
        if handles.size == 0 or self.cluster.placement.alone():
            return None
        resp["reached"] = bytes(handles.size)
        return Forward(handles, bool(h.get("wr", True)), _timeout(h))

    def owned_here(self) -> np.ndarray:
        """Ids of the READY blocks this node owns (not read-cache copies) in live namespaces:
        what a drain moves (a dropped namespace's leftovers must not reach another node)."""
        idx = self.store.index
        hw = idx.high_water
        owned = np.flatnonzero((idx.state[:hw] == READY) & (idx.cached[:hw] == 0)).astype(np.uint32)
        if self._retired:
            owned = owned[~np.isin(idx.ns_of(owned), list(self._retired))]
        return owned

    def retired(self, ns: int) -> bool:
        """Whether namespace id ``ns`` was dropped (its blocks are nobody's to find)."""
        return ns in self._retired

    # -- blocks that arrive from and leave to peers (emsd.transport.owner.BlockOwner) --
    #
    # The owner's side of a peer's GET, PUT, HAS and DROP (TCP or RDMA) and the copies this node
    # fetches store and lend blocks only through these, so quotas and checksums are kept here for
    # peers as for local clients: a tenant over its quota saving through another node evicts its
    # own blocks here, never another tenant's.

    def reserve_arriving(self, ns: int, keys: KeyBatch, sizes: np.ndarray, copy: bool) -> Reservation:
        """``store.reserve`` for blocks that arrive from a peer: its forwarded save or replica
        (``copy`` false), or copies this node fetched (``copy``: they evict only other copies,
        see ``BlockStore``). Within the quota of the tenant of ``ns`` (``Quotas.fit``: the
        leading keys that fit, after evicting that tenant's own blocks), the keys past it FAILED;
        the NEW blocks count against the quota from now on (``Quotas.hold``), so that parts of one
        transfer arriving side by side cannot each fill it. End them with ``commit_arrived``
        or ``abort_arriving``."""
        tenant = Tenants.tenant_of(self.namespace_name(ns))
        fit = self.quotas.fit(tenant, ns, keys, sizes)
        if fit == len(keys):
            res = self.store.reserve(ns, keys, sizes, copy=copy)
        else:
            res = self.store.reserve(ns, keys.take(slice(0, fit)), sizes[:fit], copy=copy).padded(len(keys))
        status = res.status
        if status.size == 1:  # one block a call: scalar steps
            new, failed = int(status[0] == _NEW), int(status[0] == _FAILED)
            held = int(sizes[0]) if new else 0
        else:
            fresh = status == _NEW
            new, failed = int(np.count_nonzero(fresh)), int(np.count_nonzero(status == _FAILED))
            held = int(sizes[fresh].sum())
        if held:
            self.quotas.hold(tenant, held)
        if copy:
            self.copies_refused += failed
        else:  # a peer's save served here (a fetched copy is this node's own load)
            self.metrics.reserved(new, held, failed, "peer_put")
        return res

    def refusals(self) -> int:
        """Blocks that a load's work brought here but found no room for since start: copies
        fetched from their owners past the read-cache room or the tenant's quota
        (``reserve_arriving``), promotions from the disk tier past the pool's. A PIN whose
        ``before`` work raised it may load more if asked again (``after_fetch``'s ``room``)."""
        return self.copies_refused + (self.tiers.refused if self.tiers is not None else 0)

    def commit_arrived(self, handles: np.ndarray) -> int:
        """``store.commit`` of the NEW blocks of one ``reserve_arriving`` that the peer wrote,
        sealed first (``pool.checksum``); their quota hold ends (they count as committed bytes
        now). Returns how many were committed."""
        if self.checksums is not None:
            self.checksums.seal(handles)
        self._unhold(handles)
        return self.store.commit(handles)

    def abort_arriving(self, handles: np.ndarray) -> int:
        """``store.abort`` of the NEW blocks of one ``reserve_arriving`` that did not arrive;
        their quota hold ends."""
        self._unhold(handles)
        return self.store.abort(handles)

    def _unhold(self, handles: np.ndarray) -> None:
        """End the quota hold of PENDING blocks ``handles`` (all of one namespace: one reserve)."""
        if handles.size == 0:
            return
        idx = self.store.index
        held = idx.length[handles[0]] if handles.size == 1 else idx.length[handles].sum(dtype=np.int64)
        self.hold_quota(int(idx.ns_of(handles[:1])[0]), -int(held))

    def pin_to_lend(self, ns: int, keys: KeyBatch) -> Pinned:
        """The leading present ``keys`` pinned to send to a peer (``pin_checked``: cut before
        the first block whose checksum fails); end with ``release_lent``. Counted as lookups
        of op "peer_get" (the loads this node serves to peers)."""
        pinned = self.pin_checked(ns, keys)
        self.metrics.looked_up("peer_get", pinned.count, len(keys) - pinned.count, pinned.nbytes)
        return pinned

    def release_lent(self, handles: np.ndarray) -> None:
        """Release blocks ``pin_to_lend`` pinned."""
        self.store.release(handles)

    def present_count(self, ns: int, keys: KeyBatch) -> int:
        """How many leading ``keys`` this node holds, in the pool or on its disk tier (a peer's
        HAS, counted as lookups of op "peer_has"; a GET promotes what is on disk)."""
        count = self.store.exists(ns, keys)
        if self.tiers is not None:
            count = self.tiers.exists(ns, keys, count)
        self.metrics.looked_up("peer_has", count, len(keys) - count, 0)
        return count

    def peer_promotion(self, ns: int, keys: KeyBatch) -> Promote | None:
        """The ``Promote`` a peer's GET of ``keys`` needs first: the disk-only blocks after the
        leading ones in the pool, read within ``PEER_PROMOTE_BUDGET`` (then: misses); never a
        fetch from other nodes (the peer asked the owner). None: no disk tier, or nothing there
        to promote."""
        if self.tiers is None:
            return None
        count = self.store.exists(ns, keys)
        if not self.tiers.wanted(ns, keys, count):
            return None
        return Promote(ns, keys, count, PEER_PROMOTE_BUDGET, fetch=False, keep=True)

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

    def readers_namespace(self, tenant: str, name: str) -> int | None:
        """The local id of namespace ``name`` as a client of ``tenant`` names it, if it is in
        use here, else None (nothing made): how a reader with a pass names blocks."""
        return self._ns_ids.get(Tenants.qualify(tenant, name))

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

    def _reserve(self, s: Session, h: dict[str, Any], p: bytes) -> Planned:
        ns, keys, rest = self._keys(s, h, p)
        req = ReserveRequest.decode(h, p, (keys, rest))
        n, sizes = len(keys), req.sizes
        fit = min(self.quotas.fit(s.tenant, ns, keys, sizes), self._fit_connection(s, sizes))
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
        resp, parts = ReserveAnswer(res.offsets, res.handles, res.status).encode()
        return resp, parts, self._after_save(h, resp, ns, keys, res.status)

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
            room = self.quotas.fit_grant(s.tenant, chunk, min(k, room))
        got = self.store.grant(size, min(k, room) if room >= need else 0, self.tenant_group(s.tenant))
        s.granted.update(dict.fromkeys(got.tolist(), chunk))
        s.granted_bytes += chunk * got.size
        return GrantAnswer(got).encode()

    def _ungrant(self, s: Session, offsets: np.ndarray) -> None:
        """Give back chunks granted to ``s`` (checked by the caller)."""
        if offsets.size:
            s.forget_grants(offsets.tolist())
            self.store.ungrant(offsets)

    def _put(self, s: Session, h: dict[str, Any], p: bytes) -> Planned:
        ns, keys, rest = self._keys(s, h, p)
        n = len(keys)
        if n == 1 and self.store.scalar_paths and self.tenants.quota(s.tenant) is None:
            return self._put_one(s, h, ns, keys, rest)
        req = PutRequest.decode(h, p, (keys, rest))
        at, sizes = req.at, req.sizes
        align = self.store.slabs.align
        chunks = _granted_chunks(s, at.tolist())
        for size, chunk in zip(sizes.tolist(), chunks, strict=True):
            _check_fits(size, chunk, align)
        # The chunks named are counted (granted) already: only the blocks' own bytes are new.
        fit = self.quotas.fit(s.tenant, ns, keys, sizes, counted=sum(chunks))
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
        self.metrics.reserved(int(new.size), int(sizes[new].sum()),
                              int((res.status == _FAILED).sum()), "put")
        resp, parts = PutAnswer(res.status).encode()
        return resp, parts, self._after_save(h, resp, ns, keys, res.status, handles)

    def _put_one(self, s: Session, h: dict[str, Any], ns: int, keys: KeyBatch, rest: bytes) -> Planned:
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
        self.metrics.reserved(int(new), size if new else 0, int(status == _FAILED), "put")
        resp, parts = PutAnswer.encode_one(status)
        if self.cluster.placement.alone():  # the usual case: no work after it (``_after_save``)
            return resp, parts, NONE
        effects = self._after_save(h, resp, ns, keys, np.frombuffer(parts[0], dtype=np.uint8), handles)
        return resp, parts, effects

    def hold_quota(self, ns: int, nbytes: int) -> None:
        """Namespace ``ns``'s tenant holds ``nbytes`` more (or, negative, fewer) bytes reserved
        without a session here: blocks a peer is sending (``reserve_arriving``) or a promotion
        is reading, counted by its quota until committed or aborted."""
        self.quotas.hold(Tenants.tenant_of(self.namespace_name(ns)), nbytes)

    def fit_quota(self, ns: int, keys: KeyBatch, sizes: np.ndarray) -> int:
        """How many leading blocks of ``keys`` (``sizes`` bytes) this node may store for
        namespace ``ns``'s tenant, after evicting that tenant's own LRU blocks: the
        quota check of every path that stores bytes without a client session here
        (a forwarded save or a replica from a peer, a read-cache copy of a remote
        fetch, a promotion from the disk tier; see ``reserve_arriving``)."""
        return self.quotas.fit(Tenants.tenant_of(self.namespace_name(ns)), ns, keys, sizes)

    def _after_save(self, h: dict[str, Any], resp: dict[str, Any], ns: int, keys: KeyBatch,
                    status: np.ndarray, handles: np.ndarray | None = None) -> Effects:
        """The work after a save (RESERVE, or PUT with the ``handles`` it committed) in a
        cluster: the ``Forward`` of those blocks, then ``RefreshOwners`` of the keys it found
        here only as read-cache copies (``_copies``). None while this node is alone (standalone,
        or its cluster's other members gone): it owns every key."""
        if self.cluster.placement.alone():
            return NONE
        forward = None if handles is None else self._forward(h, resp, handles)
        copies = self._copies(h, ns, keys, status)
        if copies is None:
            return NONE if forward is None else (forward,)
        return (copies,) if forward is None else (forward, copies)

    def _copies(self, h: dict[str, Any], ns: int, keys: KeyBatch, status: np.ndarray) -> RefreshOwners | None:
        """The keys of a save (answered ``status``) that are here only as read-cache copies
        (PRESENT, READY and marked cached), to check with their owners, who may have lost them;
        None when there are none (the usual save: every key new)."""
        present = np.flatnonzero(status == _PRESENT)
        if present.size == 0:
            return None
        idx = self.store.index
        ids = idx.find(ns, keys.take(present))
        copy = ids >= FIRST_ID
        copy[copy] = (idx.cached[ids[copy]] != 0) & (idx.state[ids[copy]] == READY)
        if not copy.any():
            return None
        return RefreshOwners(ns, keys.take(present[copy]), _timeout(h))

    def _fit_connection(self, s: Session, sizes: np.ndarray) -> int:
        """How many leading blocks of ``sizes`` a RESERVE of ``s`` may hold pending: a connection
        holds at most ``connection_uncommitted`` bytes reserved and granted."""
        room = self.connection_uncommitted - s.uncommitted
        if int(sizes.sum()) <= room:  # the usual case: one sum, no cumulative array
            return len(sizes)
        return int(np.searchsorted(np.cumsum(sizes.astype(np.int64)), room, side="right"))

    def _commit(self, s: Session, h: dict[str, Any], p: bytes) -> Planned:
        commit, abort, _, _ = CommitRequest.decode(h, p)
        nc, na = len(commit), len(abort)
        listed = commit.tolist() + abort.tolist()
        asked = commit  # forwarded as listed (a handle listed twice is committed once)
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
        resp, parts = CommitAnswer(int(done)).encode()
        forward = self._forward(h, resp, asked) if nc else None
        return resp, parts, NONE if forward is None else (forward,)

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
        self.metrics.looked_up("pin", pinned.count, len(keys) - pinned.count, pinned.nbytes)
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

    def _exists(self, s: Session, h: dict[str, Any], p: bytes) -> Planned:
        ns, keys, rest = self._keys(s, h, p)
        ExistsRequest.decode(h, p, (keys, rest))  # checks the fields the cluster hooks read
        count = self.store.exists(ns, keys)
        if self.tiers is not None:  # blocks on disk count too (a load promotes them)
            count = self.tiers.exists(ns, keys, count)
        self.metrics.looked_up("exists", count, len(keys) - count, 0)
        resp, parts = CountAnswer.encode_of(count)
        if h.get("lo") or count == len(keys) or self.cluster.placement.alone():
            return resp, parts, NONE
        here = self.store.present(ns, keys) if self.tiers is None else self.tiers.present(ns, keys)
        return resp, parts, (AskOwners(self.namespace_name(ns), keys, here, _timeout(h)),)

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
            "membership": self.cluster.state.value,
            "members": [n.node_id for n in self.cluster.placement.members],
            **self.info,
            **({"disk": self.tiers.summary()} if self.tiers is not None else {}),
            **({"prefault": self.prefault()} if self.prefault is not None else {}),
            **self.cluster.stats(),
        }, []

    def _visible_names(self, tenant: str) -> list[str]:
        """The live namespace names STATS shows a client of ``tenant``, oldest first: every
        name without a tenants file (one default tenant, the operator's); with one, only
        the tenant's own (the default tenant's too), so no tenant learns another's names."""
        ids = sorted(self._tenant_ns.get(tenant, ())) if self.tenants.enabled else range(len(self._ns_names))
        return [self._ns_names[i] for i in ids
                if i not in self._retired and not self._ns_names[i].startswith("\0")]

    def _owner(self, _s: Session, h: dict[str, Any], p: bytes) -> Response:
        req = OwnerRequest.decode(h, p)
        return OwnerAnswer(self.cluster.placement.owner_ids(req.name, req.keys)).encode()

    def _ring(self, s: Session, _h: dict[str, Any], _p: bytes) -> Response:
        ring = self.cluster.read_ring(s.tenant)
        if ring is None:
            raise RequestError(Status.INVALID_ARGUMENT, "this node does not offer reads from the owners "
                               "(standalone or alone in its view, cluster.direct_reads off, or TLS peers)")
        return ring.encode()

    def _drain(self, _s: Session, h: dict[str, Any], _p: bytes) -> Planned:
        if self.cluster.state is MembershipState.STANDALONE:
            raise RequestError(Status.INVALID_ARGUMENT, "a standalone node has no ring to leave")
        return {}, [], (Drain(_timeout(h)),)

    def _placement(self, _s: Session, h: dict[str, Any], _p: bytes) -> Planned:
        if not self.cluster.shares_placement:
            raise RequestError(Status.INVALID_ARGUMENT, "only a ZooKeeper cluster keeps a placement "
                               "record; static members take cluster.vnodes and cluster.replicas from config")
        req = PlacementRequest.decode(h, _p)
        return {}, [], (SetPlacement(req.vnodes, req.replicas, _timeout(h)),)  # ZooKeeper: async

    def _ping(self, _s: Session, _h: dict[str, Any], _p: bytes) -> Response:
        return {}, []

    def _drop(self, s: Session, h: dict[str, Any], _p: bytes) -> Planned:
        req = DropRequest.decode(h, _p)
        name = self.namespace_name(self._live(_opened(s, req.ns)))
        resp, parts = DropAnswer(self.drop_namespace(name)).encode()
        if self.cluster.placement.alone():
            return resp, parts, NONE
        return resp, parts, (DropElsewhere(name, _timeout(h)),)

    # -- helpers ---------------------------------------------------------------

    def _keys(self, s: Session, h: dict[str, Any], p: bytes) -> tuple[int, KeyBatch, bytes]:
        """(namespace, keys, rest of payload) of a keyed request; checks every field.

        A PIN looked at twice (by ``before``, then by its handler) is parsed
        once: the session keeps the last answer with the payload object it came
        from (a parse of one key costs about 2 us, on every PIN in a cluster). Payloads are
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
        Op.RING: _ring,
    }


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
