"""Eviction policy: pure functions from the pool's state to what to reclaim.

The store feeds these with arrays from the index and the allocator and
carries out the answer (mechanism apart from policy, as memcached's
``slab_automove``). Nothing here mutates its inputs.

- ``lru_victims``: the least recently used of the eligible entries (READY,
  unpinned, of the class that is short), oldest first.
- ``steal_choice`` (over what ``page_ages`` gives): the
  page of another class to take back when a class needs room and cannot, or
  should not, evict its own: one whose live entries are all READY and
  unpinned, and whose most recent use is the oldest. A page with no live
  entry at all is the best choice (its most recent use counts as -1).
- ``chain_stamps``: the recency stamps of one call's keys under the
  ``prefix`` policy (below).
- ``Recency`` (``LruRecency``, ``PrefixRecency``; ``recency(name)`` makes
  one): the configured policy as an object, which the store calls at each
  point where a call stamps the entries it touches.

Two policies (``pool.eviction``) differ only in how a call stamps its keys:

- ``lru``: every key of a call gets the same stamp, the clock's next tick.
  Ties among the oldest go by entry id, so a cold chain loses whichever of
  its blocks were allocated first: usually its head, which makes the rest of
  the chain useless while it still takes space.
- ``prefix``: a call of keys k0..k(n-1) (a chain: a load only counts leading
  hits) advances the clock by n and stamps k0 newest and k(n-1) oldest, all
  newer than any earlier stamp. Every use of a block in a chain uses its
  predecessors in the same call, so a block's stamp is never older than any
  successor's: LRU victims then come from the tails of the coldest chains
  first, and a head whose successors are hot is never the oldest (SGLang's
  radix cache evicts leaves first for the same reason). A block shared by
  many chains (a system prompt) is as recent as its most recent chain.
  A call that leaves out a prefix (token semantics with a mask: the engine
  has those blocks already) names the block before its first key, the
  predecessor; its keys are then stamped just below the predecessor's stamp,
  so a tail saved after its head was loaded is still older than the head.
  A call without one (hash semantics, or a predecessor that is not stored)
  is stamped as a chain of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from emsd.pool.index import FIRST_ID, READY, BlockIndex

POLICIES = ("lru", "prefix")
_READY = np.uint8(READY)


def chain_stamps(clock: int, n: int, below: int | None = None) -> np.ndarray:
    """Stamps (uint32) of a call's ``n`` keys after the clock advanced from
    ``clock - n`` to ``clock``: position i gets ``top - i`` with ``top = clock``,
    so the first key is the newest, every stamp is distinct and newer than
    ``clock - n``.

    ``below``: the stamp of the block that precedes the call's first key (a
    save or load that leaves out a prefix the engine already has); then
    ``top = min(clock, below - 1)``, so the call's blocks are never newer than
    their predecessor, and stamps stop at 0 (ties as oldest).

    Raises ``ValueError`` if ``n < 0`` or ``clock < n``.
    """
    if n < 0 or clock < n:
        raise ValueError(f"chain_stamps needs 0 <= n <= clock (got n={n}, clock={clock})")
    top = clock if below is None else min(clock, below - 1)
    return np.maximum(top - np.arange(n, dtype=np.int64), 0).astype(np.uint32)


def chain_stamp(clock: int, below: int | None = None) -> int:
    """``chain_stamps(clock, 1, below)[0]`` as an int, in scalar steps (a call of one key);
    ``clock`` and ``below`` are below 2**32, as the store's clock is."""
    return max(clock if below is None else min(clock, below - 1), 0)


def lru_victims(last_used: np.ndarray, eligible_ids: np.ndarray, n: int) -> np.ndarray:
    """The (at most) ``n`` ids of ``eligible_ids`` with the smallest
    ``last_used[id]``, oldest first, ties by position in ``eligible_ids``."""
    if n <= 0 or eligible_ids.size == 0:
        return eligible_ids[:0]
    stamps = last_used[eligible_ids]
    if n < eligible_ids.size:
        part = np.argpartition(stamps, n - 1)[:n]
        part.sort()  # keep ties in input order, so the answer is deterministic
    else:
        part = np.arange(eligible_ids.size)
    order = part[np.argsort(stamps[part], kind="stable")]
    return eligible_ids[order]


