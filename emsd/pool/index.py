"""Compact index from (namespace, key) to a block entry, in numpy arrays.

Entries are rows of a structure of arrays, addressed by a uint32 entry id
(the handle clients hold). Per entry, 55 bytes:

==========  ============  =================================================
field       dtype         meaning
==========  ============  =================================================
w0          u64           the key's first canonical word (``emsd.pool.keys``)
rest        7 x u32       the other three words (as six u32 halves) and
                          ``nstag`` = ``ns << 8 | tag`` (namespace < 2**24,
                          key tag): one 28-byte row, so that a lookup checks
                          a candidate with one comparison
state       u8            FREE, PENDING, READY or HELD (out of the table,
                          fields kept: ``detach``)
pins        u32           readers holding the entry
offset      u32           chunk offset in the allocator's ``align`` units
length      u32           block length in bytes
last_used   u32           logical clock of the last use (the store rebases
                          it before it wraps)
cached      u8            1 for a read-cache copy of a block another node
                          owns: eviction takes these first
==========  ============  =================================================

The size class is not stored: it is the owner of the entry's page
(``SlabAllocator.page_owner``). Ids 0 and 1 are sentinels that are never
live and whose ``nstag`` matches no key, so a lookup can gather fields at any
table value without a bounds check, and a miss (id 0) reads as FREE.

The hash table is open addressing with linear probing over a uint32 array of
entry ids: ``EMPTY`` (0) for a never-used slot, ``TOMB`` (1) for a slot whose
entry was removed. A key's home slot is the top bits of its hash in a
power-of-two range; probing runs forward without wrapping into a tail of
extra slots whose last ``WINDOW`` always stay EMPTY (an insert that would
reach them rebuilds the table with a tail twice as long instead), so that
every probe window is a plain slice. Tombstones rather than backward-shift
deletion: removal is one vectorised store, and the table is rebuilt when
live entries plus tombstones pass half of it, which keeps the load <= 0.5.
At 1M entries that is 2**21 slots, 8.4 bytes an entry: about 62 bytes an
entry in all, against 150-220 for a Python dict of tuples.

The hash mixes the four key words with odd 64-bit multipliers (one uint64
matrix product, wrapping), xors in ``nstag`` and multiplies once more; the
home slot is its top bits (Fibonacci hashing), which depend on every input
bit. Pure numpy uint64 arithmetic, the same in every process.

Lookups are vectorised over a batch. Round one gathers each key's home
window of ``WINDOW`` slots, takes the first slot whose entry has the key's
first word and checks that candidate's 28-byte row: for a batch of hits this
is the whole lookup, about 17 numpy calls whatever the batch size. Keys it
leaves open (a miss whose window has no EMPTY slot, an entry displaced past
its window, a first-word twin) are resolved one by one, or by vectorised
window rounds when there are many. ``find(prefix=True)``, for loads, stops
at the first miss. Inserts place a batch the same way: each key takes the
first free slot of its window; keys that pick the same slot are told apart by
which write stuck, and the losers look again.

Removed entry ids are kept in a list of numpy arrays (4 bytes a free id) and
reused first. The entry arrays grow by doubling and the table is rebuilt
(vectorised, in chunks so that temporaries stay small) when it passes half
full. Large arrays are anonymous mappings of their own, so memory given up
by growth goes back to the system at once. Nothing here is a Python object
per entry, so a later version can place these arrays in the shared region
and re-attach to them after a restart.
"""

from __future__ import annotations

import mmap

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from emsd.pool.keys import KeyBatch

try:  # the lookup loop in C; the numpy probe below gives the same answers
    from emsd.pool import _probe  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - extension not built
    _probe = None  # type: ignore[assignment]

FREE, PENDING, READY, HELD = 0, 1, 2, 3
EMPTY, TOMB = 0, 1  # table slot values; also the two sentinel entry ids
FIRST_ID = 2
MAX_NS = (1 << 24) - 2  # ns is packed with the tag in 32 bits; 0xFFFFFF is the sentinels'
WINDOW = 8  # slots probed per key per round; 8 bools view as one uint64
_WINDOW_BITS = 3
_WINDOW_U8 = np.uint64(WINDOW)
_ONE_BY_ONE = 16  # keys left after round one resolved one at a time, up to this many
TAIL = 4 * WINDOW  # slots past the home range at first; the last WINDOW stay EMPTY
REST_COLS = 7  # w1, w2, w3 as uint32 halves, then nstag
_SENTINEL_NSTAG = 0xFFFFFFFF
_MIN_ENTRIES = 1024
_REBUILD_CHUNK = 1 << 15
_MIN_HOME = 64
_MUL = np.array(
    [0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93],
    dtype=np.uint64,
)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)
_ANY_REST = np.ones(REST_COLS, dtype=bool)  # (m, 7) bool @ this: any per row, one call
_ANY_WINDOW = np.ones(WINDOW, dtype=bool)


