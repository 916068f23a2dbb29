"""DiskTier: the blocks of one node kept on local disk, below the pool's DRAM.

Off by default (``[disk]`` in the config). Three ways in and out:

- Demotion: a block evicted from DRAM for room (``lru`` or ``page``, not a
  drop, a quota or a corrupt block; not a read-cache copy of a block owned
  by another node, which the owner keeps: ``worth_demoting``) is copied into
  a page-aligned staging buffer at once, because the store hands its chunk to
  the next block in the same call, and queued for a writer thread. The queue
  is bounded in bytes (``queue_bytes``); a demotion that does not fit is
  dropped and counted, so eviction and saves never wait for the disk. Until
  its write ends a queued block counts as here: ``present`` finds it and a
  promotion copies it from its staging buffer (``copy_staged``), so that a
  block evicted and asked for again at once is not a miss; a drop removes it
  from the queue and its write is skipped.
- Promotion: a load whose blocks are not all in DRAM finds the next ones
  here, the daemon reserves chunks for them in the pool, and reader threads
  read them straight into those chunks (``read``), check each against its
  digest and the daemon commits them: the load then finds them in DRAM. The
  disk copy stays (blocks are content-addressed: it is still right), so the
  block's next eviction costs no write.
- Presence: ``present`` answers per key whether a whole, checked-in block is
  here (or queued to be); ``exists`` adds them to what DRAM holds, as
  consecutive runs.

A block's life here::

    (absent) --write placed--> WRITING --bytes on disk, row recorded--> READY
    READY --read--> READING (readers > 0) --done--> READY
    READY --evicted for room, dropped, or found corrupt--> (absent)

A WRITING or READING block is busy: no eviction takes its slot. A drop or a
corrupt read takes it out of the index at once (nothing finds it again) and
its slot is freed by whoever ends the busy state (``_settle``).

The index is arrays in the daemon, no Python object a block (some 150
bytes a block, ``index_nbytes``; a restart grows the daemon by some 240
bytes a block, against some 850 for the dicts of entry objects it
replaced): a ``BlockIndex`` from key to entry id, per-entry fields by id,
the LRU orders as linked lists of ids (``emsd.tier.order``) and the slots'
owners per extent (``emsd.tier.owners``). The persistent copy is
``emsd.tier.ledger`` (rows written after the bytes). At start every
committed row is re-indexed, a namespace at a time as whole arrays; a row
that does not fit the layout (outside the file, overlapping another, the
same key as an earlier row) is forgotten. Rows are not checked
against the bytes at start (that would read the whole disk): a block whose
bytes do not match its digest is found when it is read, and is a miss.

Room: a new block takes a free slot of its size class (``emsd.tier.space``);
when there is none, the least recently used idle block goes: its slot if it
is of the same class, else every idle block on its extent. A tenant's blocks
on disk are bounded by its quota as in DRAM (``quota``): beyond it, its own
least recently used blocks go first.

Failure: any I/O error marks the tier failed (``failed`` says why; logged
once): from then on nothing is demoted, nothing found, nothing read, and the
daemon carries on with DRAM only. ``check`` also notices a data file that
was deleted or a directory that was unmounted under the daemon.

Threads: writer and reader threads and the daemon's event loop share the
index under one lock, held only for bookkeeping, never during I/O.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from emsd.faults import FAULTS, io_fault
from emsd.files import check_dir
from emsd.pool.index import FIRST_ID, HELD, READY, BlockIndex
from emsd.pool.keys import KeyBatch
from emsd.tier.engine import DataFile, Engine, aligned, read_block
from emsd.tier.ledger import NS_SLOTS, DiskLedger
from emsd.tier.order import NONE as NO_ID
from emsd.tier.order import LinkedOrder
from emsd.tier.owners import SlotOwners
from emsd.tier.space import DEFAULT_EXTENT, DiskSpace, slot_for

log = logging.getLogger("emsd.tier")

DATA_FILE = "emsd-disk.data"
INDEX_FILE = "emsd-disk.index"
DEMOTE_REASONS = frozenset({"lru", "page"})
FLUSH_INTERVAL = 1.0  # seconds between flushes of the index's changed rows
Key = tuple[int, bytes]  # (the tier's namespace id, 33 bytes: four key words and the tag)


def worth_demoting(reason: str, cached: bool) -> bool:
    """Admission to disk: a block evicted for room that this node owns.

    Drops, quotas and corrupt blocks are not wanted any more; a read-cache copy
    (``cached``) is held by its owner, which demotes its own copy.
    """
    return reason in DEMOTE_REASONS and not cached


def key_bytes(keys: KeyBatch) -> list[bytes]:
    """The tier's form of each key: its four words then its tag (33 bytes)."""
    n = len(keys)
    raw = np.empty((n, 33), dtype=np.uint8)
    raw[:, :32] = np.ascontiguousarray(keys.words, dtype="<u8").view(np.uint8).reshape(n, 32)
    raw[:, 32] = keys.tags
    flat = raw.tobytes()
    return [flat[i * 33 : i * 33 + 33] for i in range(n)]


