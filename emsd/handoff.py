"""Handoff: blocks this node holds as an owner's but no longer owns go to their new owners.

A ring change (a node joins or comes back, a placement change) gives part of
the hash space that was this node's to others. Loads through any other node
ask the new owners, which lack those keys' blocks: without a handoff they
miss until they are computed again, while this node keeps them as owned
blocks that only its own clients find (and evicts them after every
read-cache copy).

``Handoff.changed`` is called on every new ring (``Cluster.on_ring``) and
once after joining (a warm restart may bring back blocks the ring has given
to others meanwhile). One pass runs at a time, on the event loop:

1. it waits ``SETTLE`` seconds, so that a burst of changes (several nodes
   starting) makes one pass over the last ring;
2. it takes this node's owned READY blocks (``Service.owned_here``) and, per
   namespace, those the ring now gives only to other nodes, then the blocks
   on its disk tier that the ring gives to others;
3. it pushes them to their owners ``STEP`` at a time
   (``Remote.push_pinned``: pinned while sent, checksums verified), each step
   within ``STEP_TIMEOUT``; blocks on disk are read back into the pool first
   (``TierStack.promote``, as a drain reads them). A block that reached an
   owner stays here as a read-cache copy in DRAM (and leaves the disk); one
   that did not (its owner down or full, or its read failed) stays where it
   was, owned, for the next ring change to try again.

No pass runs while this node is alone, draining (the drain moves every
owned block) or not in its own ring (a view without it decides nothing of
its). A view that places every key as the ring before it is no change (no
pass, no scan; a block no owner took waits for a real change). A change
during a pass ends the pass after its current step, and a new pass starts
over the new ring. Each pass that moved or kept
blocks logs one line; ``Cluster.handed`` counts passes, blocks and the
seconds the passes took (STATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

import numpy as np

from emsd.cluster import Cluster
from emsd.pool.keys import KeyBatch
from emsd.remote import Remote, now, owned_now, remote_only

log = logging.getLogger("emsd.cluster")

SETTLE = 2.0  # seconds a ring must stand before a pass starts
STEP = 32  # blocks a step: what a step pins (and, from disk, reads into the pool) while it runs
STEP_TIMEOUT = 10.0  # seconds a step may take
CHUNK = 1 << 16  # blocks looked up on the ring at a time (10-20 ms here; the loop serves between two)

Step = Callable[[int, KeyBatch], Awaitable[tuple[int, int]]]  # (ns, keys) -> (moved, kept)


class Handoff:
    """Hands one node's stranded blocks to their owners after ring changes (see the module docstring)."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        self.service = remote.service
        self._again = False  # the ring changed since the running pass began
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._seen: object = None  # what the last ring ``changed`` took was built from (``_ring``)
        self.chunk = CHUNK  # blocks a pass looks up on the ring at a time, in DRAM and on disk

    @property
    def cluster(self) -> Cluster:
        return self.remote.cluster

    @property
    def running(self) -> bool:
        """A pass is running or waiting for its ring to stand."""
        return self._task is not None and not self._task.done()

    def changed(self) -> None:
        """A new ring: run a pass over it (after the running one, if any, ends its step). A view
        that places every key as the ring before it (the same members, capacities and
        parameters) is no change."""
        if self._closed:
            return
        ring = self._ring()
        if ring == self._seen:
            return
        self._seen = ring
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        """No pass from now on; the running one, if any, is cancelled (``close`` waits for it)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        """``cancel``, and wait until the running pass has stopped (a push cut off is released
        like any cancelled one)."""
        self.cancel()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while self._again:
            self._again = False
            await asyncio.sleep(SETTLE)
            if self._again:  # changed again meanwhile: wait for that ring to stand
                continue
            try:
                moved, kept = await self.run_pass()
            except Exception:  # a bug must not end the daemon's handoffs for good; say so loudly
                log.exception("handoff failed")
                continue
            if moved or kept:
                log.info("handoff: %d blocks moved to their new owners, %d kept (not taken)", moved, kept)

    def _ring(self) -> object:
        """What the ring is built from (members, their capacities, vnodes and replicas): equal
        values, equal rings."""
        p = self.cluster.placement
        return tuple((m.node_id, m.capacity) for m in p.members), p.params, p.draining

    async def run_pass(self) -> tuple[int, int]:
        """One pass over the current ring: (blocks moved, blocks kept because no owner took them
        or they could not be read back from disk). Ends early, with what it did so far, when
        the ring changes."""
        placement = self.cluster.placement
        if placement.alone() or placement.draining or placement.my_index() < 0:
            return 0, 0
        moved = kept = 0
        start = now()
        for ns, keys, step in self._work():
            if len(keys) == 0:  # a chunk that is all this node's
                if self._again or placement.draining:
                    return self._count(moved, kept, start)
                await asyncio.sleep(0)  # the loop serves clients between two lookups
                continue
            for at in range(0, len(keys), STEP):
                if self._again or placement.draining:
                    return self._count(moved, kept, start)
                got, missed = await step(ns, keys.take(slice(at, at + STEP)))
                moved, kept = moved + got, kept + missed
        return self._count(moved, kept, start)

    def _work(self) -> Iterator[tuple[int, KeyBatch, Step]]:
        """A pass's work in order, each part with the step that hands it over: the stranded
        DRAM blocks, then, looked up only once those are done (a pass the ring cuts short
        scans no disk), the disk tier's blocks the ring gives to others. Both are looked up
        a chunk at a time; an empty part is a chunk that is all this node's."""
        for ns, keys in self.stranded():
            yield ns, keys, self._step
        tiers = self.service.tiers
        if tiers is not None:
            for name, keys in tiers.away_on_disk(self.cluster.placement.owned_here, self.chunk):
                yield self.service.namespace_id(name), keys, self._disk_step

    def stranded(self) -> Iterator[tuple[int, KeyBatch]]:
        """The keys of owned READY blocks here that the ring gives only to others: per
        ``chunk`` of the owned blocks at the pass's start, one part per namespace in it (one
        empty part when none is stranded), each chunk looked at when its turn comes (a block
        gone or become a copy meanwhile is not in it)."""
        service = self.service
        idx = service.store.index
        owned = service.owned_here()
        for at in range(0, owned.size, self.chunk):
            ids = owned_now(idx, owned[at : at + self.chunk])
            nss = idx.ns_of(ids)
            found = False
            for ns in np.unique(nss).tolist():
                if service.retired(ns):
                    continue
                keys = idx.keys_of(ids[nss == ns])
                away = np.flatnonzero(remote_only(self.cluster, service.namespace_name(ns), keys))
                if away.size:
                    found = True
                    yield ns, keys.take(away)
            if not found:
                yield 0, KeyBatch.from_ints(np.empty(0, dtype=np.uint64))  # the loop's turn

    async def _step(self, ns: int, keys: KeyBatch) -> tuple[int, int]:
        """Hand over the DRAM blocks of ``keys`` (and forget their copies on disk): (moved, kept)."""
        reached, tried = await self._push(ns, keys, now() + STEP_TIMEOUT)
        if self.service.tiers is not None and len(reached):
            self.service.tiers.disk.discard(self.service.namespace_name(ns), reached)
        return len(reached), tried - len(reached)

    async def _disk_step(self, ns: int, keys: KeyBatch) -> tuple[int, int]:
        """Hand over the blocks of ``keys`` still on the disk tier: those not in DRAM are read
        back into the pool first (``TierStack.promote``, as a drain reads them); each that
        reached an owner leaves the disk (it stays a read-cache copy in DRAM). (moved, kept)."""
        service, tiers = self.service, self.service.tiers
        assert tiers is not None
        deadline = now() + STEP_TIMEOUT
        name = service.namespace_name(ns)
        keys = keys.take(np.flatnonzero(tiers.disk.present(name, keys)))  # handed over or evicted since
        back = ~service.store.present(ns, keys)
        if back.any() and not service.retired(ns):
            await tiers.promote(ns, keys.take(np.flatnonzero(back)), 0, deadline)
        reached, _ = await self._push(ns, keys, deadline)
        tiers.disk.discard(name, reached)
        return len(reached), len(keys) - len(reached)

    async def _push(self, ns: int, keys: KeyBatch, deadline: float) -> tuple[KeyBatch, int]:
        """Push the blocks of ``keys`` still in DRAM (not dropped since the pass began) to their
        owners; mark those that reached one, and that the ring still gives to others, as copies.
        (those keys, how many were pushed)."""
        service, store = self.service, self.service.store
        if service.retired(ns):
            return keys.take(slice(0, 0)), 0
        keys = keys.take(np.flatnonzero(store.present(ns, keys)))  # evicted since: nothing to move
        if len(keys) == 0:
            return keys, 0
        name = service.namespace_name(ns)
        count, got = await self.remote.push_pinned(ns, name, keys, deadline)
        reached = keys.take(np.flatnonzero(got[:count]))
        # by the ring now: one that changed during the push may give a block back to this node
        reached = reached.take(np.flatnonzero(remote_only(self.cluster, name, reached)))
        store.mark_cached(ns, reached)
        return reached, len(keys)

    def _count(self, moved: int, kept: int, start: float) -> tuple[int, int]:
        handed = self.cluster.handed
        handed["passes"] += 1
        handed["moved"] += moved
        handed["kept"] += kept
        handed["seconds"] += now() - start
        return moved, kept