class _Crowded(Exception):
    """A probe sequence reached the table's reserved EMPTY tail."""


def nstag_of(ns: int, tags: np.ndarray) -> np.ndarray:
    """Packed ``ns << 8 | tag`` for keys of namespace ``ns`` (uint32)."""
    if not 0 <= ns <= MAX_NS:
        raise ValueError(f"namespace id {ns} is outside 0..{MAX_NS}")
    return tags | np.uint32(ns << 8)


def hash_keys(words: np.ndarray, nstag: np.ndarray) -> np.ndarray:
    """64-bit hashes of keys: ``words`` (n, 4) uint64, ``nstag`` (n,) uint32."""
    h = words @ _MUL
    h ^= nstag
    h *= _FINAL
    return h


_C_HASH = hash_keys  # _probe computes exactly this hash; tests that swap it use the numpy probe


class BlockIndex:
    """(namespace, key) -> entry id, with the entry's fields as arrays.

    Field arrays are replaced when the index grows: do not keep a reference
    to one across an ``insert``.
    """

    def __init__(self, capacity: int = _MIN_ENTRIES) -> None:
        cap = max(capacity, _MIN_ENTRIES)
        self.w0 = _zeros(cap, np.uint64)
        self.rest = _zeros((cap, REST_COLS), np.uint32)
        self.state = _zeros(cap, np.uint8)
        self.pins = _zeros(cap, np.uint32)
        self.offset = _zeros(cap, np.uint32)
        self.length = _zeros(cap, np.uint32)
        self.last_used = _zeros(cap, np.uint32)
        self.cached = _zeros(cap, np.uint8)  # 1: a read-cache copy of a block owned elsewhere
        self.rest[:FIRST_ID, 6] = _SENTINEL_NSTAG
        self.high_water = FIRST_ID  # ids >= high_water have never been used
        self._free: list[np.ndarray] = []  # removed ids, in the batches they were removed
        self._count = 0
        self._held = 0  # HELD entries: neither live nor free
        self._tombs = 0
        self._keyrec = np.zeros((0, REST_COLS), dtype=np.uint32)  # scratch: a batch's rows
        self._tail = TAIL
        self._new_table(_MIN_HOME)
        self.use_c = True  # tests turn it off to compare with the numpy probe

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return int(self.state.size)

    @property
    def home_size(self) -> int:
        """Slots in the home range (a power of two); the table has a tail more."""
        return int(self.table.size - self._tail)

    @property
    def nstag(self) -> np.ndarray:
        """``ns << 8 | tag`` per entry (a strided view into ``rest``)."""
        return self.rest[:, 6]

    def nbytes(self) -> int:
        """Bytes held by the arrays (allocated, touched or not)."""
        arrays = (self.w0, self.rest, self.state, self.pins, self.offset, self.length,
                  self.last_used, self.cached, self.table)
        return sum(a.nbytes for a in arrays)

    # -- lookup -----------------------------------------------------------------

    def lookup(self, ns: int, keys: KeyBatch) -> np.ndarray:
        """Entry id of each key (int64), -1 where absent; entries of any state."""
        ids = self.find(ns, keys)
        return np.where(ids >= FIRST_ID, ids.astype(np.int64), -1)

    def find(self, ns: int, keys: KeyBatch, prefix: bool = False) -> np.ndarray:
        """Entry id of each key (uint32), ``EMPTY`` (0) where absent.

        The fast path: a field gathered at a miss reads sentinel 0, which is
        FREE and unpinned. With ``prefix``, only the keys up to the first
        absent one are resolved (later ones may read as absent): what a load
        needs, and it spares the rounds for far-probing later keys.
        """
        words = np.ascontiguousarray(keys.words)
        if _probe is not None and self.use_c and hash_keys is _C_HASH:
            if not 0 <= ns <= MAX_NS:
                raise ValueError(f"namespace id {ns} is outside 0..{MAX_NS}")
            out = np.empty(len(keys), dtype=np.uint32)
            _probe.find(self.table, self.w0, self.rest, words, np.ascontiguousarray(keys.tags),
                        ns, int(self._shift), out, prefix)
            return out
        knt = nstag_of(ns, keys.tags)
        return self._probe(words, knt, hash_keys(words, knt), prefix)

    def _probe(self, kw: np.ndarray, knt: np.ndarray, h: np.ndarray, prefix: bool) -> np.ndarray:
        """Round one, vectorised and tuned for hits: per key, the first slot of
        its home window whose entry has the key's first word is checked in
        full. The few keys it leaves open are resolved one by one (or by
        vectorised rounds if there are many)."""
        n = knt.size
        if self._keyrec.shape[0] < n:
            self._keyrec = np.zeros((max(n, 2 * self._keyrec.shape[0]), REST_COLS), np.uint32)
        krec = self._keyrec[:n]
        krec[:, :6] = kw.view(np.uint32)[:, 2:]
        krec[:, 6] = knt
        start = h >> self._shift
        ids = self._windows[start]
        first_word = self.w0.take(ids) == kw[:, 0, None]
        rows, col = _arange(n), first_word.argmax(axis=1)
        cand = ids[rows, col] * first_word[rows, col]  # no first word: sentinel 0, never equal
        bad = (self.rest.take(cand, axis=0) != krec) @ _ANY_REST
        if not np.count_nonzero(bad):
            return cand
        found = cand
        found[bad] = EMPTY
        if prefix:
            rows = bad.nonzero()[0]
        else:  # leave out the keys surely absent: no first word, an EMPTY slot
            word = first_word.view(np.uint64).reshape(-1) != 0
            rows = (bad & (word | ~((ids == EMPTY) @ _ANY_WINDOW))).nonzero()[0]
            if rows.size > _ONE_BY_ONE:
                self._probe_rows(found, rows, kw, krec, start[rows])
                return found
        for j in rows.tolist():
            found[j] = self._probe_one(int(kw[j, 0]), krec[j], int(start[j]))
            if prefix and not found[j]:
                break  # keys after a miss do not matter
        return found

    def _probe_one(self, w0: int, rest: np.ndarray, slot: int) -> int:
        """Entry id of one key from its home slot, or ``EMPTY``."""
        table, words = self.table, self.w0
        while True:
            entry = int(table[slot])
            if entry == EMPTY:
                return EMPTY
            if int(words[entry]) == w0 and bool((self.rest[entry] == rest).all()):
                return entry
            slot += 1

    def _probe_rows(self, found: np.ndarray, todo: np.ndarray, kw: np.ndarray,
                    krec: np.ndarray, start: np.ndarray) -> None:
        """Resolve keys ``todo`` from window ``start``, window by window: every
        slot with the key's first word is checked in full."""
        while True:
            ids = self._windows[start]
            pos = (self.w0.take(ids) == kw[todo, 0, None]).reshape(-1).nonzero()[0]
            cand = ids.reshape(-1).take(pos)
            rel = pos >> _WINDOW_BITS
            row = todo.take(rel)
            ok = ~((self.rest.take(cand, axis=0) != krec.take(row, axis=0)) @ _ANY_REST)
            found[row[ok]] = cand[ok]
            resolved = (ids == EMPTY) @ _ANY_WINDOW
            resolved[rel[ok]] = True
            more = (~resolved).nonzero()[0]
            if more.size == 0:
                return
            todo = todo[more]
            start = start[more] + _WINDOW_U8

    # -- insert -----------------------------------------------------------------

    def insert(self, ns: int, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray,
               state: int, stamp: int) -> tuple[np.ndarray, np.ndarray]:
        """Insert keys that are not present yet; duplicates in the batch map
        to one entry, the first occurrence's fields win.

        Returns (entry id of each key (uint32), mask of the keys that created
        an entry). Keys already present keep their entry and its fields.
        """
        ids = self.find(ns, keys)
        created = (ids == EMPTY) & first_occurrences(keys)
        sel = np.flatnonzero(created)
        if sel.size:
            ids[sel] = self.insert_new(ns, keys.take(sel), offsets[sel], lengths[sel],
                                       state, stamp)
        dup = ids == EMPTY
        if dup.any():
            ids[dup] = self.find(ns, keys.take(np.flatnonzero(dup)))
        return ids, created

    def insert_new(self, ns: int, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray,
                   state: int, stamp: int) -> np.ndarray:
        """Insert keys known to be absent and distinct (the caller checked);
        returns their new entry ids (uint32)."""
        k = len(keys)
        if k == 1:  # one key (a one-block save): the same writes, scalar
            return np.array((self.insert_one(ns, keys, offsets[0], lengths[0], state, stamp),),
                            dtype=np.uint32)
        knt = nstag_of(ns, keys.tags)
        self._make_room(k)
        words = np.ascontiguousarray(keys.words)
        ids = self._take_ids(k)
        self.w0[ids] = words[:, 0]
        self.rest[ids, :6] = words.view(np.uint32)[:, 2:]
        self.rest[ids, 6] = knt
        self.state[ids] = state  # pins are 0 already: never set, or cleared by remove
        self.offset[ids] = offsets
        self.length[ids] = lengths
        self.last_used[ids] = stamp
        self.cached[ids] = 0
        self._count += k
        self._seat(ids, words, knt)
        return ids

    def insert_one(self, ns: int, keys: KeyBatch, offset: int | np.integer, length: int | np.integer,
                   state: int, stamp: int) -> int:
        """``insert_new`` of one key (absent: the caller checked); its new entry id."""
        if not 0 <= ns <= MAX_NS:
            raise ValueError(f"namespace id {ns} is outside 0..{MAX_NS}")
        knt = ns << 8 | int(keys.tags[0])
        self._make_room(1)
        words = np.ascontiguousarray(keys.words)
        i = self._take_one()
        self.w0[i] = words[0, 0]
        self.rest[i, :6] = words[0].view(np.uint32)[2:]
        self.rest[i, 6] = knt
        self.state[i] = state
        self.offset[i] = offset
        self.length[i] = length
        self.last_used[i] = stamp
        self.cached[i] = 0
        self._count += 1
        self._seat(np.array((i,), dtype=np.uint32), words, np.array((knt,), dtype=np.uint32))
        return i

    def _seat(self, ids: np.ndarray, words: np.ndarray, knt: np.ndarray) -> None:
        """Put the new entries ``ids`` (keys ``words``, ``knt``) in the hash table."""
        try:
            if self._c_probe():
                self._place_c(ids)
            else:
                self._place(ids, hash_keys(words, knt))
        except _Crowded:
            self._rebuild(self.home_size)

    def _c_probe(self) -> bool:
        """Whether the C loops (``_probe``) may stand in for the numpy ones: built, not
        turned off, and the hash is the one they compute."""
        return _probe is not None and self.use_c and hash_keys is _C_HASH

    def _place_c(self, ids: np.ndarray) -> None:
        """``_place`` in C, key by key (the hashes from the stored keys); raises ``_Crowded``."""
        tombs = _probe.place(self.table, self.w0, self.rest, np.ascontiguousarray(ids, dtype=np.uint32),
                             int(self._shift), self.table.size - WINDOW)
        if tombs < 0:
            raise _Crowded
        self._tombs -= tombs

    def _make_room(self, k: int) -> None:
        """Grow the entry arrays and rebuild the table so that ``k`` more fit."""
        if self.high_water + k > self.capacity and self._free_count() < k:
            self._grow_entries(self.high_water + k)
        need = self._count + k
        if 2 * (need + self._tombs) > self.home_size:
            size = max(_MIN_HOME, 1 << (2 * need - 1).bit_length())
            if size // 2 - need < size // 16:  # leave room for more than a few inserts
                size *= 2
            self._rebuild(size)

    def _free_count(self) -> int:
        return self.high_water - FIRST_ID - self._count - self._held

    def _grow_entries(self, at_least: int) -> None:
        cap = max(2 * self.capacity, at_least)
        for name in ("w0", "rest", "state", "pins", "offset", "length", "last_used", "cached"):
            old = getattr(self, name)
            new = _zeros((cap, *old.shape[1:]), old.dtype)
            new[: self.high_water] = old[: self.high_water]
            setattr(self, name, new)

    def _take_one(self) -> int:
        """``_take_ids(1)``'s id, as an int."""
        if self._free:
            last = self._free[-1]
            i = int(last[-1])
            if last.size == 1:
                self._free.pop()
            else:
                self._free[-1] = last[:-1]
            return i
        self.high_water += 1
        return self.high_water - 1

    def _take_ids(self, k: int) -> np.ndarray:
        """``k`` entry ids: removed ones first (most recent first), then new."""
        parts: list[np.ndarray] = []
        need = k
        while need and self._free:
            last = self._free[-1]
            if last.size <= need:
                parts.append(self._free.pop())
                need -= last.size
            else:
                parts.append(last[-need:])
                self._free[-1] = last[:-need]
                need = 0
        if need:
            parts.append(np.arange(self.high_water, self.high_water + need, dtype=np.uint32))
            self.high_water += need
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _new_table(self, home: int) -> None:
        self.table = _zeros(home + self._tail, np.uint32)
        self._windows = sliding_window_view(self.table, WINDOW)  # read-only, shares memory
        self._shift = np.uint64(64 - (home.bit_length() - 1))  # home slot: top bits of the hash
        self._tombs = 0

    def _place(self, ids: np.ndarray, h: np.ndarray) -> None:
        """Put entry ids in the first EMPTY or TOMB slot from their home slot.

        Vectorised by windows: each key takes the first free slot of its
        window; when keys of the batch pick the same slot, one wins (the
        write that stuck) and the others look again from there. Usually one
        round places every key. Raises ``_Crowded`` if a slot would be in the
        table's EMPTY tail.
        """
        limit = self.table.size - WINDOW
        start = (h >> self._shift).astype(np.int64)
        todo: np.ndarray | None = None  # None: every key (the first round)
        while True:
            s = start if todo is None else start.take(todo)
            key_ids = ids if todo is None else ids.take(todo)
            window = self._windows[s]
            col = (window <= TOMB).argmax(axis=1)
            prev = window[_arange(s.size), col]
            slot = s + col
            has = prev <= TOMB  # a free slot in this window
            if np.count_nonzero(has) < s.size:
                slot, key_ids, prev = slot[has], key_ids[has], prev[has]
            if todo is not None and slot.size and slot.max() >= limit:
                raise _Crowded  # (a first window starts at a home slot, far from the tail)
            self.table[slot] = key_ids
            won = self.table.take(slot) == key_ids  # one writer per slot wins
            self._tombs -= int(np.count_nonzero(prev[won]))  # a free slot is EMPTY (0) or TOMB (1)
            if np.count_nonzero(won) == s.size:
                return
            rows = np.arange(s.size) if todo is None else todo
            hit_rows = has.nonzero()[0]
            again = s + WINDOW  # no free slot in the window: look past it
            again[hit_rows] = slot  # lost a race: look again from the slot now taken
            start[rows] = again
            placed = np.zeros(s.size, dtype=bool)
            placed[hit_rows[won]] = True
            todo = rows[~placed]

    def _rebuild(self, home: int) -> None:
        """A fresh table with ``home`` home slots holding every live entry.

        If a probe sequence runs into the EMPTY tail, the tail doubles: keys
        that crowd the end of the range (or a pathological hash) make a long
        tail, never a failure.
        """
        while True:
            self._new_table(home)
            try:
                for lo in range(FIRST_ID, self.high_water, _REBUILD_CHUNK):
                    # in chunks, so that the temporaries stay small (and off the RSS)
                    hi = min(lo + _REBUILD_CHUNK, self.high_water)
                    state = self.state[lo:hi]
                    live = (np.flatnonzero((state != FREE) & (state != HELD)) + lo).astype(np.uint32)
                    if live.size and self._c_probe():
                        self._place_c(live)
                    elif live.size:
                        self._place(live, hash_keys(self.words_of(live), self.nstag[live]))
                return
            except _Crowded:
                self._tail *= 2

    # -- remove -----------------------------------------------------------------

    def remove(self, ids: np.ndarray) -> None:
        """Remove live (PENDING or READY) entries (distinct ids); they become FREE and reusable."""
        ids = np.asarray(ids, dtype=np.uint32)
        k = ids.size
        if k == 0:
            return
        if k == 1:  # one block a call: scalar checks and writes
            i = int(ids[0])
            if not PENDING <= self.state[i] <= READY:
                raise ValueError("remove of an entry that is not live")
            self.table[int(self._slots_of(ids)[0])] = TOMB
            self._tombs += 1
            self._count -= 1
            self.state[i] = FREE
            self.pins[i] = 0
            self._free.append(ids.copy())
            return
        state = self.state[ids]
        if not bool(((state >= PENDING) & (state <= READY)).all()):
            raise ValueError("remove of an entry that is not live")
        self.table[self._slots_of(ids)] = TOMB
        self._tombs += k
        self._count -= k
        self.state[ids] = FREE
        self.pins[ids] = 0
        self._free.append(ids.copy())

    def detach(self, i: int) -> None:
        """Take live entry ``i`` out of the table (no lookup finds its key, which may be
        inserted again) but keep its id and fields, HELD, until ``release``: for an entry
        still in use when its key goes (the disk tier's block being read when dropped)."""
        if self.state[i] in (FREE, HELD):
            raise ValueError("detach of an entry that is not live")
        self.table[int(self._slots_of(np.array((i,), dtype=np.uint32))[0])] = TOMB
        self._tombs += 1
        self._count -= 1
        self._held += 1
        self.state[i] = HELD

    def release(self, i: int) -> None:
        """Free the id of HELD entry ``i`` (``detach``) for reuse."""
        if self.state[i] != HELD:
            raise ValueError("release of an entry that is not held")
        self._held -= 1
        self.state[i] = FREE
        self.pins[i] = 0
        self._free.append(np.array((i,), dtype=np.uint32))

    def _slots_of(self, ids: np.ndarray) -> np.ndarray:
        """Table slot holding each live entry id."""
        if self._c_probe():
            out = np.empty(ids.size, dtype=np.int64)
            _probe.slots_of(self.table, self.w0, self.rest, np.ascontiguousarray(ids, dtype=np.uint32),
                            int(self._shift), out)
            if ids.size and int(out.min()) < 0:
                raise ValueError("an entry is missing from the table")
            return out
        h = hash_keys(self.words_of(ids), self.rest[ids, 6])
        start = (h >> self._shift).astype(np.int64)
        hit = self._windows[start] == ids[:, None]
        col = hit.argmax(axis=1)
        out = start + col
        far = (~hit[_arange(ids.size), col]).nonzero()[0]
        for i in far.tolist():  # past the home window: rare
            out[i] = self._slot_of_one(int(ids[i]), int(start[i]) + WINDOW)
        return out

    def _slot_of_one(self, entry: int, slot: int) -> int:
        while int(self.table[slot]) != entry:
            slot += 1
        return slot

    # -- reading ----------------------------------------------------------------

    def live_ids(self) -> np.ndarray:
        """Ids of the PENDING and READY entries (uint32, ascending)."""
        state = self.state[: self.high_water]
        return np.flatnonzero((state != FREE) & (state != HELD)).astype(np.uint32)

    def ns_of(self, ids: np.ndarray) -> np.ndarray:
        """Namespace id of entries (int64)."""
        return (self.nstag[ids] >> 8).astype(np.int64)

    def keys_of(self, ids: np.ndarray) -> KeyBatch:
        """The keys of entries, as a batch."""
        return KeyBatch(self.words_of(ids), (self.nstag[ids] & 0xFF).astype(np.uint8))

    def words_of(self, ids: np.ndarray) -> np.ndarray:
        """The four canonical key words of entries, (n, 4) uint64, C order."""
        words = np.empty((ids.size, 4), dtype=np.uint64)
        words[:, 0] = self.w0[ids]
        words.view(np.uint32)[:, 2:] = self.rest[ids, :6]
        return words


