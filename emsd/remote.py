"""The work that ``emsd.effects`` values describe, carried out on the event loop.

``Remote`` does, for one ``Service``, what the service's handlers name but do
not do: fetch, promote, forward, ask, drop, drain, write the placement record.
It acts on the pool only through the service's and the store's public methods,
and on other nodes through ``Cluster`` (and the disk tier through
``TierStack``). Each step takes the effect and an absolute ``deadline`` on the
loop's clock (the coordinator adds the effect's budget to the loop's time when
it gets the effect). ``before`` returns the set of copies a PIN's session may
keep only while it pins them; ``AFTER[type(effect)](remote, effect, deadline)``
returns the answer fields the work sets. Peers failing are misses here (the
cluster turns them into zeros); anything that raises is logged by the
coordinator and the answer stays as the handler left it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from emsd.cluster import Cluster
from emsd.effects import (
    AskOwners,
    Before,
    Drain,
    DropElsewhere,
    Fetch,
    Forward,
    RefreshOwners,
    SetPlacement,
)
from emsd.placement import record as placement_record
from emsd.pool.index import FIRST_ID, READY, BlockIndex
from emsd.pool.keys import KeyBatch
from emsd.service import DRAIN_BATCH, Service
from emsd.solo import Solo
from emsd.transport.frames import Status

log = logging.getLogger("emsd.service")

Fields = dict[str, Any]  # answer fields an effect's work sets


def now() -> float:
    """The running loop's clock (``time.monotonic()`` unless a simulation gives it a virtual one)."""
    return asyncio.get_running_loop().time()


def remote_only(cluster: Cluster, name: str, keys: KeyBatch) -> np.ndarray:
    """True per key that other nodes own and this one does not (its copy is a read cache)."""
    return ~cluster.placement.owned_here(name, keys)