def batch_of(kbs: list[bytes]) -> KeyBatch:
    """The keys of ``key_bytes`` form (33 bytes each) as a ``KeyBatch``."""
    raw = np.frombuffer(b"".join(kbs), dtype=np.uint8).reshape(len(kbs), 33)
    words = np.ascontiguousarray(raw[:, :32]).view("<u8").astype(np.uint64).reshape(len(kbs), 4)
    return KeyBatch(words, raw[:, 32].copy())


def digest(buf: memoryview | bytes) -> int:
    """xxh3-64 of a block (never 0, which the index reads as "none")."""
    return xxhash.xxh3_64_intdigest(buf) or 1


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values of small non-negative ints (namespace ids, tenant lists), ascending:
    a count of each, which beats ``np.unique`` over many rows of a few values."""
    return np.flatnonzero(np.bincount(values)).tolist() if values.size else []


@dataclass(slots=True)
class DiskEntry:
    """A block checked out for reading (``checkout``): where it lies and the digest its bytes
    must match, copied from the index under the lock. Its slot stays put until ``checkin``."""

    id: int  # its entry in the tier's index
    offset: int  # byte offset of its slot in the data file
    length: int
    digest: int


@dataclass
class TierStats:
    bytes_used: int
    capacity: int
    blocks: int
    queued: int  # demotions waiting for a writer
    queued_bytes: int
    writes: int
    reads: int
    dropped: dict[str, int]  # demotions not written, by reason: queue, room, quota, failed, corrupt
    corrupt: int  # reads whose bytes failed their digest
    evicted: int  # blocks removed from disk for room
    direct: bool
    failed: str


class DiskTier:
    """The disk tier in ``directory``: ``size`` bytes of data file plus its index.

    ``quota(ns_name)`` gives the byte limit of the tenant a namespace belongs
    to and ``tenant(ns_name)`` the tenant (both optional: no limits). Raises
    ``OSError`` when the files cannot be made (the daemon then runs without the
    tier) and ``emsd.tier.ledger.LedgerBusy`` when another daemon has them.
    """

    def __init__(self, directory: Path, size: int, queue_bytes: int = 256 << 20,
                 readers: int = 8, writers: int = 2, extent: int = DEFAULT_EXTENT,
                 quota: Callable[[str], int | None] | None = None,
                 tenant: Callable[[str], str] | None = None,
                 on_read: Callable[[float], None] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        check_dir(directory)  # the daemon's own, not writable by others (emsd.files)
        self.space = DiskSpace(size, extent)
        self.ledger, self.outcome = DiskLedger.open(directory / INDEX_FILE, self.space.size, extent)
        try:
            self.data = DataFile(directory / DATA_FILE, self.space.size)
        except BaseException:
            self.ledger.close()
            raise
        if not self.data.direct:
            log.warning("disk tier: %s: %s; buffered I/O (through the page cache)", directory,
                        self.data.reason)
        self.directory = directory
        self.queue_bytes = queue_bytes
        self.quota = quota
        self.tenant = tenant or (lambda _name: "")
        self.on_read = on_read
        self.engine = Engine(readers, writers)
        self._lock = threading.RLock()  # _fail may run under it
        self._idle = threading.Condition(self._lock)  # notified when a demotion ends
        # The index: no Python object a block. (namespace id, key) -> entry id in a BlockIndex
        # (its state READY for every indexed entry, HELD for one taken out while busy, its
        # ``pins`` the block's readers, its ``length``); the rest per entry id in arrays
        # (``_fit``): the slot's byte offset, the ledger row (-1 once freed), the digest, and
        # whether the bytes are on disk (else WRITING). LRU order: every entry on list 0 of
        # ``_lru``, and each on its tenant's list of ``_by_tenant`` in the same order, so that a
        # tenant over its quota evicts its oldest blocks without a walk past the others'.
        self._index = BlockIndex()
        self._offset = np.zeros(0, dtype=np.uint64)
        self._row = np.zeros(0, dtype=np.int32)
        self._digest = np.zeros(0, dtype=np.uint64)
        self._ready = np.zeros(0, dtype=np.uint8)
        self._fit()
        self._lru = LinkedOrder()
        self._by_tenant = LinkedOrder()
        self._tenant_list: dict[str, int] = {}  # tenant -> its list in ``_by_tenant``
        self._owners = SlotOwners(self.space.extent)  # slot -> entry id, for freeing an extent
        # Blocks queued for writing, not yet on disk: their staging buffers and lengths. They are
        # found (``present``) and promoted from these buffers (``copy_staged``) meanwhile.
        self._staged: dict[Key, tuple[mmap.mmap, int]] = {}
        self._free_rows: list[int] = []
        self._rows = 0  # rows ever used (the next new row id)
        self._ns: dict[str, int] = {}
        self._ns_names: dict[int, str] = {}
        self._ns_tenant: dict[int, str] = {}  # ``_tenant_of``
        self._tenant_bytes: dict[str, int] = {}
        self.queued = 0
        self.queued_bytes = 0
        # Staging buffers of finished demotions, by slot size, kept (up to half the queue's bytes)
        # for the next ones: a fresh buffer's pages are faulted in by the copy, which costs more
        # than the copy itself and runs on the event loop.
        self._spare: dict[int, list[mmap.mmap]] = {}
        self._spare_bytes = 0
        self.writes = 0
        self.reads = 0
        self.corrupt = 0
        self.evicted = 0
        self.dropped = {"queue": 0, "room": 0, "quota": 0, "failed": 0, "corrupt": 0}
        self.failed = ""
        self.restored = self._restore()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="emsd-disk-flush", daemon=True)
        self._flusher.start()

    # -- start and stop -------------------------------------------------------------------

    def _restore(self) -> int:
        """Index the ledger's committed rows; forget those that do not fit. Returns blocks indexed."""
        names = self.ledger.names()
        for ns, name in names.items():
            self._ns[name] = ns
            self._ns_names[ns] = name
        ids, rows = self.ledger.committed()
        self._rows = int(ids.max()) + 1 if ids.size else 0
        unused = np.ones(self._rows, dtype=bool)
        unused[ids] = False
        self._free_rows = np.flatnonzero(unused)[::-1].tolist()  # popped from the end: lowest first
        forgot = ids[~self._index_rows(ids, rows)].tolist()
        for row in forgot:
            self.ledger.forget(row)
        self._free_rows += forgot
        self.ledger.flush()
        return len(self._index)

    def _index_rows(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``_restore``'s work: index the rows (ids ``ids``) that fit, as whole arrays a namespace
        at a time, oldest row first in the LRU orders; per row, whether it was indexed."""
        nss = rows["ns"].astype(np.int64)
        offsets, lengths = rows["offset"].astype(np.int64), rows["length"].astype(np.int64)
        slots = slot_for(lengths)
        fits = np.isin(nss, np.fromiter(self._ns_names, dtype=np.int64, count=len(self._ns_names)))
        fits[fits] = self.space.restore_many(offsets[fits], lengths[fits])
        entries = np.zeros(ids.size, dtype=np.int64)  # entry id per row, 0 not indexed
        for ns in _distinct(nss[fits]):
            sel = np.flatnonzero(fits & (nss == ns))
            keys = KeyBatch(rows["words"][sel].astype(np.uint64), rows["tag"][sel])
            got, created = self._index.insert(ns, keys, np.zeros(sel.size, dtype=np.uint32),
                                              lengths[sel].astype(np.uint32), READY, 0)
            for j in sel[~created].tolist():  # the same key twice: the first row wins
                self.space.free(int(offsets[j]), int(lengths[j]))
            entries[sel[created]] = got[created]
            self._count(ns, int(slots[sel[created]].sum()))
        self._fit()
        at = np.flatnonzero(entries)  # in row order: the LRU order a restart starts from
        e = entries[at]
        self._offset[e] = offsets[at]
        self._row[e] = ids[at]
        self._digest[e] = rows["sum"][at]
        self._ready[e] = 1
        self._owners.set_many(offsets[at], slots[at], e)
        self._lru.extend(0, e)
        lists = np.zeros(NS_SLOTS, dtype=np.int64)  # namespace id -> its tenant's list
        for ns in _distinct(nss[at]):
            lists[ns] = self._tenant_number(self._tenant_of(ns))
        tenants = lists[nss[at]]
        for t in _distinct(tenants):
            self._by_tenant.extend(t, e[tenants == t])
        return entries != 0

    def close(self) -> None:
        """Finish the queued demotions, flush the index and close the files (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.engine.close(wait=True)
        self._flusher.join()
        with self._lock:
            self.ledger.close()
            self.data.close()
            for bufs in self._spare.values():
                for buf in bufs:
                    buf.close()
            self._spare.clear()
            self._spare_bytes = 0

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL):
            try:  # without the lock: a slow flush must not stall the loads that look here
                self.ledger.flush()
            except OSError as exc:
                self._fail(f"flushing the index: {exc}")

    # -- health -----------------------------------------------------------------------------

    def check(self) -> str:
        """"" while the tier works, else why not (also notices a data file deleted or unmounted)."""
        if not self.failed and self.data.fd >= 0:
            try:
                if os.fstat(self.data.fd).st_nlink == 0:
                    self._fail(f"{self.data.path} was removed")
            except OSError as exc:
                self._fail(f"{self.data.path}: {exc}")
        return self.failed

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = why
        log.error("disk tier failed: %s; carrying on with DRAM only", why)

    # -- namespaces -------------------------------------------------------------------------

    def _ns_id(self, name: str, create: bool) -> int | None:
        ns = self._ns.get(name)
        if ns is None and create:
            free = next((i for i in range(len(self._ns_names), NS_SLOTS) if i not in self._ns_names), None)
            if free is None:
                free = next((i for i in range(NS_SLOTS) if i not in self._ns_names), None)
            if free is None or not self.ledger.set_name(free, name):
                return None
            ns = self._ns[name] = free
            self._ns_tenant.pop(free, None)  # looked up before it had a name
            self._ns_names[free] = name
        return ns

    def drop(self, name: str) -> int:
        """Remove every block of namespace ``name`` (``emsctl drop``, ``clear()``); returns how many.

        Its blocks are found as ``keys_on_disk`` finds them (the ledger's committed rows of
        the namespace, and the queue), not by a walk of the whole index: a drop of one
        namespace costs its own blocks, whatever the others hold on disk.
        """
        with self._lock:
            ns = self._ns.get(name)
            if ns is None:
                return 0
            nss, on_disk = self.ledger.committed_keys()
            kbs = set(key_bytes(on_disk.take(np.flatnonzero(nss == ns))))
            kbs.update(kb for (n, kb) in self._staged if n == ns)  # queued, or being written
            if self.failed:  # a write that failed left its entry in neither (nothing is served now)
                live = self._index.live_ids()
                kbs.update(key_bytes(self._index.keys_of(live[self._index.ns_of(live) == ns])))
            if not kbs:
                return 0
            for i in self._index.find(ns, batch_of(list(kbs))).tolist():
                if i >= FIRST_ID:
                    self._remove(i)
            for kb in kbs:
                self._staged.pop((ns, kb), None)  # its write is skipped
            return len(kbs)

    def discard(self, name: str, keys: KeyBatch) -> int:
        """Remove these blocks of namespace ``name`` (on disk or queued for it: the write is
        skipped); returns how many were here. For blocks that now live on another node."""
        with self._lock:
            ns = self._ns.get(name)
            if ns is None:
                return 0
            gone, done = 0, set()
            for i, kb in zip(self._index.find(ns, keys).tolist(), key_bytes(keys), strict=True):
                held = i >= FIRST_ID and i not in done
                if held:
                    self._remove(i)
                    done.add(i)
                queued = self._staged.pop((ns, kb), None) is not None
                gone += held or queued
            return gone

    def keys_on_disk(self) -> dict[str, KeyBatch]:
        """Every namespace's keys whose blocks are whole on disk or queued for writing there now
        (being written included): a snapshot, what a drain or a handoff moves. Touches nothing.

        The blocks whole on disk are the ledger's committed rows (a row is committed with
        the entry's READY, under the lock, and forgotten when it leaves the index), read as
        arrays: no step per block, so a tier of a million blocks answers in milliseconds,
        and holds the lock (which the writers and every load's look at the tier take) that
        long. Only the queue, bounded by ``queue_bytes``, is walked block by block.
        """
        with self._lock:
            nss, on_disk = self.ledger.committed_keys()
            staged: dict[int, list[bytes]] = {}
            for (ns, kb) in self._staged:
                staged.setdefault(ns, []).append(kb)
            queued: dict[int, list[bytes]] = {}
            for ns, kbs in staged.items():  # not on disk yet: not in a committed row
                ready = self._ready[self._index.find(ns, batch_of(kbs))]
                if not ready.all():
                    queued[ns] = [kb for kb, r in zip(kbs, ready.tolist(), strict=True) if not r]
            names = dict(self._ns_names)
        out: dict[str, KeyBatch] = {}
        present = np.unique(nss)
        for ns in np.union1d(present, np.array(list(queued), dtype=nss.dtype)).tolist():
            alone = present.size == 1 and present[0] == ns  # every committed row is this namespace's
            keys = on_disk if alone else on_disk.take(np.flatnonzero(nss == ns))
            if ns in queued:
                more = batch_of(queued[ns])
                keys = KeyBatch(np.concatenate([keys.words, more.words]),
                                np.concatenate([keys.tags, more.tags]))
            out[names[ns]] = keys
        return out

    # -- presence -----------------------------------------------------------------------------

    def present(self, name: str, keys: KeyBatch) -> np.ndarray:
        """Per key: a whole block of it is on disk, or queued for writing there (bool). Touches
        nothing."""
        out = np.zeros(len(keys), dtype=bool)
        ns = self._ns.get(name)
        if ns is None or self.failed or not (len(self._index) or self._staged):
            return out
        with self._lock:
            out[:] = self._ready[self._index.find(ns, keys)]
            if self._staged:
                for i, kb in enumerate(key_bytes(keys)):
                    out[i] = out[i] or (ns, kb) in self._staged
        return out

    # -- demotion -----------------------------------------------------------------------------

    def demote(self, name: str, keys: KeyBatch, pool: memoryview, offsets: np.ndarray,
               lengths: np.ndarray, sums: np.ndarray | None = None) -> int:
        """Queue blocks leaving DRAM (bytes at ``pool[offsets[i]:][:lengths[i]]``) for writing.

        Copies each block into a staging buffer now (its chunk is reused right
        after); never waits. Blocks already on disk are only refreshed (LRU).
        ``sums``: the pool's seals of the blocks (``emsd.pool.checksum``; 0 none):
        a block whose bytes no longer match its seal is not written.
        Returns how many were queued; the rest are counted in ``dropped``.
        """
        if self.failed:
            self.dropped["failed"] += len(keys)
            return 0
        ns = self._ns_id(name, create=True)
        if ns is None:
            self.dropped["room"] += len(keys)
            return 0
        queued = 0
        seals = sums.tolist() if sums is not None else [0] * len(keys)
        with self._lock:
            ids = self._index.find(ns, keys)
            self._touch_many(ids[ids >= FIRST_ID])
        for kb, off, n, seal, i in zip(key_bytes(keys), offsets.tolist(), lengths.tolist(), seals,
                                       ids.tolist(), strict=True):
            key = (ns, kb)
            if i >= FIRST_ID:  # on disk, or being written: refreshed above
                continue
            slot = slot_for(n)
            with self._lock:
                if key in self._staged:
                    continue
                if n > self.space.max_block or self.queued_bytes + slot > self.queue_bytes:
                    self.dropped["queue" if n <= self.space.max_block else "room"] += 1
                    continue
                self.queued += 1
                self.queued_bytes += slot
                spare = self._spare.get(slot)
                reused = spare.pop() if spare else None
                if reused is not None:
                    self._spare_bytes -= slot
            buf = reused if reused is not None else aligned(slot)
            buf[:n] = pool[off : off + n]
            with self._lock:
                self._staged[key] = (buf, n)
            self.engine.write(self._write, key, name, buf, n, seal)
            queued += 1
        return queued

    def _write(self, key: Key, name: str, buf: mmap.mmap, length: int, seal: int = 0) -> None:
        """Writer thread: place, write, record one staged block (``seal``: its pool digest, 0 none)."""
        slot = slot_for(length)
        try:
            with memoryview(buf) as view:
                sealed = digest(view[:length])
            if seal and sealed != seal:  # changed in the pool since its commit: not worth keeping
                self.dropped["corrupt"] += 1
                return
            with self._lock:
                if self.failed:
                    self.dropped["failed"] += 1
                    return
                one = batch_of([key[1]])
                if key not in self._staged or self._index.find(key[0], one)[0] >= FIRST_ID:
                    return  # dropped, or written meanwhile
                why = self._make_room(key[0], name, length)
                if why:
                    self.dropped[why] += 1
                    return
                offset = self.space.alloc(length)
                assert offset is not None  # _make_room made room
                row = self._free_rows.pop() if self._free_rows else self._take_row()
                i = self._put(key[0], one, offset, length, row, sealed)
                self._count(key[0], slot)
            with memoryview(buf) as view:
                self.data.write(offset, view)
            with self._lock:
                self._ready[i] = 1
                self.writes += 1
                if self._index.state[i] == HELD:  # dropped while being written
                    self._settle(i)
                else:
                    self.ledger.record(row, np.frombuffer(key[1][:32], dtype="<u8"), key[1][32], key[0],
                                       offset, length, sealed)
        except OSError as exc:
            self._fail(f"writing {self.data.path}: {exc}")
        finally:
            with self._lock:
                if self._staged.get(key, (None,))[0] is buf:
                    del self._staged[key]  # on disk now (or never): its buffer goes back
                self.queued -= 1
                self.queued_bytes -= slot
                keep = self._spare_bytes + slot <= self.queue_bytes // 2
                if keep:  # for the next demotion: no fresh pages to fault in
                    self._spare.setdefault(slot, []).append(buf)
                    self._spare_bytes += slot
                self._idle.notify_all()
            if not keep:
                buf.close()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no demotion is queued or being written; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self.queued == 0, timeout)

    def _take_row(self) -> int:
        self._rows += 1
        return self._rows - 1

    def _make_room(self, ns: int, name: str, length: int) -> str:
        """Under the lock: evict until a slot for ``length`` is free and the tenant's quota
        holds it. "" when done, else the reason it cannot be: "room" or "quota"."""
        slot = slot_for(length)
        limit = self.quota(name) if self.quota is not None else None
        if limit is not None:
            tenant = self.tenant(name)
            over = self._tenant_bytes.get(tenant, 0) + slot - limit
            if over > 0:
                for k in self._quota_victims(tenant, over):
                    self._evict(k)
            if self._tenant_bytes.get(tenant, 0) + slot > limit:
                return "quota"
        tries = len(self._index)
        while not self.space.has_room(length) and tries > 0:
            tries -= 1
            victim = self._lru.first(0)
            if victim == NO_ID:  # every indexed block gone, the rest is held by reads
                break
            size = slot_for(int(self._index.length[victim]))
            if self._busy(victim):  # being written or read: recent anyway
                self._touch(victim)
            elif size == slot:
                self._evict(victim)
            else:  # another size: free what is idle on its extent, for the extent to come free
                extent = self.space.extent_of(int(self._offset[victim]))
                for held in self._owners.on_extent(extent, size):
                    if self._index.state[held] == READY and not self._busy(held):
                        self._evict(held)
        return "" if self.space.has_room(length) else "room"

    def _fit(self) -> None:
        """The per-entry arrays as long as the index's (which grows on inserts)."""
        cap = self._index.capacity
        if self._row.size < cap:
            for name in ("_offset", "_row", "_digest", "_ready"):
                old = getattr(self, name)
                new = np.zeros(cap, dtype=old.dtype)
                new[: old.size] = old
                setattr(self, name, new)

    def _tenant_number(self, tenant: str) -> int:
        """The list of ``tenant``'s blocks in ``_by_tenant``."""
        return self._tenant_list.setdefault(tenant, len(self._tenant_list))

    def _put(self, ns: int, one: KeyBatch, offset: int, length: int, row: int, sealed: int) -> int:
        """Under the lock: index the block of key ``one`` (a batch of one) being written to the
        slot at ``offset``, as the newest block (of all, and of its tenant); its entry id."""
        i = self._index.insert_one(ns, one, 0, length, READY, 0)
        self._fit()
        self._offset[i], self._row[i], self._digest[i], self._ready[i] = offset, row, sealed, 0
        self._lru.push(0, i)
        self._by_tenant.push(self._tenant_number(self._tenant_of(ns)), i)
        self._owners.set(offset, slot_for(length), i)
        return i

    def _busy(self, i: int) -> bool:
        """Entry ``i`` is being written or read: its slot stays."""
        return not self._ready[i] or self._index.pins[i] > 0

    def _touch_many(self, ids: np.ndarray) -> None:
        """Under the lock: ``_touch`` of each indexed entry of ``ids``, in turn."""
        if ids.size:
            self._lru.touch_many(ids)
            self._by_tenant.touch_many(ids)

    def _touch(self, i: int) -> None:
        """Under the lock: indexed entry ``i`` is used now (the newest, of all and of its tenant)."""
        self._lru.touch(i)
        self._by_tenant.touch(i)

    def _quota_victims(self, tenant: str, need: int) -> list[int]:
        """Under the lock: ``tenant``'s oldest idle blocks whose slots add up to at least
        ``need`` bytes (all its idle ones when they do not). Walks only this tenant's blocks,
        oldest first, and stops there: a demotion at the quota costs the few it evicts."""
        victims: list[int] = []
        freed = 0
        if tenant not in self._tenant_list:
            return victims
        for i in self._by_tenant.oldest(self._tenant_list[tenant]):
            if self._busy(i):
                continue
            victims.append(i)
            freed += slot_for(int(self._index.length[i]))
            if freed >= need:
                break
        return victims

    def _evict(self, i: int) -> None:
        self.evicted += 1
        self._remove(i)

    # -- promotion ---------------------------------------------------------------------------

    def checkout(self, name: str, keys: KeyBatch) -> list[DiskEntry | None]:
        """Per key: its READY entry, now READING (the caller must ``checkin`` it), or None.

        Counts as a use (LRU).
        """
        out: list[DiskEntry | None] = [None] * len(keys)
        ns = self._ns.get(name)
        if ns is None or self.failed:
            return out
        with self._lock:
            ids = self._index.find(ns, keys)
            hit = np.flatnonzero(self._ready[ids])  # id 0 (absent) is never ready
            for j, i in zip(hit.tolist(), ids[hit].tolist(), strict=True):
                self._index.pins[i] += 1
                out[j] = DiskEntry(i, int(self._offset[i]), int(self._index.length[i]),
                                   int(self._digest[i]))
            self._touch_many(ids[hit])
        return out

    def staged_lengths(self, name: str, keys: KeyBatch) -> list[int | None]:
        """Per key: the length of its block queued for writing and not on disk yet, or None."""
        ns = self._ns.get(name)
        if ns is None or not self._staged:
            return [None] * len(keys)
        with self._lock:
            return [self._staged.get((ns, kb), (None, None))[1] for kb in key_bytes(keys)]

    def copy_staged(self, name: str, keys: KeyBatch, dests: list[memoryview]) -> list[bool]:
        """Copy each key's block queued for writing into ``dests[i]`` (of its length), from its
        staging buffer (a memory copy, no I/O: the event loop may call it); per key whether it
        was still queued. Counts as a read."""
        ns = self._ns.get(name)
        out = [False] * len(keys)
        if ns is None:
            return out
        with self._lock:  # the writer recycles a buffer only under the lock
            for i, kb in enumerate(key_bytes(keys)):
                got = self._staged.get((ns, kb))
                if got is not None and got[1] == len(dests[i]):
                    with memoryview(got[0]) as view:
                        dests[i][:] = view[: got[1]]
                    out[i] = True
                    self.reads += 1
        return out

    def read(self, entry: DiskEntry, dest: memoryview, base: int) -> bool:
        """Reader thread: the block's bytes into ``dest`` (``base``: its address); True when
        they match the block's digest. False on a mismatch (the block is dropped) or on an
        I/O error (the tier fails). Ends the READING state taken by ``checkout``."""
        return self.read_run([entry], [dest], [base])[0]

    def read_run(self, entries: list[DiskEntry], dests: list[memoryview], bases: list[int]) -> list[bool]:
        """Reader thread: ``read`` of each block of a run (``emsd.tier.engine.runs``: one block,
        or slots that follow one another, each movable with O_DIRECT), in one I/O. Per block,
        whether it read right. ``on_read`` gets the I/O's time."""
        start = time.perf_counter()
        ok = [False] * len(entries)
        try:
            if FAULTS is not None:
                io_fault("disk.read")
            if len(entries) == 1:
                read_block(self.data, entries[0].offset, dests[0], bases[0])
            else:
                self.data.readv(entries[0].offset, dests)
            ok = [digest(d) == e.digest for e, d in zip(entries, dests, strict=True)]
            for e, right in zip(entries, ok, strict=True):
                if not right:
                    log.warning("disk tier: block at %d failed its checksum; a miss, dropped", e.offset)
        except (OSError, ValueError) as exc:
            self._fail(f"reading {self.data.path}: {exc}")
        finally:
            for e, right in zip(entries, ok, strict=True):
                self.checkin(e, right)
        if self.on_read is not None:
            self.on_read(time.perf_counter() - start)
        return ok

    def checkin(self, entry: DiskEntry, ok: bool = True) -> None:
        """End one READING of ``entry``; a block that read wrong (``ok`` False) is dropped."""
        i = entry.id
        with self._lock:
            self._index.pins[i] -= 1
            if ok:
                self.reads += 1
            elif not self.failed:
                self.corrupt += 1
                if self._index.state[i] == READY:  # still indexed: it goes
                    self._remove(i)
            if self._index.state[i] == HELD:
                self._settle(i)

    # -- bookkeeping (under the lock) -----------------------------------------------------------

    def _remove(self, i: int) -> None:
        """Take entry ``i`` out of the index (HELD: nothing finds it); its slot, row and id go
        now, or when it is idle."""
        self._lru.remove(i)
        self._by_tenant.remove(i)
        self._index.detach(i)
        self.ledger.forget(int(self._row[i]))  # first: the slot may be written again from here on
        self._settle(i)

    def _settle(self, i: int) -> None:
        """Free a HELD entry's slot, row and id once it is idle (once)."""
        if self._busy(i) or self._row[i] < 0:
            return
        offset, length = int(self._offset[i]), int(self._index.length[i])
        self._owners.clear(offset, slot_for(length), i)
        self.space.free(offset, length)
        self._free_rows.append(int(self._row[i]))
        self._count(int(self._index.nstag[i]) >> 8, -slot_for(length))
        self._row[i] = -1
        self._index.release(i)

    def _count(self, ns: int, delta: int) -> None:
        tenant = self._tenant_of(ns)
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + delta

    def _tenant_of(self, ns: int) -> str:
        """The tenant namespace id ``ns`` belongs to (``tenant`` of its name, kept per id: an
        id names one namespace for the tier's life)."""
        tenant = self._ns_tenant.get(ns)
        if tenant is None:
            tenant = self._ns_tenant[ns] = self.tenant(self._ns_names.get(ns, ""))
        return tenant

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def stats(self) -> TierStats:
        return TierStats(self.space.bytes_used, self.space.size, len(self._index), self.queued,
                         self.queued_bytes, self.writes, self.reads, dict(self.dropped), self.corrupt,
                         self.evicted, self.data.direct, self.failed)

    def index_nbytes(self) -> int:
        """Bytes the in-memory index holds (its arrays, allocated; not the ledger's file pages
        nor the free-slot sets of ``DiskSpace``)."""
        with self._lock:
            fields = (self._offset, self._row, self._digest, self._ready)
            return (self._index.nbytes() + sum(a.nbytes for a in fields) + self._lru.nbytes()
                    + self._by_tenant.nbytes() + self._owners.nbytes())
