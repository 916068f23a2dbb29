"""Hit rates of a trace without a daemon: an infinite cache, and the pool's own store in process.

Both follow the replay's protocol per request, which is a connector's: load
the prompt's whole blocks (a hit is a leading run of stored blocks), then
save the whole blocks of prompt + answer that were not loaded (token
semantics with a mask over the loaded prefix; the save names the last
loaded block as its predecessor). ``infinite`` keeps every block ever saved:
the best any cache can do. ``in_store`` drives ``emsd.pool.store.BlockStore``
(the daemon's synchronous core, same code) with a given capacity, eviction
policy and admission threshold, which is fast enough to sweep many
capacities; the real-daemon replays check it at a few points.
"""

from __future__ import annotations

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
    """Distinct blocks ever saved."""
    return len({k for c in chained for k in c.keys})


def infinite(chained: list[Chained]) -> np.ndarray:
    """Hit blocks per request with a cache that never evicts."""
    seen: set[bytes] = set()
    hits = np.zeros(len(chained), dtype=np.int64)
    for i, c in enumerate(chained):
        h = 0
        while h < c.prompt_blocks and c.keys[h] in seen:
            h += 1
        hits[i] = h
        seen.update(c.keys)
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