class Remote:
    """Carries out the effects of one ``Service``'s requests (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    @property
    def cluster(self) -> Cluster:
        cluster = self.service.cluster
        assert not isinstance(cluster, Solo)  # a standalone node owns every key: no such effects
        return cluster

    # -- before a PIN ------------------------------------------------------------

    async def before(self, effect: Before, deadline: float) -> frozenset[int]:
        """Run a PIN's ``Promote`` or ``Fetch`` (or a peer GET's ``Promote``, for ``PeerServer``);
        the handles of the copies fetched with ``keep`` off (the session may hold them only
        while pinned)."""
        if isinstance(effect, Fetch):
            return await self.fetch(effect.ns, effect.keys, deadline, effect.keep)
        tiers = self.service.tiers
        assert tiers is not None
        await tiers.promote(effect.ns, effect.keys, effect.count, deadline, effect.elsewhere)
        count = self.service.store.exists(effect.ns, effect.keys)
        if effect.fetch and count < len(effect.keys) and now() < deadline:
            return await self.fetch(effect.ns, effect.keys.take(slice(count, None)), deadline, effect.keep)
        return frozenset()

    async def fetch(self, ns: int, keys: KeyBatch, deadline: float, keep: bool) -> frozenset[int]:
        """Fetch ``keys`` from their owners; the copies stay as read cache. Returns the handles
        of the new copies when ``keep`` is off (else none)."""
        store = self.service.store
        name = self.service.namespace_name(ns)
        before = None if keep else store.index.find(ns, keys)
        remote = await self.cluster.fetch(name, keys, deadline)
        store.mark_cached(ns, keys if remote.all() else keys.take(remote))
        if before is None:
            return frozenset()
        after = store.index.find(ns, keys)
        new = (after != before) & (after >= FIRST_ID) & remote
        return frozenset(after[new].tolist())

    async def push_pinned(self, ns: int, name: str, keys: KeyBatch,
                          deadline: float) -> tuple[int, np.ndarray]:
        """Push the leading ``keys`` whose checksums hold (``Service.pin_checked``) to their
        owners, each pinned while it is sent: how many were sent, and per sent key 1 when it
        reached its owner."""
        store = self.service.store
        pinned = self.service.pin_checked(ns, keys)
        try:
            got = await self.cluster.push(name, keys.take(slice(0, pinned.count)),
                                          pinned.offsets, pinned.lengths, deadline)
        finally:
            store.release(pinned.handles)
        return pinned.count, got

    # -- after a handler -----------------------------------------------------------

    async def forward(self, effect: Forward, deadline: float) -> Fields:
        """Push the committed blocks to their owners, per namespace, each pinned while sent."""
        service, store, cluster = self.service, self.service.store, self.cluster
        handles = effect.handles
        reached = np.zeros(handles.size, dtype=np.uint8)
        nss = store.index.ns_of(handles)
        for ns in np.unique(nss).tolist():
            if service.retired(ns):  # reserved before a drop: not pushed, not "reached"
                continue
            sel = np.flatnonzero(nss == ns)
            keys = store.index.keys_of(handles[sel])
            name = service.namespace_name(ns)
            count, got = await self.push_pinned(ns, name, keys, deadline)
            reached[sel[:count]] = got
            sent = keys.take(slice(0, count))
            moved = sent.take(np.flatnonzero(got & remote_only(cluster, name, sent)))
            if effect.keep:
                store.mark_cached(ns, moved)  # now a read-cache copy of the owner's block
            else:
                store.discard(ns, moved)
        return {"reached": reached.tobytes()}

    async def refresh_owners(self, effect: RefreshOwners, deadline: float) -> Fields:
        """Ask the owners of a save's read-cache copies whether they still hold them; push the
        copies from the first one they lack (an owner that restarted cold gets them back)."""
        service, cluster, keys = self.service, self.cluster, effect.keys
        name = service.namespace_name(effect.ns)
        held = await cluster.exists(name, keys, np.zeros(len(keys), dtype=bool), deadline)
        if held == len(keys) or now() >= deadline:
            return {}
        _, got = await self.push_pinned(effect.ns, name, keys.take(slice(held, None)), deadline)
        log.debug("a save found %d copies whose owners lacked %d: %d pushed", len(keys),
                  len(keys) - held, int(np.count_nonzero(got)))
        return {}

    async def ask_owners(self, effect: AskOwners, deadline: float) -> Fields:
        """The EXISTS count with the keys other nodes hold (nothing moves, nothing pinned)."""
        return {"count": await self.cluster.exists(effect.name, effect.keys, effect.here, deadline)}

    async def set_placement(self, effect: SetPlacement, _deadline: float) -> Fields:
        """Rewrite the placement record; every node's watch then rebuilds its ring."""
        try:
            rec = await self.cluster.set_placement(effect.vnodes, effect.replicas)
        except placement_record.NotWritten as exc:
            return {"st": int(Status.IO_ERROR), "msg": f"the placement record was not written: {exc}"}
        return {"vnodes": rec.vnodes, "replicas": rec.replicas, "version": rec.version}

    async def drop_elsewhere(self, effect: DropElsewhere, deadline: float) -> Fields:
        """The other members drop the namespace; ``missed``: those that did not answer in time."""
        return {"missed": await self.cluster.drop(effect.name, deadline)}

    async def drain(self, _effect: Drain, deadline: float) -> Fields:
        """Leave the ring, then push owned blocks (oldest namespaces first) until the deadline,
        and after those in DRAM the ones on the disk tier, read back a part at a time.

        Each pushed block becomes a read-cache copy here; ``remaining`` counts
        the owned blocks still to move (in DRAM, and on disk not yet read back),
        ``moved`` those that reached an owner in this call, ``failed`` those no
        owner took or that could not be read back.
        """
        service, store, cluster = self.service, self.service.store, self.cluster
        await cluster.leave()
        moved = failed = 0
        idx = store.index
        steps = drain_steps(service)
        while now() < deadline:
            step = next(steps, None)
            if step is None:  # no owned block left in DRAM: the next part from disk, then again
                unread = await self._read_back(deadline)
                if unread is None:
                    break
                failed += unread
                steps = drain_steps(service)
                continue
            ns, batch = step
            keys = idx.keys_of(batch)
            _, got = await self.push_pinned(ns, service.namespace_name(ns), keys, deadline)
            store.mark_cached(ns, keys)  # moved or not: this node owns nothing now
            moved += int(np.count_nonzero(got))
            failed += len(keys) - int(np.count_nonzero(got))
        remaining = int(service.owned_here().size)
        if service.tiers is not None:
            remaining += service.tiers.drain_left()
        log.info("drain: %d blocks moved, %d not taken, %d to go", moved, failed, remaining)
        return {"moved": moved, "failed": failed, "remaining": remaining}

    async def _read_back(self, deadline: float) -> int | None:
        """Promote the next part of the blocks on disk a drain moves (``TierStack.drain_next``)
        into the pool, where they are owned blocks for the drain to push; how many of the part
        could not be read back, None when no part is left (or there is no disk tier)."""
        service, tiers = self.service, self.service.tiers
        if tiers is None:
            return None
        part = tiers.drain_next(DRAIN_BATCH)
        if part is None:
            return None
        name, keys = part
        ns = service.namespace_id(name)
        if service.retired(ns):
            return 0
        keys = keys.take(np.flatnonzero(~service.store.present(ns, keys)))  # here: moved already
        if len(keys) == 0:
            return 0
        return len(keys) - await tiers.promote(ns, keys, 0, deadline)


