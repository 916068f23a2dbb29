"""Hit rates of a trace without a daemon, and its working set on two axes.

All of them follow the replay's protocol per request, which is a
connector's: load the prompt's whole blocks (a hit is a leading run of
stored blocks), then save the whole blocks of prompt + answer that were not
loaded (token semantics with a mask over the loaded prefix; the save names
the last loaded block as its predecessor). ``infinite`` keeps every block
ever saved: the best any cache can do. ``in_store`` drives
``emsd.pool.store.BlockStore`` (the daemon's synchronous core, same code)
with a given capacity, eviction policy and admission threshold, which is
fast enough to sweep many capacities; the real-daemon replays check it at a
few points. ``in_cluster`` does the same for several nodes on the real ring.
``belady`` is the offline reference: a cache that evicts what is needed
furthest in the future.

Two sizes of a trace: ``working_set``, the distinct blocks ever saved, grows
with the length of the trace; ``live_working_set``, the most blocks that are
at one moment both saved and still to be loaded, does not. The latter is the
smallest cache that, knowing the future, hits as often as an infinite one
(``belady`` at that capacity is ``infinite``), which makes it the capacity
axis on which eviction policies compare.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from benchmarks.workload.generator import Request
from ems.tokens import chunk_keys
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore, Status

NEW = int(Status.NEW)


@dataclass(frozen=True)
class Chained:
    """A request's block keys: ``keys`` of prompt + answer, the first ``prompt_blocks`` the prompt's."""

    keys: list[bytes]
    prompt_blocks: int
    prompt_tokens: int


def chain(trace: list[Request], block: int) -> list[Chained]:
    """Whole-block chained keys (``ems.tokens``, as the SDK computes them) of every request."""
    out = []
    for r in trace:
        seq = r.sequence
        whole = seq[: seq.size // block * block]
        out.append(Chained(chunk_keys(whole, block) if whole.size else [], r.prompt.size // block,
                           int(r.prompt.size)))
    return out


def working_set(chained: list[Chained]) -> int:
    """Distinct blocks ever saved: grows with the length of the trace (every one-off adds its own)."""
    return len({k for c in chained for k in c.keys})


def live_blocks(chained: list[Chained]) -> np.ndarray:
    """Per request ``t``, the blocks live at the boundary before it: saved by a request
    before ``t`` and loaded as a prompt block by ``t`` or a later request.

    A block first saved by request ``i`` (as prompt or answer) and last
    loaded by request ``j > i`` is live at boundaries ``i + 1`` to ``j``: the
    request right after the one that saved it counts, the request that saved
    it does not (its load came before its save), and a block never loaded
    after it was first saved is never live. Saving a block again does not
    change when it was first saved.
    """
    first_saved: dict[bytes, int] = {}
    last_loaded: dict[bytes, int] = {}
    for i, c in enumerate(chained):
        for k in c.keys[: c.prompt_blocks]:
            if k in first_saved:
                last_loaded[k] = i
        for k in c.keys:
            first_saved.setdefault(k, i)
    change = np.zeros(len(chained) + 1, dtype=np.int64)
    for k, j in last_loaded.items():
        change[first_saved[k] + 1] += 1
        change[j + 1] -= 1
    return np.cumsum(change[:-1])


def live_working_set(chained: list[Chained]) -> int:
    """The live working set: the most blocks live at one request boundary (``live_blocks``);
    0 for a trace that never loads a block saved before.

    A cache of this many blocks that knows the future hits as often as an
    infinite cache: ``belady(chained, live_working_set(chained))`` equals
    ``infinite(chained)``, request by request (after each request's save,
    the stored blocks with a next use are exactly the live ones, so MIN
    evicts none of them). With one block fewer, any cache lacks some live
    block at the peak and misses it at its next load, unless a request in
    between saves it again outside its prompt; that miss costs a hit where an
    infinite cache hits it there (every block before it in that prompt saved
    earlier). Chained keys of generated tokens meet both conditions (a block
    comes back only inside a prompt, and a block's key implies its
    predecessors'), so there this is the smallest cache that hits as often
    as an infinite one; a hand-built trace need not.
    """
    live = live_blocks(chained)
    return int(live.max()) if live.size else 0


def infinite(chained: list[Chained]) -> np.ndarray:
    """Hit blocks per request with a cache that never evicts."""
    seen: set[bytes] = set()
    hits = np.zeros(len(chained), dtype=np.int64)
    for i, c in enumerate(chained):
        hits[i] = _leading_hits(c, seen)
        seen.update(c.keys)
    return hits


def _leading_hits(c: Chained, stored: set[bytes] | dict[bytes, int]) -> int:
    """How many of ``c``'s prompt blocks, from the first, are in ``stored``."""
    h = 0
    while h < c.prompt_blocks and c.keys[h] in stored:
        h += 1
    return h


def belady(chained: list[Chained], blocks: int) -> np.ndarray:
    """Hit blocks per request with a cache of ``blocks`` blocks that knows the future.

    An offline reference, not a policy the pool could run: when a save needs
    room it evicts the stored blocks (those just saved included: that is not
    caching them) whose next use as a prompt block comes furthest in the
    future, never-used-again first (Belady's MIN). A load counts only its
    leading hits, and for such chained hits MIN by next use is not proven
    optimal, so this is a reference point ("what knowing the future is
    worth here"), not a strict upper bound.
    """
    uses: dict[bytes, list[int]] = {}
    for i, c in enumerate(chained):
        for k in c.keys[: c.prompt_blocks]:
            uses.setdefault(k, []).append(i)
    never = len(chained)
    stored: dict[bytes, int] = {}  # key -> its next use (request index; ``never`` for none)
    heap: list[tuple[int, bytes]] = []  # (-next use, key); stale entries skipped when popped
    hits = np.zeros(len(chained), dtype=np.int64)
    for i, c in enumerate(chained):
        hits[i] = _leading_hits(c, stored)
        for k in c.keys:
            later = uses.get(k, ())
            j = bisect.bisect_right(later, i)
            stored[k] = later[j] if j < len(later) else never
            heapq.heappush(heap, (-stored[k], k))
        while len(stored) > blocks:
            nxt, k = heapq.heappop(heap)
            if stored.get(k) == -nxt:
                del stored[k]
    return hits


def in_store(chained: list[Chained], capacity: int, block_bytes: int, page_size: int,
             eviction: str, admit_after: int = 1) -> np.ndarray:
    """Hit blocks per request against a ``BlockStore`` of ``capacity`` bytes."""
    store = BlockStore(capacity, page_size, eviction=eviction)
    if admit_after > 1:
        store.set_admit_after(0, admit_after)
    hits = np.zeros(len(chained), dtype=np.int64)
    for i, c in enumerate(chained):
        if not c.keys:
            continue
        keys = KeyBatch.from_user(c.keys)
        if c.prompt_blocks:
            pinned = store.pin(0, keys.take(slice(0, c.prompt_blocks)))
            hits[i] = pinned.count
            store.release(pinned.handles)
        h = int(hits[i])
        tail = keys.take(slice(h, None))
        prev = keys.take(slice(h - 1, h)) if h else None
        res = store.reserve(0, tail, np.full(len(tail), block_bytes, dtype=np.uint64), admit=True,
                            prev=prev)
        store.commit(res.handles[res.status == NEW])
    return hits


def in_cluster(chained: list[Chained], nodes: int, capacity: int, block_bytes: int, page_size: int,
               eviction: str, vnodes: int) -> np.ndarray:
    """Hit blocks per request against ``nodes`` in-process ``BlockStore``s of ``capacity`` bytes
    each, every block held by its primary owner on a ``Ring`` of ``vnodes`` points per node.

    What the daemons do with ``write_rcache`` off, minus the network: a load
    pins the prompt's blocks owner by owner in chain order (consecutive
    blocks of one owner in one call, naming the block before as the
    predecessor) up to the first miss; a save reserves the rest at their
    owners the same way.
    """
    from emsd.placement import ClusterView, Member, Ring

    ring = Ring.build(ClusterView.of([Member(f"n{i}", capacity) for i in range(nodes)]), vnodes=vnodes)
    stores = [BlockStore(capacity, page_size, eviction=eviction) for _ in range(nodes)]
    hits = np.zeros(len(chained), dtype=np.int64)
    for i, c in enumerate(chained):
        if not c.keys:
            continue
        keys = KeyBatch.from_user(c.keys)
        owner = ring.owners("workload", keys)[:, 0]
        held = []
        for lo, hi in _runs(owner, 0, c.prompt_blocks):
            store = stores[owner[lo]]
            pinned = store.pin(0, keys.take(slice(lo, hi)), keys.take(slice(lo - 1, lo)) if lo else None)
            held.append((store, pinned.handles))
            hits[i] += pinned.count
            if pinned.count < hi - lo:
                break
        for store, handles in held:
            store.release(handles)
        for lo, hi in _runs(owner, int(hits[i]), len(c.keys)):
            store = stores[owner[lo]]
            res = store.reserve(0, keys.take(slice(lo, hi)), np.full(hi - lo, block_bytes, dtype=np.uint64),
                                admit=True, prev=keys.take(slice(lo - 1, lo)) if lo else None)
            store.commit(res.handles[res.status == NEW])
    return hits


def _runs(owner: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into maximal runs of one owner."""
    if lo >= hi:
        return []
    cuts = [lo, *(np.flatnonzero(np.diff(owner[lo:hi])) + lo + 1).tolist(), hi]
    return list(zip(cuts[:-1], cuts[1:], strict=True))