_ARANGE = np.arange(4096)
_SET_CHECK = 256  # first_occurrences: up to this many keys, a Python set finds repeated first words
_MMAP_MIN = 1 << 20


def _zeros(shape: int | tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A zeroed array; a large one is backed by its own anonymous mapping.

    Its pages are allocated on first touch and given back to the system when
    the array is freed, so growing by copy leaves no holes in the heap (the
    RSS stays close to what the live arrays use).
    """
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    if nbytes < _MMAP_MIN:
        return np.zeros(shape, dtype=dt)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dt).reshape(shape)


def _arange(n: int) -> np.ndarray:
    """``arange(n)`` (read-only use), a view of a cached one for small ``n``."""
    return _ARANGE[:n] if n <= _ARANGE.size else np.arange(n)


def first_occurrences(keys: KeyBatch) -> np.ndarray:
    """Mask of the keys that do not repeat an earlier key of the batch."""
    n = len(keys)
    mask = np.ones(n, dtype=bool)
    if n < 2:
        return mask
    if n <= _SET_CHECK and len(set(keys.words[:, 0].tolist())) == n:
        return mask  # distinct first words, told by a set: fewer steps than a sort for a few keys
    w0 = np.sort(keys.words[:, 0])
    if not (w0[1:] == w0[:-1]).any():
        return mask  # distinct first words: no repeats (the usual case, cheap)
    rows = np.empty((n, 5), dtype=np.uint64)
    rows[:, :4] = keys.words
    rows[:, 4] = keys.tags
    _, first = np.unique(rows.view(np.dtype((np.void, 40))).ravel(), return_index=True)
    mask[:] = False
    mask[first] = True
    return mask