def drain_steps(service: Service) -> Iterator[tuple[int, np.ndarray]]:
    """A drain's steps through the owned blocks in DRAM: (namespace id, ids of at most
    ``DRAIN_BATCH`` of its owned READY blocks), from a queue of them taken once
    (``drain_queue``) and checked a step at a time (``drain_step``), taken again when used
    up; ends when no owned block is left. The caller makes each step's blocks copies
    before it asks for the next (else the next queue has them again)."""
    idx = service.store.index
    while True:
        queue, nss = drain_queue(idx, service.owned_here())
        if queue.size == 0:
            return
        while queue.size:
            ns, ids, queue, nss = drain_step(idx, queue, nss, service.retired)
            if ids.size:
                yield ns, ids


def drain_queue(idx: BlockIndex, owned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block ids ``owned`` grouped by namespace, lowest namespace id (the oldest) first, in
    id order within one: the order a drain pushes them in; and each one's namespace id."""
    nss = idx.nstag[owned] >> 8
    order = np.argsort(nss, kind="stable")
    return owned[order], nss[order]


def drain_step(idx: BlockIndex, queue: np.ndarray, nss: np.ndarray, retired: Callable[[int], bool],
              limit: int = DRAIN_BATCH) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """A drain's next step from its non-empty queue (``drain_queue``): the namespace of its
    head, the ids of the head's run in that namespace (at most ``limit``) that are still
    READY owned blocks of it (none in a namespace ``retired`` since), and the rest of the
    queue and of its namespaces. The queue is taken once and checked a step at a time, not
    scanned anew for every step (which cost a step about 2 ms for 400,000 blocks: a
    quadratic drain)."""
    ns = int(nss[0])
    n = int(np.searchsorted(nss[:limit], ns, side="right"))  # sorted: the leading run of ns
    ids = queue[:n]
    if retired(ns):
        ids = ids[:0]
    else:
        ids = owned_now(idx, ids)
        ids = ids[(idx.nstag[ids] >> 8) == ns]
    return ns, ids, queue[n:], nss[n:]


def owned_now(idx: BlockIndex, ids: np.ndarray) -> np.ndarray:
    """Those of ``ids`` (from an earlier look at the index) that are READY blocks this node
    owns now, not read-cache copies: an id freed since may hold another block, or none."""
    return ids[(idx.state[ids] == READY) & (idx.cached[ids] == 0)]


# The step that carries out each kind of effect after a handler (a dict: no isinstance chain).
AFTER: dict[type, Callable[[Remote, Any, float], Awaitable[Fields]]] = {
    Forward: Remote.forward,
    RefreshOwners: Remote.refresh_owners,
    AskOwners: Remote.ask_owners,
    SetPlacement: Remote.set_placement,
    DropElsewhere: Remote.drop_elsewhere,
    Drain: Remote.drain,
}
