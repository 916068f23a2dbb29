"""BlockStore: the pool's synchronous core, the one object the daemon calls.

It ties the index (``emsd.pool.index``: key -> entry), the slab allocator
(``emsd.pool.slab``: entry -> chunk of the region) and the eviction policy
(``emsd.pool.eviction``) together. It never awaits and never touches the
region's bytes or a socket: it hands out places (byte offsets in the region)
and keeps track of what is where; clients move the bytes.

A block's life::

    (absent) --reserve--> PENDING --commit--> READY --evict--> (absent)
                             |                  ^ |
                             +--abort--> (absent) +-- pin / release (pins)

- PENDING: reserved, being written by one client. Never visible to ``pin``
  or ``exists``, never evicted; only ``commit`` or ``abort`` end it (the
  daemon aborts a closing connection's reservations).
- READY: committed, readable. Evictable when no reader pins it.

Blocks are content-addressed: the same (namespace, key) always names the same
bytes, so a key that is READY or PENDING is never written twice.

Recency is a logical clock that only calls advance (``reserve``,
``commit``, ``pin``, ``release``), so tests are deterministic; the policy
object (``self.recency``, an ``eviction.Recency``) decides at each of those
calls how far it moves and which stamps to write. The index keeps it in 32
bits; before it wraps every stamp is shifted down, keeping the relative
order of the last 2**31 ticks (older entries tie as oldest).
Under the ``prefix`` eviction policy a call of n keys advances the clock by
n and stamps its keys head newest, tail oldest (``eviction.chain_stamps``),
``commit`` keeps the stamps its ``reserve`` gave and ``release`` those its
``pin`` gave (a commit holds only the new tail of a chain, a release no
order: restamping would make a tail newer than its head). A call that
continues a chain past a prefix it left out passes that prefix's last key
(``prev``), and is stamped below it.

Admission (``emsd.pool.admission``): a namespace with a threshold N > 1
stores a block only from the N-th save of its key on; ``reserve(admit=True)``
(a client's save) counts the sightings and cuts the batch at the first key
not admitted yet. Peer fetches and forwards do not count: the block was
admitted where it was first saved.

Eviction, when a size class has no free chunk and no free page is left, is
LRU (by the stamps of the configured policy, ``lru`` or ``prefix``) among
the class's READY unpinned entries, read-cache copies of blocks
owned elsewhere (``mark_cached``) before owned ones; then page stealing takes back
the page of another class whose entries are all READY and unpinned and
whose latest use is the oldest. Before evicting its own blocks, a class
takes back such a page if every block on it is older than the class's own
oldest (``_older_page``; after a look that found nothing, the next waits
for a page's worth of the class's evictions and 1/1024 of the entries):
LRU across classes, a page at a time, so that blocks of a new size
(another model) do not stay confined to a page or two while old blocks of
another size hold the rest of the pool.

LRU victims are found by a scan that keeps
the oldest 1/16 of the eligible entries as a queue of candidates; a
candidate is used only if it is unchanged since (same state, unpinned, same
stamp), which keeps the order exact under ``lru`` (every later use stamps
the clock, and ``release`` stamps too) while the scan's cost is shared by
many evictions. Under ``prefix`` a call bounded by its predecessor can stamp
below entries already queued; those wait for the next scan (the queue is
the oldest 1/16, so the order is off by at most that much).

A reservation for a copy fetched from another node (``reserve(copy=True)``,
marked a copy from then on) takes from blocks this node owns, by plain LRU
or a page steal, at most the bytes copies hold below ``copy_floor``, so that
a node whose pool is full of its own blocks still has room to read through;
beyond that it evicts only other copies (of its class, or a page whose owned
blocks fit what is left), or fails: a miss (``pool.read_cache_share``; 0: a
copy never evicts an owned block). What one node reads from others never
costs the cluster more than that share of the blocks only it holds.

Grants (``grant``, ``ungrant``, ``reserve(at=...)``): a save of one round
trip. A client is handed chunks ahead of time, without entries; it writes
its next blocks into them and then names them in the save, which makes the
entries there (PENDING, and the daemon commits them at once) instead of
allocating. Until then a granted chunk is nobody's block: no eviction takes
it and the page it is on is never stolen (``_page_ages`` counts it as
blocked). Whoever holds grants (the daemon's session of the client) gives
them back when it ends.

Accounting: ``bytes_used`` is the bytes of chunks holding an entry (PENDING
or READY) or granted; ``bytes_free`` the bytes of free pages and free chunks; the rest
of ``capacity`` is slack no chunk can use (page tails past the last chunk of
their class, and the region past the last whole page)::

    capacity == bytes_used + bytes_free
                + sum(c.pages * c.page_size - (c.chunks_used + c.chunks_free) * c.chunk_size)
                + capacity % page_size
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from emsd.pool.admission import AdmissionRule, SeenSketch, admitted, key_digest
from emsd.pool.eviction import copies_first, lru_victims, page_ages, recency, steal_choice
from emsd.pool.index import EMPTY, FIRST_ID, PENDING, READY, BlockIndex, first_occurrences
from emsd.pool.keys import KeyBatch
from emsd.pool.ledger import Ledger
from emsd.pool.shared_index import SharedIndex
from emsd.pool.slab import SlabAllocator, SlabError

try:  # the eviction scan's filter in C (with the index's loops); numpy gives the same ids
    from emsd.pool import _probe  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - extension not built
    _probe = None  # type: ignore[assignment]

CLOCK_LIMIT = (1 << 32) - 1
RECHECK_FRACTION = 1024  # _older_page: after a look that finds nothing, wait for entries / 1024 evictions
LRU_QUEUE_FRACTION = 16  # a scan queues the oldest 1/16 of the eligible entries
COPY_FLOOR_SHARE = 16  # default copy_floor: copies may take 1/16 of the pool from owned blocks
_READY = np.uint8(READY)  # numpy scalars: with them numpy skips a slow conversion
_ONE = np.uint32(1)
# Pins are u32 in the index: an entry pinned this many times is not pinned again (a miss), so
# that no batch (keys repeated) can wrap its count to 0 and let the entry be evicted while read.
MAX_PINS = np.uint32(1 << 31)
_NO_U4 = np.zeros(0, dtype=np.uint32)
_NO_U8 = np.zeros(0, dtype=np.uint64)
_FIRST = np.zeros(1, dtype=np.int64)  # the positions of a one-key call
_NO_SUM = np.uint64(0)


class Status(IntEnum):
    """Outcome of ``reserve`` for one key."""

    NEW = 0  # a place was reserved: write the block at ``offset``, then commit
    PRESENT = 1  # the key is READY or PENDING already: nothing to write
    FAILED = 2  # no place (bad size, or no room even after eviction)


@dataclass
class Reservation:
    status: np.ndarray  # (n,) uint8 Status per key
    handles: np.ndarray  # (n,) uint32 entry id, meaningful where status == NEW
    offsets: np.ndarray  # (n,) uint64 byte offset in the region, meaningful where NEW

    def padded(self, n: int) -> Reservation:
        """This reservation of the first keys of a batch of ``n``, the others FAILED."""
        k = self.status.size
        if k == n:
            return self
        status = np.full(n, int(Status.FAILED), dtype=np.uint8)
        handles = np.zeros(n, dtype=np.uint32)
        offsets = np.zeros(n, dtype=np.uint64)
        status[:k], handles[:k], offsets[:k] = self.status, self.handles, self.offsets
        return Reservation(status, handles, offsets)


@dataclass
class Pinned:
    count: int  # number of leading keys that are READY (stops at the first miss)
    handles: np.ndarray  # (count,) uint32
    offsets: np.ndarray  # (count,) uint64
    lengths: np.ndarray  # (count,) uint64

    @property
    def nbytes(self) -> int:
        """The bytes of the pinned blocks (one block: in a scalar)."""
        return int(self.lengths[0]) if self.lengths.size == 1 else int(self.lengths.sum())


@dataclass
class ClassStats:
    chunk_size: int
    pages: int
    chunks_used: int
    chunks_free: int
    page_size: int


@dataclass
class StoreStats:
    capacity: int
    bytes_used: int
    bytes_free: int
    entries: int  # PENDING + READY
    pending: int
    pinned: int  # entries with at least one pin
    evictions: dict[str, int]  # by reason: "lru", "page", "moved"
    ns_bytes: dict[int, int]  # committed (READY) bytes per namespace id
    classes: list[ClassStats] = field(default_factory=list)
    cached: int = 0  # READY entries that are read-cache copies of blocks owned elsewhere
    granted: int = 0  # bytes of chunks granted to clients (``BlockStore.grant``), not yet used
    unpublished: int = 0  # blocks the shared index had no slot for (``emsd.pool.shared_index``)


@dataclass
class _LruQueue:
    """Oldest eligible entries of one class at the last scan, oldest first."""

    ids: np.ndarray
    stamps: np.ndarray
    pos: int = 0


class BlockStore:
    """Index + slab allocator + eviction over a region of ``capacity`` bytes.

    ``eviction``: ``"lru"`` or ``"prefix"`` (see ``emsd.pool.eviction``);
    ``admission``: the per-namespace admission thresholds (default: off).
    Raises ``ValueError`` for an unknown eviction policy.
    """

    def __init__(self, capacity: int, page_size: int, eviction: str = "lru",
                 admission: AdmissionRule | None = None) -> None:
        self.recency = recency(eviction)  # how calls stamp what they touch
        self.scalar_paths = True  # one-key calls take scalar steps (False: the batch path; tests)
        self.eviction = eviction
        self.admission = admission or AdmissionRule()
        self._admit_after: dict[int, int] = {}  # namespace id -> threshold (absent: 1)
        self._group: dict[int, int] = {}  # namespace id -> slab group (absent: 0; ``set_group``)
        self._seen: SeenSketch | None = None  # made on the first namespace with a threshold
        self.slabs = SlabAllocator(capacity, page_size)
        self.index = BlockIndex()
        self.capacity = capacity
        self.page_size = self.slabs.page_size
        self.max_block = min(self.page_size, 0xFFFFFFFF)  # lengths are 32-bit
        self.clock_limit = CLOCK_LIMIT
        self.lru_queue_fraction = LRU_QUEUE_FRACTION
        self.copy_floor = capacity // COPY_FLOOR_SHARE  # bytes copies may take from owned blocks
        self._unit = np.uint64(self.slabs.align)
        self._units_per_page = self.page_size // self.slabs.align
        self._clock = 0
        self._pending = 0
        self._evictions = {"lru": 0, "page": 0}
        self._ns_bytes: dict[int, int] = {}
        self.sums: np.ndarray | None = None  # per entry id: checksum (emsd.pool.checksum), 0 none
        self._queues: dict[int, _LruQueue] = {}
        self._recheck: dict[int, int] = {}  # class -> own evictions before _older_page looks again
        self._granted: dict[int, int] = {}  # byte offset -> chunk size of each chunk granted, unused
        self.granted_bytes = 0  # their bytes
        self.ledger: Ledger | None = None  # rows of committed blocks, for a warm restart
        # Called with (ids, reason) before evicted entries go, while their bytes are still in
        # their chunks (the disk tier copies them for demotion: emsd.tier.stack). Must not call back.
        self.on_evict: Callable[[np.ndarray, str], None] | None = None
        # READY blocks published for clients to find themselves (emsd.pool.shared_index):
        # published at commit, retracted before an entry goes (before its chunk can be reused).
        self.shared: SharedIndex | None = None

    # -- the contract -------------------------------------------------------------

    def name_namespace(self, ns: int, name: str) -> None:
        """Take namespace ``ns``'s admission threshold from its ``name`` (``self.admission``)."""
        self.set_admit_after(ns, self.admission.threshold(name))
        if self.shared is not None:  # an id given a name (again): its blocks may be published
            self.shared.show(ns)

    def set_group(self, ns: int, group: int) -> None:
        """Namespace ``ns``'s blocks go on pages of slab group ``group`` (0 by default): the
        daemon gives each tenant a group, whose pages are that tenant's memory alone
        (``emsd.pool.tenancy``). Set before the namespace's first block."""
        if group:
            self._group[ns] = group
        else:
            self._group.pop(ns, None)

    def set_admit_after(self, ns: int, n: int) -> None:
        """Store namespace ``ns``'s blocks only from their ``n``-th save on (1: always).

        Raises ``ValueError`` if ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"admission threshold must be >= 1 (got {n})")
        if n == 1:
            self._admit_after.pop(ns, None)
            return
        self._admit_after[ns] = n
        if self._seen is None:
            self._seen = SeenSketch()

    def reserve(self, ns: int, keys: KeyBatch, sizes: np.ndarray, admit: bool = False,
                prev: KeyBatch | None = None, at: np.ndarray | None = None,
                copy: bool = False) -> Reservation:
        """Reserve places for blocks ``keys`` of ``sizes`` bytes, in order.

        Per key: present already (READY, or PENDING by anyone, including an
        earlier key of this batch) -> PRESENT, nothing allocated. Else a chunk is found for ``sizes[i]``
        (1..``max_block``): the class's free chunks, a free page, a page of another
        class whose blocks are all older than the class's oldest, evicting the
        class's least recently used READY unpinned entries, or taking a page
        back from another class; a PENDING entry is made -> NEW with its
        handle and offset. The first key that gets no place (bad size, no
        room) and every key after it are FAILED, since a load only uses
        consecutive blocks; places already reserved by this call are kept.
        Keys of the batch that are present are not evicted to make room for
        it, and the READY ones count as used now (LRU): someone has just
        computed them again. With ``admit`` (a client's save) and an
        admission threshold for ``ns``, each absent key counts a sighting and
        the first key not admitted yet is FAILED with every key after it.
        ``prev``: the one key before ``keys[0]`` in their chain, when the
        caller left a prefix out (prefix policy only: see ``_below``).
        ``at``: for a save into granted chunks (``grant``), the byte offset of
        the chunk for each key, of the class of its size (the caller checks
        both): a NEW key takes its chunk (no longer granted) and nothing is
        allocated or evicted; the chunks of the other keys stay granted.
        ``copy``: the blocks are copies fetched from their owners, marked so
        (``cached``) from the start, which evict owned blocks only while copies
        hold less than ``copy_floor`` bytes (see the module docstring).
        """
        n = len(keys)
        if len(sizes) != n or (at is not None and len(at) != n):
            raise ValueError(f"{len(sizes)} sizes for {n} keys")
        status = np.full(n, int(Status.FAILED), dtype=np.uint8)
        handles = np.zeros(n, dtype=np.uint32)
        offsets = np.zeros(n, dtype=np.uint64)
        if n == 0:
            return Reservation(status, handles, offsets)
        sizes = np.asarray(sizes)
        ids = self.index.find(ns, keys)
        if n == 1 and ids[0] == EMPTY and self.scalar_paths and not (admit and ns in self._admit_after):
            return self._reserve_one(ns, keys, sizes, ids, prev, at, copy)  # the usual one-block save
        stamp = self._tick(self.recency.reserve_ticks(n))
        need = ids == EMPTY
        absent = int(np.count_nonzero(need))
        if absent == n:  # the usual save: every key new, so none present (fewer steps: see below)
            if n > 1:
                need = first_occurrences(keys)
        elif absent > 1:
            pos = np.flatnonzero(need)
            need[pos[~first_occurrences(keys.take(pos))]] = False
        if at is not None or (int(sizes.min()) >= 1 and int(sizes.max()) <= self.max_block):
            cut = n  # every size is valid (the usual case: one test instead of five; ``at``: checked)
        else:
            bad = need & ~((sizes >= 1) & (sizes <= self.max_block))
            cut = int(bad.argmax()) if bad.any() else n
        if admit and ns in self._admit_after:
            cut = min(cut, self._admission_cut(ns, keys, need))
        todo = np.flatnonzero(need[:cut])
        present = _NO_U4 if absent == n else ids[ids != EMPTY]
        if present.size:
            np.add.at(self.index.pins, present, _ONE)  # keep them through this call's evictions
        try:
            made, cut = self._reserve_runs(ns, keys, todo, sizes, stamp, handles, offsets, cut, at, copy)
        finally:
            if present.size:
                np.subtract.at(self.index.pins, present, _ONE)
        status[:cut] = Status.PRESENT
        status[todo[:made]] = Status.NEW
        if copy and made:  # copies from the start: concurrent fetches see them (``_copy_budget``)
            self.index.cached[handles[todo[:made]]] = 1
        self.recency.reserved(self.index, stamp, n, lambda: self._below(ns, prev), ids, todo[:made],
                              handles, cut, present)
        return Reservation(status, handles, offsets)

    def _reserve_one(self, ns: int, keys: KeyBatch, sizes: np.ndarray, ids: np.ndarray,
                     prev: KeyBatch | None, at: np.ndarray | None, copy: bool) -> Reservation:
        """``reserve`` of one key that is absent (``ids``: its ``find``), with no admission to
        count: the same answer and effects in scalar steps."""
        stamp = self._tick(self.recency.reserve_ticks(1))
        status = np.array((Status.FAILED,), dtype=np.uint8)
        handles = np.zeros(1, dtype=np.uint32)
        offsets = np.zeros(1, dtype=np.uint64)
        size = int(sizes[0])
        offset: int | None = None
        if at is not None:  # a granted chunk of the size's class (the caller checked)
            got = np.asarray(at, dtype=np.uint64)
            self._ungranted(got)
            offset = int(got[0])
        elif 1 <= size <= self.max_block:
            cls = self.slabs.class_for(size, self._group.get(ns, 0))
            offset = None if cls is None else self._room_one(cls, copy)
        if offset is not None:
            i = self._pending_one(ns, keys, offset, size, stamp, prev)
            handles[0], offsets[0], status[0] = i, offset, Status.NEW
            if copy:
                self.index.cached[i] = 1
        return Reservation(status, handles, offsets)

    def _pending_one(self, ns: int, keys: KeyBatch, offset: int, size: int, stamp: int,
                     prev: KeyBatch | None) -> int:
        """A PENDING entry for the one absent key ``keys`` in the chunk at byte ``offset``, stamped
        as a reserve of one stamps it; its id."""
        i = self.index.insert_one(ns, keys, offset // self.slabs.align, size, PENDING, stamp)
        if self.sums is not None:
            self._set_sums(np.array((i,), dtype=np.uint32), _NO_SUM)
        self._pending += 1
        self.recency.reserved_one(self.index, stamp, i, lambda: self._below(ns, prev))
        return i

    def _room_one(self, cls: int, copy: bool) -> int | None:
        """``_room(cls, 1, copy)``: a free chunk in scalar steps, else evicting as it does."""
        offset = self.slabs.alloc(cls)
        if offset is not None:
            return offset
        got = self._room(cls, 1, copy)
        return int(got[0]) if got.size else None

    def reserve_granted_one(self, ns: int, keys: KeyBatch, size: int, at: int,
                            prev: KeyBatch | None = None) -> tuple[int, int]:
        """``reserve(ns, keys, [size], admit=True, prev=prev, at=[at])`` of one key (a PUT of
        one block into granted chunk ``at``, of the size's class: the caller checked), as
        (status, handle). Scalar steps when the key is absent and no admission threshold
        counts it (the usual one-block save); the batch path otherwise. The same answer and
        effects either way."""
        ids = self.index.find(ns, keys)
        if ids[0] != EMPTY or not self.scalar_paths or ns in self._admit_after:
            res = self.reserve(ns, keys, np.array((size,), dtype=np.uint64), admit=True, prev=prev,
                               at=np.array((at,), dtype=np.uint64))
            return int(res.status[0]), int(res.handles[0])
        stamp = self._tick(self.recency.reserve_ticks(1))
        self.granted_bytes -= self._granted.pop(at)
        return int(Status.NEW), self._pending_one(ns, keys, at, size, stamp, prev)

    def _below(self, ns: int, prev: KeyBatch | None) -> int | None:
        """The stamp of ``prev`` (one key) if it is READY, else None: the bound a call
        that continues its chain must stay under (``eviction.chain_stamps``)."""
        if prev is None or len(prev) != 1:
            return None
        pid = int(self.index.find(ns, prev)[0])
        if pid < FIRST_ID or self.index.state[pid] != READY:
            return None
        return int(self.index.last_used[pid])

    def _admission_cut(self, ns: int, keys: KeyBatch, need: np.ndarray) -> int:
        """Count a sighting of each absent key; the position of the first one not admitted
        yet (``len(keys)`` if all are)."""
        assert self._seen is not None
        absent = np.flatnonzero(need)
        if absent.size == 0:
            return len(keys)
        sub = keys.take(absent)
        counts = self._seen.add(key_digest(ns, sub.words, sub.tags))
        refused = ~admitted(counts, self._admit_after[ns])
        return int(absent[int(refused.argmax())]) if refused.any() else len(keys)

    def commit(self, handles: np.ndarray) -> int:
        """PENDING -> READY: readable now, counted in its namespace's bytes.

        Handles that are not PENDING are ignored; returns how many were
        committed.
        """
        if len(handles) == 1 and self.scalar_paths:  # one block a call: scalar checks
            i = int(handles[0])
            if not (FIRST_ID <= i < self.index.high_water and self.index.state[i] == PENDING):
                return 0
            return self.commit_reserved(np.array((i,), dtype=np.uint32))
        return self.commit_reserved(self._in_state(handles, PENDING))

    def commit_reserved(self, h: np.ndarray) -> int:
        """``commit`` of entries ``h`` (uint32) that the caller knows to be distinct and
        PENDING (the daemon: handles its session reserved and has not ended yet), without
        checking them again. Returns how many were committed."""
        if h.size == 0:
            return 0
        if h.size == 1:  # one block a call: a scalar write
            self.index.state[int(h[0])] = READY
        else:
            self.index.state[h] = READY
        if self.shared is not None:
            self.shared.publish(self.index, h, int(self._unit))
        self.recency.committed(self.index, h, self._tick)
        self._ns_add(h, 1)
        self._pending -= h.size
        self._record(h)
        return int(h.size)

    # -- checksums (kept here, computed by emsd.pool.checksum) --------------------

    def enable_checksums(self) -> None:
        """Keep a checksum per entry (0 until ``seal``ed); recorded in the ledger."""
        if self.sums is None:
            self.sums = np.zeros(max(1024, self.index.high_water), dtype=np.uint64)

    def places(self, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets, lengths) of entries ``handles`` (uint64 each)."""
        h = np.asarray(handles, dtype=np.uint32)
        return (self.index.offset[h].astype(np.uint64) * self._unit,
                self.index.length[h].astype(np.uint64))

    def seal(self, handles: np.ndarray, sums: np.ndarray) -> None:
        """Set the checksums of PENDING entries ``handles`` (others are left alone)."""
        if self.sums is None:
            return
        h = np.asarray(handles, dtype=np.uint32)
        ok = (h >= FIRST_ID) & (h < self.index.high_water)
        ok[ok] = self.index.state[h[ok]] == PENDING
        self._set_sums(h[ok], np.asarray(sums, dtype=np.uint64)[ok])

    def sums_of(self, handles: np.ndarray) -> np.ndarray:
        """Checksums of entries ``handles`` (0: none)."""
        h = np.asarray(handles, dtype=np.uint32)
        if self.sums is None or h.size == 0:
            return np.zeros(h.size, dtype=np.uint64)
        out = np.zeros(h.size, dtype=np.uint64)
        inside = h < self.sums.size
        out[inside] = self.sums[h[inside]]
        return out

    def _set_sums(self, ids: np.ndarray, sums: np.ndarray | np.uint64) -> None:
        assert self.sums is not None
        if ids.size and int(ids.max()) >= self.sums.size:
            grown = np.zeros(max(2 * self.sums.size, int(ids.max()) + 1), dtype=np.uint64)
            grown[: self.sums.size] = self.sums
            self.sums = grown
        self.sums[ids] = sums

    def abort(self, handles: np.ndarray) -> int:
        """PENDING -> freed (chunk and entry). Handles not PENDING are ignored;
        returns how many were aborted."""
        h = self._in_state(handles, PENDING)
        if h.size == 0:
            return 0
        self._free_chunks(h)
        self.index.remove(h)
        self._pending -= h.size
        return int(h.size)

    def grant(self, size: int, k: int, group: int = 0) -> np.ndarray:
        """Up to ``k`` chunks for blocks of ``size`` bytes, on pages of slab ``group``, handed
        to the caller without an entry: their byte offsets (uint64). Room is found as
        ``reserve`` finds it (free chunks, free pages, older pages of other classes, LRU
        eviction, page stealing).

        A granted chunk belongs to the caller until it names it in ``reserve(at=...)``
        (it then holds that block) or gives it back with ``ungrant``. No eviction
        touches it and its page is never stolen; it counts in ``bytes_used`` and in
        ``granted_bytes``. Empty if ``size`` is not in 1..``max_block``, ``k < 1``,
        or no room can be made (everything else pinned or pending).
        """
        if k < 1 or not 1 <= size <= self.max_block:
            return _NO_U8
        cls = self.slabs.class_for(size, group)
        if cls is None:
            return _NO_U8
        got = self._room(cls, k)
        chunk = self.slabs.classes[cls].chunk_size
        self._granted.update(dict.fromkeys(got.tolist(), chunk))
        self.granted_bytes += chunk * got.size
        return got

    def ungrant(self, offsets: np.ndarray) -> int:
        """Give back granted chunks (byte offsets, each granted and not used since, each
        once: the caller keeps track); returns how many."""
        offs = np.asarray(offsets, dtype=np.uint64)
        if offs.size == 0:
            return 0
        self._ungranted(offs)
        classes = self.slabs.class_of_offsets(offs)
        for cls in np.unique(classes).tolist():
            self.slabs.free_many(cls, offs[classes == cls])
        return int(offs.size)

    def _ungranted(self, offsets: np.ndarray) -> None:
        """Chunks ``offsets`` are granted no more (used for a block, or given back)."""
        self.granted_bytes -= sum(map(self._granted.pop, offsets.tolist()))

    def pin(self, ns: int, keys: KeyBatch, prev: KeyBatch | None = None) -> Pinned:
        """Pin the leading READY keys (up to the first key that is not READY).

        Each pinned entry gets one more pin (a key twice in the batch, two)
        and counts as used now (LRU). Pinned entries are never evicted until
        ``release``d. PENDING entries count as misses, and so do entries already
        pinned ``MAX_PINS`` times (the u32 count never wraps). ``prev``: as for ``reserve``.
        """
        ids = self.index.find(ns, keys, prefix=True)
        if ids.size == 1 and self.scalar_paths:  # one block a call: a fifth of the batch path's time
            return self._pin_one(ids, ns, prev)
        count = _leading((self.index.state.take(ids) == _READY) & (self.index.pins.take(ids) < MAX_PINS))
        if count == 0:
            return Pinned(0, _NO_U4, _NO_U8, _NO_U8)
        h = ids[:count]
        np.add.at(self.index.pins, h, _ONE)
        self.recency.pinned(self.index, h, self._tick, lambda: self._below(ns, prev))
        return Pinned(count, h, self.index.offset[h].astype(np.uint64) * self._unit,
                      self.index.length[h].astype(np.uint64))

    def _pin_one(self, ids: np.ndarray, ns: int, prev: KeyBatch | None) -> Pinned:
        """``pin`` of one key whose entry ``find`` gave (``ids``, one uint32)."""
        idx = self.index
        i = int(ids[0])  # EMPTY (0) when absent: a FREE sentinel, never READY
        if idx.state[i] != _READY or idx.pins[i] >= MAX_PINS:
            return Pinned(0, _NO_U4, _NO_U8, _NO_U8)
        idx.pins[i] += _ONE
        self.recency.pinned(idx, ids, self._tick, lambda: self._below(ns, prev))
        offsets = np.array((int(idx.offset[i]) * self.slabs.align,), dtype=np.uint64)
        return Pinned(1, ids, offsets, np.array((int(idx.length[i]),), dtype=np.uint64))

    def release(self, handles: np.ndarray) -> int:
        """One pin less per handle (never below 0); returns pins released.

        Under LRU the entry counts as used now: it was in use until this
        release. Under the prefix policy the stamps the pin gave stand.
        """
        if len(handles) == 1 and self.scalar_paths:  # one block a call: scalar steps
            return self._release_one(handles)
        h = self._known(handles)
        if h.size == 0:
            return 0
        u, c = np.unique(h, return_counts=True)
        pins = self.index.pins[u]
        dec = np.minimum(pins, c).astype(np.uint32)
        self.index.pins[u] = pins - dec
        done = int(dec.sum())
        if done:
            self.recency.released(self.index, u[dec > 0], self._tick)
        return done

    def _release_one(self, handles: np.ndarray) -> int:
        """``release`` of one handle."""
        i = int(handles[0])
        idx = self.index
        if not FIRST_ID <= i < idx.high_water or idx.pins[i] == 0:
            return 0
        idx.pins[i] -= _ONE
        self.recency.released(idx, np.array((i,), dtype=np.uint32), self._tick)
        return 1

    def touch(self, ns: int, keys: KeyBatch, prev: KeyBatch | None = None) -> tuple[int, int]:
        """The READY ones of ``keys`` count as used now, as a pin and its release would stamp
        them (clients read them themselves: ``emsd.pool.shared_index``; a batch may join
        several loads, so a key not READY any more does not stop the rest). Returns (how
        many, their bytes); pins nothing."""
        ids = self.index.find(ns, keys)
        if ids.size == 1 and self.scalar_paths:  # a batch of one load: scalar steps
            return self._touch_one(ids, ns, prev)
        h = ids[self.index.state.take(ids) == _READY]
        if h.size == 0:
            return 0, 0
        self.recency.pinned(self.index, h, self._tick, lambda: self._below(ns, prev))
        self.recency.released(self.index, np.unique(h), self._tick)
        return int(h.size), int(self.index.length[h].astype(np.int64).sum())

    def _touch_one(self, ids: np.ndarray, ns: int, prev: KeyBatch | None) -> tuple[int, int]:
        """``touch`` of one key whose entry ``find`` gave (``ids``, one uint32)."""
        idx = self.index
        i = int(ids[0])  # EMPTY (0) when absent: a FREE sentinel, never READY
        if idx.state[i] != _READY:
            return 0, 0
        self.recency.pinned(idx, ids, self._tick, lambda: self._below(ns, prev))
        self.recency.released(idx, ids, self._tick)
        return 1, int(idx.length[i])

    def exists(self, ns: int, keys: KeyBatch) -> int:
        """Number of leading keys that are READY; touches nothing (no LRU, no pin)."""
        ids = self.index.find(ns, keys, prefix=True)
        return _leading(self.index.state.take(ids) == _READY)

    def present(self, ns: int, keys: KeyBatch) -> np.ndarray:
        """Per key: READY here (bool); touches nothing."""
        return self.index.state.take(self.index.find(ns, keys)) == _READY

    def mark_cached(self, ns: int, keys: KeyBatch) -> int:
        """Flag the present ``keys`` as read-cache copies of blocks owned elsewhere
        (eviction takes them before owned blocks); returns how many were flagged."""
        ids = self.index.find(ns, keys)
        if ids.size == 1 and self.scalar_paths and ids[0] >= FIRST_ID and self.index.cached[ids[0]]:
            return 1  # a block fetched a call: flagged since its reserve, its ledger row with it
        ids = ids[ids >= FIRST_ID]
        self.index.cached[ids] = 1
        if self.ledger is not None:
            self.ledger.set_cached(ids, self.index.cached[ids])
        return int(ids.size)

    def discard(self, ns: int, keys: KeyBatch, reason: str = "moved") -> int:
        """Drop the READY, unpinned entries of ``keys`` (a local copy no longer wanted).

        Returns how many were dropped; absent, PENDING or pinned keys are left alone.
        """
        ids = self.index.find(ns, keys)
        ids = np.unique(ids[ids >= FIRST_ID])
        ids = ids[(self.index.state[ids] == READY) & (self.index.pins[ids] == 0)]
        if ids.size:
            self._evict(ids, reason)
        return int(ids.size)

    def discard_handles(self, handles: np.ndarray, reason: str = "transient") -> int:
        """Drop the READY, unpinned entries named by ``handles``; the rest are left alone.

        For copies that were wanted only while a caller held them pinned:
        while pinned, a handle cannot be evicted and so cannot be reused.
        """
        ids = np.unique(self._known(handles))
        ids = ids[(self.index.state[ids] == READY) & (self.index.pins[ids] == 0)]
        if ids.size:
            self._evict(ids, reason)
        return int(ids.size)

    def drop_namespaces(self, namespaces: list[int]) -> int:
        """Evict every READY, unpinned entry of ``namespaces`` (retired by
        ``Service.drop_namespace``: nothing can find them any more), in one scan;
        returns how many. Pinned and PENDING entries are left to age out like any other."""
        if not namespaces:
            return 0
        if self.shared is not None:  # pinned ones too: no client may find them again
            for ns in namespaces:
                self.shared.hide(ns)
        ids = self._evictable()
        ids = ids[np.isin(self.index.ns_of(ids), namespaces)]
        if ids.size:
            self._evict(ids, "dropped")
        return int(ids.size)

    def evict_within(self, namespaces: np.ndarray, nbytes: int, keep: np.ndarray) -> int:
        """Evict the least recently used READY unpinned entries of ``namespaces`` (never the ids
        in ``keep``) until at least ``nbytes`` of block lengths are freed, or none is left.

        For a tenant over its quota: only its own blocks go. Returns the bytes freed.
        """
        idx = self.index
        ids = self._evictable()
        ids = ids[np.isin(idx.ns_of(ids), namespaces) & ~np.isin(ids, keep)]
        if ids.size == 0 or nbytes <= 0:
            return 0
        ids = ids[np.argsort(idx.last_used[ids], kind="stable")]
        freed = np.cumsum(idx.length[ids].astype(np.int64))
        victims = ids[: int(np.searchsorted(freed, nbytes)) + 1]
        total = int(idx.length[victims].astype(np.int64).sum())
        self._evict(victims, "quota")
        return total

    # -- warm restart --------------------------------------------------------------

    def attach(self, ledger: Ledger, namespaces: set[int]) -> int:
        """Index the blocks ``ledger`` holds (of ``namespaces``) and keep the ledger current.

        On a fresh store only, with the namespaces' groups set (``set_group``). Returns how
        many blocks were restored. Raises ``SlabError`` if the rows do not describe a
        consistent pool (blocks outside it, off their chunks, overlapping, a key twice, two
        groups on a page): the caller then clears the ledger and starts empty.
        """
        if len(self.index) or self.slabs.free_pages != self.slabs.pages:
            raise SlabError("attach needs a fresh store")
        _, rows = ledger.committed()
        nstag = rows["rest"][:, 6]
        ns_of = (nstag >> 8).astype(np.int64)
        rows = rows[np.isin(ns_of, np.fromiter(namespaces, dtype=np.int64, count=len(namespaces)))]
        ns_of = (rows["rest"][:, 6] >> 8).astype(np.int64)
        lengths = rows["length"].astype(np.uint64)
        if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > self.max_block):
            raise SlabError("a block length is out of range")
        groups = None
        if self._group:
            distinct, inverse = np.unique(ns_of, return_inverse=True)
            groups = np.array([self._group.get(ns, 0) for ns in distinct.tolist()], dtype=np.int64)[inverse]
        self.slabs.restore(rows["offset"].astype(np.uint64) * self._unit, lengths, groups)
        words = np.empty((rows.size, 4), dtype=np.uint64)
        words[:, 0] = rows["w0"]
        words[:, 1:] = np.ascontiguousarray(rows["rest"][:, :6]).view(np.uint64)
        tags = (rows["rest"][:, 6] & 0xFF).astype(np.uint8)
        stamp = self._tick()
        for ns in np.unique(ns_of).tolist():
            sel = np.flatnonzero(ns_of == ns)
            keys = KeyBatch(words[sel], tags[sel])
            if not bool(first_occurrences(keys).all()):
                raise SlabError("a key is recorded twice")
            ids = self.index.insert_new(ns, keys, rows["offset"][sel], rows["length"][sel], READY, stamp)
            self.index.cached[ids] = rows["cached"][sel]
            if self.shared is not None:
                self.shared.publish(self.index, ids, int(self._unit))
            if self.sums is not None:
                self._set_sums(ids, rows["sum"][sel])
            self._ns_add(ids, 1)
        ledger.clear()  # the ids are new: record them afresh
        self.ledger = ledger
        self._record(self.index.live_ids())
        return int(rows.size)

    def _record(self, ids: np.ndarray) -> None:
        if self.ledger is None or not ids.size:
            return
        idx = self.index
        if ids.size == 1:  # one block a call: its fields as scalars
            i = int(ids[0])
            self.ledger.record_one(i, int(idx.w0[i]), idx.rest[i].tolist(), int(idx.offset[i]),
                                   int(idx.length[i]), int(idx.cached[i]),
                                   0 if self.sums is None else int(self.sums_of(ids)[0]))
            return
        self.ledger.record(ids, idx.w0[ids], idx.rest[ids], idx.offset[ids], idx.length[ids], idx.cached[ids],
                           0 if self.sums is None else self.sums_of(ids))

    def namespaces_in_use(self) -> set[int]:
        """Namespace ids with at least one entry (PENDING or READY); one scan of the index."""
        return set(np.unique(self.index.ns_of(self.index.live_ids())).tolist())

    def forget_namespace(self, ns: int) -> None:
        """Namespace ``ns`` (no entry in it) is freed: drop what the store keeps for it, so
        that the id starts afresh when it is given to another name."""
        self._admit_after.pop(ns, None)
        self._ns_bytes.pop(ns, None)
        self._group.pop(ns, None)

    def ns_bytes(self, ns: int) -> int:
        """Committed bytes of namespace ``ns``."""
        return self._ns_bytes.get(ns, 0)

    @property
    def evicted_total(self) -> int:
        """Blocks evicted for room since start (LRU and page steals; not discards)."""
        return self._evictions["lru"] + self._evictions["page"]

    def stats(self) -> StoreStats:
        hw = self.index.high_water
        classes = [ClassStats(c.chunk_size, len(c.pages), c.chunks_used, c.chunks_free,
                              self.page_size) for c in self.slabs.classes]
        return StoreStats(
            capacity=self.capacity,
            bytes_used=self.slabs.bytes_used(),
            bytes_free=self.slabs.bytes_free(),
            entries=len(self.index),
            pending=self._pending,
            pinned=int(np.count_nonzero(self.index.pins[:hw])),
            cached=int(np.count_nonzero((self.index.cached[:hw] != 0) & (self.index.state[:hw] == READY))),
            evictions=dict(self._evictions),
            ns_bytes=dict(self._ns_bytes),
            classes=classes,
            unpublished=0 if self.shared is None else self.shared.unpublished,
            granted=self.granted_bytes,
        )

    # -- allocation -----------------------------------------------------------------

    def _reserve_runs(self, ns: int, keys: KeyBatch, todo: np.ndarray, sizes: np.ndarray,
                      stamp: int, handles: np.ndarray, offsets: np.ndarray,
                      cut: int, at: np.ndarray | None = None, copy: bool = False) -> tuple[int, int]:
        """Places and PENDING entries for keys ``todo`` (ascending positions),
        run by run of one size class, in order; with ``at``, in the granted
        chunks it names (see ``reserve``).

        Each run's entries go in the index before the next run makes room, so
        that no eviction or page steal can take a chunk just handed out.
        Returns (how many of ``todo`` got one, new cut): the cut moves to the
        first key that got none.
        """
        if todo.size == 0:
            return 0, cut
        if at is not None:
            got = at[todo].astype(np.uint64)
            self._ungranted(got)
            self._place(ns, keys, todo, sizes, stamp, handles, offsets, got)
            return todo.size, cut
        for a, b, cls in self._runs(sizes[todo], self._group.get(ns, 0)):
            got = self._room(cls, b - a, copy) if cls >= 0 else _NO_U8
            if got.size:
                self._place(ns, keys, todo[a : a + got.size], sizes, stamp, handles, offsets, got)
            if got.size < b - a:
                return a + got.size, int(todo[a + got.size])
        return todo.size, cut

    def _place(self, ns: int, keys: KeyBatch, sel: np.ndarray, sizes: np.ndarray, stamp: int,
               handles: np.ndarray, offsets: np.ndarray, got: np.ndarray) -> None:
        """PENDING entries for the keys at positions ``sel`` in chunks ``got`` (byte offsets)."""
        handles[sel] = self.index.insert_new(
            ns, keys if sel.size == len(keys) else keys.take(sel), (got // self._unit).astype(np.uint32),
            sizes[sel].astype(np.uint32), PENDING, stamp)
        if self.sums is not None:
            self._set_sums(handles[sel], _NO_SUM)
        offsets[sel] = got
        self._pending += got.size

    def _runs(self, want: np.ndarray, group: int) -> list[tuple[int, int, int]]:
        """(start, end, class or -1) of each run of consecutive sizes of one class of ``group``."""
        lo, hi = int(want.min()), int(want.max())
        if lo == hi:  # one size for the whole batch: the usual case
            cls = self.slabs.class_for(lo, group)
            return [(0, want.size, -1 if cls is None else cls)]
        distinct, inverse = np.unique(want, return_inverse=True)
        per_size = [self.slabs.class_for(int(s), group) for s in distinct.tolist()]
        classes = np.array([-1 if c is None else c for c in per_size], dtype=np.int64)[inverse]
        bounds = [0, *(np.flatnonzero(np.diff(classes)) + 1).tolist(), want.size]
        return [(a, b, int(classes[a])) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _room(self, cls: int, k: int, copy: bool = False) -> np.ndarray:
        """Up to ``k`` chunks of class ``cls``, evicting or stealing pages as needed.

        The class's own least recently used blocks go first, unless another
        class has a page whose blocks are all older than the oldest of them:
        that page is taken back instead (``_older_page``), so that a class
        that came late (a new model, another block size) is not confined to
        the pages it got while blocks nobody uses fill the rest of the pool.
        ``copy``: for fetched copies, which take from owned blocks (by plain LRU, or a
        page steal) at most the bytes copies hold below ``copy_floor`` (``_copy_budget``)
        and evict only copies beyond that; no older-page look.
        """
        parts = [self.slabs.alloc_many(cls, k)]
        have = parts[0].size
        budget = self._copy_budget() if copy and have < k else 0
        chunk = self.slabs.classes[cls].chunk_size
        while have < k:
            if copy:
                victims = self._copy_victims(cls, k - have, budget // chunk)
                if victims.size:
                    budget -= chunk * int(np.count_nonzero(self.index.cached[victims] == 0))
                    self._evict(victims, "lru")
                else:
                    freed = self._steal_for_copies(cls, budget)
                    if freed is None:
                        break
                    budget -= freed
                more = self.slabs.alloc_many(cls, k - have)
                if more.size == 0:
                    break
                parts.append(more)
                have += more.size
                continue
            if self._older_page(cls):
                more = self.slabs.alloc_many(cls, k - have)
                parts.append(more)
                have += more.size
                continue
            victims = self._lru(cls, k - have)
            self._recheck[cls] = self._recheck.get(cls, 0) - int(victims.size)
            if victims.size and self.slabs.classes[cls].top == 0:
                # The class's free stack is empty, so the chunks freed now are exactly the ones
                # alloc_many would hand out next (last in, first out): pass them on directly.
                more = self._evict(victims, "lru", reuse=True)[::-1]
                parts.append(more)
                have += more.size
                continue
            if victims.size:
                self._evict(victims, "lru")
            elif not self._steal_page(cls):
                break
            more = self.slabs.alloc_many(cls, k - have)
            if more.size == 0:
                break
            parts.append(more)
            have += more.size
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _copy_budget(self) -> int:
        """Bytes of owned blocks fetched copies may still take: what copies (READY, or
        PENDING while they arrive) hold below ``copy_floor`` (one pass over the entries, made
        only when a copy finds no free chunk)."""
        idx = self.index
        hw = idx.high_water
        state = idx.state[:hw]
        held = ((state == READY) | (state == PENDING)) & (idx.cached[:hw] != 0)
        return max(0, self.copy_floor - int(idx.length[:hw][held].sum(dtype=np.int64)))

    def _copy_victims(self, cls: int, k: int, budget: int) -> np.ndarray:
        """Up to ``k`` victims for fetched copies of class ``cls``: the least recently used of
        its READY unpinned blocks, copies or not, up to ``budget`` of them (plain LRU: the read
        cache grows to its floor at the expense of the oldest blocks, where ``_lru`` would take
        copies first and keep it at one block), then its least recently used copies only."""
        idx = self.index
        ids = self._eligible_of(cls)
        first = lru_victims(idx.last_used, ids, min(k, budget)) if budget > 0 else _NO_U4
        if first.size >= k:
            return first
        rest = ids[idx.cached[ids] != 0]
        if first.size:
            rest = rest[~np.isin(rest, first)]
        more = lru_victims(idx.last_used, rest, k - first.size)
        return more if first.size == 0 else np.concatenate([first, more])

    def _lru(self, cls: int, k: int) -> np.ndarray:
        """Up to ``k`` least recently used READY unpinned entries of ``cls``."""
        idx = self.index
        q = self._queues.get(cls)
        if k == 1 and self.scalar_paths:  # one block saved into a full pool: scalar checks
            while q is not None and q.pos < q.ids.size:  # (a used-up queue: the scan below)
                i, stamp = int(q.ids[q.pos]), int(q.stamps[q.pos])
                q.pos += 1
                if (idx.state[i] == READY and idx.pins[i] == 0 and idx.last_used[i] == stamp
                        and self.slabs.page_owner[int(idx.offset[i]) // self._units_per_page] == cls):
                    return np.array((i,), dtype=np.uint32)
        out: list[np.ndarray] = []
        got = 0
        scanned = False
        while got < k:
            if q is None or q.pos >= q.ids.size:
                if scanned:
                    break
                # the old queue's ids taken above are still READY: the scan must skip them,
                # or they would be evicted (and their chunks freed) twice
                q = self._scan(cls, k - got, np.concatenate(out) if out else _NO_U4)
                scanned = True
            ids = q.ids[q.pos : q.pos + k - got]
            stamps = q.stamps[q.pos : q.pos + k - got]
            q.pos += ids.size
            if scanned:  # queued by this call's scan: nothing has changed since, all eligible
                out.append(ids)
                got += ids.size
                continue
            ok = (idx.state[ids] == READY) & (idx.pins[ids] == 0) & (idx.last_used[ids] == stamps)
            ok &= self._class_of(ids) == cls
            out.append(ids[ok])
            got += int(np.count_nonzero(ok))
        return np.concatenate(out) if out else _NO_U4

    def _scan(self, cls: int, need: int, taken: np.ndarray) -> _LruQueue:
        """A fresh queue of the oldest eligible entries of ``cls``, none of ``taken``."""
        idx = self.index
        ids = self._eligible_of(cls)
        if taken.size:
            ids = ids[~np.isin(ids, taken)]
        victims = copies_first(idx.last_used, idx.cached, ids, max(need, ids.size // self.lru_queue_fraction))
        q = _LruQueue(victims, idx.last_used[victims].copy())
        self._queues[cls] = q
        return q

    def _older_page(self, cls: int) -> bool:
        """Take back a page of another class whose blocks are all older than ``cls``'s oldest
        evictable block; False if there is none, or if it is not time to look.

        Looking costs a pass over every entry (2-6 ms at a million, in C), so
        after a look that found nothing the next one waits until ``cls`` has
        evicted a page's worth of its own blocks and 1/1024 of the entries (a
        few microseconds a block, amortised); a look that found a page is
        followed by another at the next need. With one class in use it costs
        a look at the page owners as often.
        """
        if self._recheck.get(cls, 0) > 0:
            return False
        owner = self.slabs.page_owner
        later = max(self.slabs.classes[cls].per_page, len(self.index) // RECHECK_FRACTION)
        if not bool(((owner >= 0) & (owner != cls)).any()):  # no other class holds a page
            self._recheck[cls] = later
            return False
        own = self._eligible_of(cls)
        if own.size == 0:  # nothing of its own to compare: the caller takes any page it can
            return False
        found = self._steal_page(cls, older_than=int(self.index.last_used[own].min()))
        self._recheck[cls] = 0 if found else later
        return found

    def _steal_for_copies(self, cls: int, budget: int) -> int | None:
        """Take back a page from another class for fetched copies of ``cls``: only one whose
        owned blocks hold at most ``budget`` bytes. Returns those bytes (evicted with the
        page), or None if no page can be taken."""
        recent, blocked = self._page_ages()
        idx = self.index
        live = idx.live_ids()
        owned = live[idx.cached[live] == 0]
        held = np.bincount(self._pages_of(owned).astype(np.int64), weights=idx.length[owned],
                           minlength=blocked.size)
        blocked[held > budget] = 1
        page = steal_choice(self.slabs.page_owner, recent, blocked, cls)
        if page is None:
            return None
        self._evict(self._ids_on_page(page), "page")
        self.slabs.release_page(page)
        return int(held[page])

    def _steal_page(self, cls: int, older_than: int | None = None) -> bool:
        """Take back a page from another class for ``cls`` (with ``older_than``: only a page
        whose blocks were all last used before that stamp); False if none can be."""
        recent, blocked = self._page_ages()
        page = steal_choice(self.slabs.page_owner, recent, blocked, cls, older_than)
        if page is None:
            return False
        self._evict(self._ids_on_page(page), "page")
        self.slabs.release_page(page)
        return True

    def _evict(self, ids: np.ndarray, reason: str, reuse: bool = False) -> np.ndarray:
        """Drop READY unpinned entries (distinct ids: a repeat would free a chunk twice).

        Their chunks go back to the allocator, or with ``reuse`` stay allocated for the
        caller to give to new entries: returns their byte offsets then (else an empty array).
        """
        if self.on_evict is not None:
            self.on_evict(ids, reason)
        if self.shared is not None:  # first: from here on the chunks may be handed out again
            self.shared.retract(self.index, ids)
        if self.ledger is not None:
            self.ledger.forget(ids)  # first: a crash from here on must not bring them back
        self._ns_add(ids, -1)
        if reuse:
            kept = self._byte_offsets(ids)
        else:
            self._free_chunks(ids)
            kept = _NO_U8
        self.index.remove(ids)
        self._evictions[reason] = self._evictions.get(reason, 0) + int(ids.size)
        return kept

    def _free_chunks(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        if ids.size == 1 and self.scalar_paths:  # one block evicted for one saved: scalar steps
            offset = int(self.index.offset[int(ids[0])]) * int(self._unit)
            self.slabs.free(int(self.slabs.page_owner[offset // self.page_size]), offset)
            return
        offs = self._byte_offsets(ids)
        classes = self.slabs.class_of_offsets(offs)
        lo, hi = int(classes.min()), int(classes.max())
        if lo == hi:
            self.slabs.free_many(lo, offs)
            return
        for cls in np.unique(classes).tolist():
            self.slabs.free_many(cls, offs[classes == cls])

    def _page_ages(self) -> tuple[np.ndarray, np.ndarray]:
        """Per page: the most recent use of its live entries (-1: none) and whether one
        of them is PENDING or pinned, or a chunk on it is granted (``eviction.page_ages``)."""
        idx, pages = self.index, self.slabs.page_owner.size
        if _probe is not None and idx.use_c:  # one pass in C: a few ms at a million entries
            recent = np.full(pages, -1, dtype=np.int64)
            blocked = np.zeros(pages, dtype=np.uint8)
            hw = idx.high_water
            _probe.page_ages(idx.state[:hw], idx.pins, idx.offset, idx.last_used, self._units_per_page,
                             recent, blocked)
        else:
            live = idx.live_ids()
            recent, blocked = page_ages(pages, self._pages_of(live), idx.last_used[live],
                                        (idx.state[live] == PENDING) | (idx.pins[live] > 0))
        if self._granted:  # a granted chunk is in use without an entry
            offs = np.fromiter(self._granted, dtype=np.uint64, count=len(self._granted))
            blocked[(offs // np.uint64(self.page_size)).astype(np.int64)] = 1
        return recent, blocked

    def _ids_on_page(self, page: int) -> np.ndarray:
        """Ids (uint32, ascending) of the live entries on ``page``."""
        idx = self.index
        if _probe is not None and idx.use_c:
            ids = np.empty(idx.high_water, dtype=np.uint32)
            return ids[: _probe.on_page(idx.state, idx.offset, self._units_per_page, page, ids)]
        live = idx.live_ids()
        return live[self._pages_of(live) == page]

    def _eligible_of(self, cls: int) -> np.ndarray:
        """Ids (uint32, ascending) of the READY, unpinned entries of class ``cls``."""
        idx = self.index
        if _probe is not None and idx.use_c:  # the same filter in one pass
            ids = np.empty(idx.high_water, dtype=np.uint32)
            return ids[: _probe.eligible(idx.state, idx.pins, idx.offset, self.slabs.page_owner,
                                         self._units_per_page, cls, ids)]
        ids = self._evictable()
        return ids[self._class_of(ids) == cls]

    def _evictable(self) -> np.ndarray:
        """Ids (uint32, ascending) of the READY, unpinned entries: those eviction may take."""
        idx = self.index
        hw = idx.high_water
        return np.flatnonzero((idx.state[:hw] == READY) & (idx.pins[:hw] == 0)).astype(np.uint32)

    def _byte_offsets(self, ids: np.ndarray) -> np.ndarray:
        """Where entries' chunks start in the region, in bytes (uint64)."""
        return self.index.offset.take(ids).astype(np.uint64) * self._unit

    def _pages_of(self, ids: np.ndarray) -> np.ndarray:
        """The page each entry's chunk is on."""
        return self.index.offset[ids] // self._units_per_page

    def _class_of(self, ids: np.ndarray) -> np.ndarray:
        return self.slabs.page_owner[self._pages_of(ids)]

    # -- bookkeeping ----------------------------------------------------------------

    def _tick(self, n: int = 1) -> int:
        """Advance the logical clock by ``n`` (>= 1); rebase all stamps before it wraps."""
        self._clock += n
        if self._clock >= self.clock_limit:
            shift = self._clock - self.clock_limit // 2
            stamps = self.index.last_used[: self.index.high_water]
            np.maximum(stamps, shift, out=stamps)
            stamps -= np.uint32(shift)
            self._clock -= shift
            self._queues.clear()
        return self._clock

    def _known(self, handles: np.ndarray) -> np.ndarray:
        """Handles that name an entry slot (uint32), in order, duplicates kept."""
        h = np.asarray(handles).astype(np.uint32, copy=False)
        return h[(h >= FIRST_ID) & (h < self.index.high_water)]

    def _in_state(self, handles: np.ndarray, state: int) -> np.ndarray:
        """Distinct handles whose entry is in ``state``."""
        h = self._known(handles)
        h = np.sort(h[self.index.state[h] == state])
        if h.size > 1 and bool((h[1:] == h[:-1]).any()):
            h = np.unique(h)
        return h

    def _ns_add(self, ids: np.ndarray, sign: int) -> None:
        """Add (sign 1) or remove (sign -1) entries' lengths to their namespaces."""
        if ids.size == 0:
            return
        if ids.size == 1:  # one block a call: no dict of totals
            i = int(ids[0])
            self._ns_change(int(self.index.rest[i, 6]) >> 8, sign * int(self.index.length[i]))
            return
        for ns, total in self._ns_totals(ids).items():
            self._ns_change(ns, sign * total)

    def _ns_change(self, ns: int, delta: int) -> None:
        """Namespace ``ns`` holds ``delta`` committed bytes more (or, negative, fewer)."""
        left = self._ns_bytes.get(ns, 0) + delta
        if left:
            self._ns_bytes[ns] = left
        else:
            self._ns_bytes.pop(ns, None)

    def _ns_totals(self, ids: np.ndarray) -> dict[int, int]:
        """Namespace id -> total length of the entries ``ids`` (at least one) in it."""
        idx = self.index
        nstag = idx.rest[ids, 6]  # ns << 8 | tag: one namespace when min and max agree
        if int(nstag.min()) >> 8 == int(nstag.max()) >> 8:
            return {int(nstag[0]) >> 8: int(idx.length[ids].sum(dtype=np.int64))}
        ns = idx.ns_of(ids)
        u, inv = np.unique(ns, return_inverse=True)
        sums = np.zeros(u.size, dtype=np.int64)
        np.add.at(sums, inv, idx.length[ids].astype(np.int64))
        return dict(zip(u.tolist(), sums.tolist(), strict=True))


def _leading(ok: np.ndarray) -> int:
    """Number of leading True values."""
    return int(ok.size) if np.count_nonzero(ok) == ok.size else int(ok.argmin())