def copies_first(last_used: np.ndarray, cached: np.ndarray, eligible_ids: np.ndarray,
                 n: int) -> np.ndarray:
    """Up to ``n`` victims: read-cache copies (``cached[id]`` set) first, oldest
    first, then owned blocks, oldest first. A copy can be fetched again from
    its owner; an owned block lost is a recompute for the whole cluster."""
    copy = cached[eligible_ids] != 0
    first = lru_victims(last_used, eligible_ids[copy], n)
    if first.size >= n:
        return first
    return np.concatenate([first, lru_victims(last_used, eligible_ids[~copy], n - first.size)])


def page_ages(pages: int, entry_pages: np.ndarray, entry_last_used: np.ndarray,
              entry_blocked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per page: the most recent use of its live entries (int64, -1 for none) and whether
    one of them must stay (bool). ``entry_pages``, ``entry_last_used``, ``entry_blocked``:
    per live entry, its page, its last use, and whether it is PENDING or pinned."""
    blocked = np.zeros(pages, dtype=bool)
    blocked[entry_pages[entry_blocked]] = True
    recent = np.full(pages, -1, dtype=np.int64)
    np.maximum.at(recent, entry_pages, entry_last_used.astype(np.int64))
    return recent, blocked


def steal_choice(page_owner: np.ndarray, recent: np.ndarray, blocked: np.ndarray,
                 requester: int, older_than: int | None = None) -> int | None:
    """Page to take back for class ``requester``, or None if none can be.

    ``page_owner``: class id per page (-1 free); ``recent``, ``blocked``: per
    page, as ``page_ages`` gives them. Candidates are pages owned by another
    class with no blocked entry; the answer is the one whose most recent use
    is the oldest (lowest page index on a tie). With ``older_than``, only a
    page whose most recent use is before it (every block on it older than
    that stamp) is an answer.
    """
    candidate = (page_owner >= 0) & (page_owner != requester) & ~blocked.astype(bool)
    if not candidate.any():
        return None
    choices = np.flatnonzero(candidate)
    page = int(choices[np.argmin(recent[choices])])
    if older_than is not None and recent[page] >= older_than:
        return None
    return page


Tick = Callable[[int], int]  # the store's clock: advance by n (>= 1), return the new time
Below = Callable[[], "int | None"]  # the stamp of the call's predecessor, looked up on demand


class Recency(ABC):
    """How a policy stamps the entries a call touches; the store calls it at each such
    point. The store owns the clock (``tick``) and the index's ``last_used`` stamps;
    a policy decides only which stamps to write and how far the clock moves.

    ``below``: looked up only by a policy that bounds a call by its predecessor.
    """

    name = ""

    @abstractmethod
    def reserve_ticks(self, n: int) -> int:
        """How far a reserve of ``n`` (>= 1) keys advances the clock."""

    @abstractmethod
    def reserved(self, idx: BlockIndex, stamp: int, n: int, below: Below, ids: np.ndarray,
                 new: np.ndarray, handles: np.ndarray, cut: int, present: np.ndarray) -> None:
        """Stamp a reserve's keys, after its places were found. ``stamp``: the clock after
        ``reserve_ticks(n)`` (new entries carry it already); ``ids``: per key its entry
        before the call (``EMPTY`` if absent); ``new``: positions of the keys that got an
        entry, ``handles[new]`` those entries; ``cut``: keys from it on got nothing;
        ``present``: the entries that were there (any state)."""

    @abstractmethod
    def reserved_one(self, idx: BlockIndex, stamp: int, i: int, below: Below) -> None:
        """``reserved`` of a one-key reserve whose key was absent and got entry ``i``."""

    @abstractmethod
    def committed(self, idx: BlockIndex, h: np.ndarray, tick: Tick) -> None:
        """Stamp entries ``h`` just made READY."""

    @abstractmethod
    def pinned(self, idx: BlockIndex, h: np.ndarray, tick: Tick, below: Below) -> None:
        """Stamp the leading READY entries ``h`` (in key order) a load just pinned."""

    @abstractmethod
    def released(self, idx: BlockIndex, u: np.ndarray, tick: Tick) -> None:
        """Stamp entries ``u`` (distinct) whose pins a load just released."""


class LruRecency(Recency):
    """``lru``: every key a call touches gets the clock's next tick."""

    name = "lru"

    def reserve_ticks(self, n: int) -> int:
        return 1

    def reserved(self, idx: BlockIndex, stamp: int, n: int, below: Below, ids: np.ndarray,
                 new: np.ndarray, handles: np.ndarray, cut: int, present: np.ndarray) -> None:
        if present.size:  # someone has just computed them again: used now
            idx.last_used[present[idx.state.take(present) == _READY]] = stamp

    def reserved_one(self, idx: BlockIndex, stamp: int, i: int, below: Below) -> None:
        return None  # a new entry carries the reserve's stamp already

    def committed(self, idx: BlockIndex, h: np.ndarray, tick: Tick) -> None:
        idx.last_used[h] = tick(1)

    def pinned(self, idx: BlockIndex, h: np.ndarray, tick: Tick, below: Below) -> None:
        idx.last_used[h] = tick(1)

    def released(self, idx: BlockIndex, u: np.ndarray, tick: Tick) -> None:
        idx.last_used[u] = tick(1)  # it was in use until now


class PrefixRecency(Recency):
    """``prefix``: a call's keys are stamped by position, head newest (``chain_stamps``),
    below their predecessor's stamp when the call continues a chain. A commit keeps the
    stamps its reserve gave and a release those its pin gave: a commit holds only the
    new tail of a chain and a release no order, so a fresh stamp would lift a tail over
    its head."""

    name = "prefix"

    def reserve_ticks(self, n: int) -> int:
        return n

    def reserved(self, idx: BlockIndex, stamp: int, n: int, below: Below, ids: np.ndarray,
                 new: np.ndarray, handles: np.ndarray, cut: int, present: np.ndarray) -> None:
        if n == 1 and new.size:  # one new block (a one-block save)
            self.reserved_one(idx, stamp, int(handles[0]), below)
            return
        stamps = chain_stamps(stamp, n, below())
        if new.size:
            idx.last_used[handles[new]] = stamps[new]
        if present.size == 0 or cut == 0:
            return
        pos = np.flatnonzero(ids[:cut] >= FIRST_ID)
        pos = pos[idx.state.take(ids[pos]) == _READY]
        if pos.size:  # a key twice in the batch, or already newer, keeps the newer stamp
            np.maximum.at(idx.last_used, ids[pos], stamps[pos])

    def reserved_one(self, idx: BlockIndex, stamp: int, i: int, below: Below) -> None:
        idx.last_used[i] = chain_stamp(stamp, below())

    def committed(self, idx: BlockIndex, h: np.ndarray, tick: Tick) -> None:
        return None

    def pinned(self, idx: BlockIndex, h: np.ndarray, tick: Tick, below: Below) -> None:
        count = int(h.size)
        bound = below()  # before the tick: the predecessor's stamp as it stood
        if count == 1:  # one block a call
            i, stamp = int(h[0]), chain_stamp(tick(1), bound)
            if stamp > int(idx.last_used[i]):
                idx.last_used[i] = stamp
            return
        np.maximum.at(idx.last_used, h, chain_stamps(tick(count), count, bound))

    def released(self, idx: BlockIndex, u: np.ndarray, tick: Tick) -> None:
        return None


def recency(name: str) -> Recency:
    """The policy called ``name`` (one of ``POLICIES``). Raises ``ValueError`` otherwise."""
    for kind in (LruRecency, PrefixRecency):
        if kind.name == name:
            return kind()
    raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)} (got {name!r})")
