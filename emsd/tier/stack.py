"""TierStack: one node's DRAM pool over its disk tier, as the daemon's handlers see them.

It joins a ``BlockStore`` (DRAM) and a ``DiskTier`` (disk) without either
knowing the other:

- ``on_evict`` is the store's eviction hook: blocks it evicts for room, while
  their bytes are still in their chunks, are handed to the tier's write-behind
  queue (``emsd.tier.disk.worth_demoting`` says which). With pool checksums on,
  a block whose staged bytes no longer match its seal is not written.
- ``exists`` and ``present`` count a key as held when it is in DRAM or on disk
  (``exists``: the leading run of such keys, as the store counts READY ones).
- ``drain_next`` hands a drain (``emsd.remote``) the blocks on disk once it has pushed those
  in DRAM, a part at a time, for it to promote and push to their new owners.
- ``promote`` is the asynchronous step before a PIN (a ``Promote`` effect of ``Service.before``,
  like a remote fetch): the keys of the PIN's leading run that are only on
  disk (in a cluster the run goes on through keys other nodes own, which the
  fetch after it brings) get chunks in the pool (PENDING entries the stack
  owns), reader threads read them straight into those chunks (one I/O a run
  of adjacent slots) and check them, and the stack commits each one that
  read right. What is not read by the deadline stays PENDING until its read
  ends (then committed or aborted): the PIN, handled at the deadline, counts
  it as a miss, and the load never waits longer than its timeout. The event
  loop never waits for the disk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterator
from typing import cast

import numpy as np

from emsd.pool.checksum import Checksums
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Reservation
from emsd.pool.store import Status as SlotStatus
from emsd.tenants import Quota
from emsd.tier.disk import DiskEntry, DiskTier, worth_demoting
from emsd.tier.engine import runs

log = logging.getLogger("emsd.tier")

_NEW = np.uint8(SlotStatus.NEW)
_FAILED = np.uint8(SlotStatus.FAILED)


def leading(ok: np.ndarray) -> int:
    """How many leading entries of the bool array ``ok`` are True."""
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else int(ok.size)


def _sort(fut: asyncio.Future[object], handles: list[int], ok: list[int], bad: list[int]) -> None:
    """The handles of one ended run read into ``ok`` (read right) and ``bad`` (the rest)."""
    rights = cast("list[bool]", fut.result()) if fut.exception() is None else [False] * len(handles)
    for h, right in zip(handles, rights, strict=True):
        (ok if right else bad).append(h)


class TierStack:
    """DRAM (``store`` over ``pool``) above ``disk``; ``ns_name`` maps the store's namespace ids
    to the names the tier keys by (names survive a reboot, ids do not)."""

    def __init__(self, store: BlockStore, disk: DiskTier, pool: memoryview,
                 ns_name: Callable[[int], str], checksums: Checksums | None = None,
                 quota: Quota | None = None) -> None:
        self.store = store
        self.quota = quota  # the Service: promoted blocks count against their tenant's quota
        self.disk = disk
        self.pool = pool
        self.ns_name = ns_name
        self.checksums = checksums
        self.promoted = 0  # blocks read from disk into the pool
        self.late = 0  # promotions whose read ended after their load's deadline
        self.refused = 0  # blocks to promote that found no room in the pool (``Service.refusals``)
        self._drain: list[tuple[str, KeyBatch]] | None = None  # what a drain has yet to move
        store.on_evict = self.on_evict

    # -- demotion ------------------------------------------------------------------------------

    def on_evict(self, ids: np.ndarray, reason: str) -> None:
        """The store is about to evict entries ``ids``: queue the ones worth keeping for disk."""
        if not worth_demoting(reason, cached=False) or self.disk.failed:
            return
        idx = self.store.index
        ids = ids[idx.cached[ids] == 0]  # read-cache copies: their owner keeps the block
        if ids.size == 0:
            return
        namespaces = idx.ns_of(ids)
        for ns in np.unique(namespaces).tolist():
            name = self.ns_name(ns)
            if name.startswith("\0"):  # a dropped (retired) namespace: nothing finds it again
                continue
            sel = ids[namespaces == ns]
            offsets = idx.offset[sel].astype(np.uint64) * np.uint64(self.store.slabs.align)
            sums = self.store.sums[sel] if self.store.sums is not None else None
            self.disk.demote(name, idx.keys_of(sel), self.pool, offsets,
                             idx.length[sel].astype(np.uint64), sums)

    # -- presence ------------------------------------------------------------------------------

    def present(self, ns: int, keys: KeyBatch) -> np.ndarray:
        """Per key: READY in DRAM or whole on disk."""
        here = self.store.present(ns, keys)
        if here.all():
            return here
        return here | self.disk.present(self.ns_name(ns), keys)

    def exists(self, ns: int, keys: KeyBatch, count: int) -> int:
        """The leading run of keys held in DRAM or on disk, given ``count`` leading in DRAM."""
        if count == len(keys) or self.disk.failed:
            return count
        rest = keys.take(slice(count, None))
        return count + leading(self.present(ns, rest))

    # -- promotion -----------------------------------------------------------------------------

    def wanted(self, ns: int, keys: KeyBatch, count: int, elsewhere: np.ndarray | None = None) -> bool:
        """Whether a PIN of ``keys`` (``count`` leading in DRAM) would find a block of its run
        on disk: its next block, or with ``elsewhere`` (per key, owned by other nodes: a fetch
        may bring it) any block of the leading run of keys in DRAM, on disk or elsewhere."""
        if count >= len(keys) or self.disk.failed:
            return False
        if elsewhere is None:
            return bool(self.disk.present(self.ns_name(ns), keys.take(slice(count, count + 1)))[0])
        return self._disk_only(ns, keys.take(slice(count, None)), elsewhere[count:]).size > 0

    def _disk_only(self, ns: int, rest: KeyBatch, elsewhere: np.ndarray | None) -> np.ndarray:
        """Positions in ``rest`` of the keys only on disk within its leading run of keys in DRAM,
        on disk or (``elsewhere``) owned by other nodes."""
        dram = self.store.present(ns, rest)
        disk = self.disk.present(self.ns_name(ns), rest) & ~dram
        held = dram | disk if elsewhere is None else dram | disk | elsewhere
        return np.flatnonzero(disk[: leading(held)])

    async def promote(self, ns: int, keys: KeyBatch, count: int, deadline: float,
                      elsewhere: np.ndarray | None = None) -> int:
        """Read the disk-only blocks of the leading run after ``count`` into the pool, until
        ``deadline`` (the loop's clock); with ``elsewhere`` (per key, owned by other nodes) the
        run goes on through those keys. A block still queued for writing is copied from its
        staging buffer instead. Returns how many were committed in time."""
        rest = keys.take(slice(count, None))
        want = self._disk_only(ns, rest, None if elsewhere is None else elsewhere[count:])
        if want.size == 0:
            return 0
        name, wanted = self.ns_name(ns), rest.take(want)
        entries = self.disk.checkout(name, wanted)
        staged = self.disk.staged_lengths(name, wanted)
        lengths = [n if e is None else e.length for e, n in zip(entries, staged, strict=True)]
        got = next((i for i, n in enumerate(lengths) if n is None), len(lengths))
        for e in entries[got:]:  # gone since ``present``: the run ends before them
            if e is not None:
                self.disk.checkin(e)
        if got == 0:
            return 0
        entries, wanted = entries[:got], wanted.take(slice(0, got))
        res = self._reserve(ns, keys, wanted, np.array(lengths[:got], dtype=np.uint64))
        self.refused += int(np.count_nonzero(res.status == _FAILED))
        for i in np.flatnonzero(res.status != _NEW).tolist():
            e = entries[i]  # PRESENT (stored meanwhile) or FAILED (no room): no read
            if e is not None:
                self.disk.checkin(e)
        new = np.flatnonzero(res.status == _NEW).tolist()
        if not new:
            return 0
        ok: list[int] = []
        bad: list[int] = []
        on_disk = [(i, e) for i in new if (e := entries[i]) is not None]
        written = self._copy_staged(name, wanted, [i for i in new if entries[i] is None], res, lengths, ok)
        if written:  # their writes ended since ``staged_lengths``: on disk now (or dropped)
            for i, e in zip(written, self.disk.checkout(name, wanted.take(np.array(written))), strict=True):
                if e is None:
                    bad.append(int(res.handles[i]))
                else:
                    on_disk.append((i, e))
        reads = self._read(res, on_disk)
        loop = asyncio.get_running_loop()
        done: set[asyncio.Future[object]] = set()
        late: set[asyncio.Future[object]] = set()
        if reads:
            done, late = await asyncio.wait(reads, timeout=max(0.0, deadline - loop.time()))
        for f in done:
            _sort(f, reads[f], ok, bad)
        self._settle(ok, bad)
        for f in late:  # ends when its read does: committed for later loads, or aborted
            self.late += len(reads[f])
            f.add_done_callback(functools.partial(self._settle_late, handles=reads[f]))
        return len(ok)

    def _copy_staged(self, name: str, wanted: KeyBatch, picked: list[int], res: Reservation,
                     lengths: list[int | None], ok: list[int]) -> list[int]:
        """The blocks at positions ``picked`` of ``wanted`` (of ``lengths``), queued for writing,
        into their reserved chunks from their staging buffers, their handles into ``ok``; the
        positions of those no longer queued (written meanwhile)."""
        if not picked:
            return []
        at = res.offsets[picked].tolist()
        dests = [self.pool[a : a + int(lengths[i] or 0)] for a, i in zip(at, picked, strict=True)]
        copied = self.disk.copy_staged(name, wanted.take(np.array(picked)), dests)
        ok += [h for h, right in zip(res.handles[picked].tolist(), copied, strict=True) if right]
        return [i for i, right in zip(picked, copied, strict=True) if not right]

    def _read(self, res: Reservation,
              picked: list[tuple[int, DiskEntry]]) -> dict[asyncio.Future[object], list[int]]:
        """Start reading the checked-out blocks ``picked`` (position in ``res``, entry) into their
        reserved chunks, one I/O a run of adjacent slots: each read's future and its handles."""
        reads: dict[asyncio.Future[object], list[int]] = {}
        if not picked:
            return reads
        at = res.offsets[[i for i, _ in picked]].tolist()
        handles = res.handles[[i for i, _ in picked]].tolist()
        blocks = [e for _, e in picked]
        for span in runs([e.offset for e in blocks], [e.length for e in blocks], at, self.disk.data.direct):
            dests = [self.pool[at[j] : at[j] + blocks[j].length] for j in span]
            fut = self.disk.engine.read(self.disk.read_run, [blocks[j] for j in span], dests,
                                        [at[j] for j in span])
            reads[asyncio.wrap_future(fut)] = [handles[j] for j in span]
        return reads

    def _settle_late(self, fut: asyncio.Future[object], handles: list[int]) -> None:
        ok: list[int] = []
        bad: list[int] = []
        _sort(fut, handles, ok, bad)
        self._settle(ok, bad)

    def _reserve(self, ns: int, keys: KeyBatch, wanted: KeyBatch, sizes: np.ndarray) -> Reservation:
        """Chunks for the blocks to promote; the load's blocks in DRAM are pinned meanwhile, the
        leading ones and those further on alike, so that the reservation's evictions do not
        take what the load is about to read (a block evicted further on would be a miss of
        this load, and of the next until its demotion is written)."""
        here = np.flatnonzero(self.store.present(ns, keys))
        head = self.store.pin(ns, keys.take(here)) if here.size else None
        try:
            if self.quota is None:
                return self.store.reserve(ns, wanted, sizes)
            fit = self.quota.fit_quota(ns, wanted, sizes)
            res = self.store.reserve(ns, wanted.take(slice(0, fit)), sizes[:fit]).padded(len(wanted))
            reading = int(sizes[res.status == _NEW].sum())
            if reading:  # until _settle: reads in flight count against the quota
                self.quota.hold_quota(ns, reading)
            return res
        finally:
            if head is not None:
                self.store.release(head.handles)

    def _settle(self, ok: list[int], bad: list[int]) -> None:
        """Commit the promoted blocks that read right, abort the rest; their quota hold ends."""
        if self.quota is not None and (ok or bad):
            ended = np.array(ok + bad, dtype=np.uint32)
            idx = self.store.index
            for ns in np.unique(idx.ns_of(ended)).tolist():
                mine = ended[idx.ns_of(ended) == ns]
                self.quota.hold_quota(int(ns), -int(idx.length[mine].sum(dtype=np.int64)))
        if ok:
            h = np.array(ok, dtype=np.uint32)
            if self.checksums is not None:
                self.checksums.seal(h)
            self.promoted += self.store.commit(h)
        if bad:
            self.store.abort(np.array(bad, dtype=np.uint32))

    # -- drain ---------------------------------------------------------------------------------

    def _on_disk(self) -> list[tuple[str, KeyBatch]]:
        """Every client namespace's keys whose blocks are on disk or queued for it now."""
        return [(name, keys) for name, keys in self.disk.keys_on_disk().items() if not name.startswith("\0")]

    def away_on_disk(self, mine: Callable[[str, KeyBatch], np.ndarray],
                     chunk: int) -> Iterator[tuple[str, KeyBatch]]:
        """Per client namespace and per ``chunk`` of its keys on disk (or queued for it) now,
        those that are not this node's: ``mine(name, keys)`` is False for them (a handoff's,
        ``emsd.handoff``). One part for every chunk, empty when all of it is this node's: a
        caller on the event loop can yield between parts, since ``mine`` (the ring's hash)
        costs about 0.1 s of a core per million keys here."""
        for name, keys in self._on_disk():
            for at in range(0, len(keys), chunk):
                part = keys.take(slice(at, at + chunk))
                yield name, part.take(np.flatnonzero(~mine(name, part)))

    def drain_next(self, limit: int) -> tuple[str, KeyBatch] | None:
        """The next part (namespace name, at most ``limit`` keys) of the blocks a drain moves
        from disk; None once every part has been handed out.

        The first call takes the snapshot: the blocks on disk or queued for it then. A drain
        makes it once no owned block is left in DRAM (``emsd.remote``), so the blocks demoted
        while it pushed those are in it; after that it demotes none of its own (what it pushes
        becomes a read-cache copy, and those are never demoted).
        """
        if self._drain is None:
            self._drain = self._on_disk()[::-1]  # the next last
        if not self._drain:
            return None
        name, keys = self._drain[-1]
        if len(keys) <= limit:
            self._drain.pop()
            return name, keys
        self._drain[-1] = (name, keys.take(slice(limit, None)))
        return name, keys.take(slice(0, limit))

    def drain_left(self) -> int:
        """How many keys on disk a drain has yet to be handed: of its snapshot once taken, else
        of the blocks on disk now (counting them takes no snapshot)."""
        parts = self._on_disk() if self._drain is None else self._drain
        return sum(len(keys) for _, keys in parts)

    def summary(self) -> dict[str, object]:
        """The tier's state for STATS (``emsctl status``)."""
        st = self.disk.stats()
        self.disk.check()
        return {"dir": str(self.disk.directory), "capacity": st.capacity, "bytes_used": st.bytes_used,
                "blocks": st.blocks, "queued": st.queued, "writes": st.writes, "reads": st.reads,
                "promoted": self.promoted, "late": self.late, "corrupt": st.corrupt,
                "evicted": st.evicted, "dropped": st.dropped, "direct": st.direct, "failed": self.disk.failed}

    def drop(self, name: str) -> int:
        """Remove namespace ``name``'s blocks from disk; returns how many."""
        return self.disk.drop(name)
