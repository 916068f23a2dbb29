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

import numpy as np

POLICIES = ("lru", "prefix")


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

