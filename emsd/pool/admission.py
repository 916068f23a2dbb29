"""Admission: cache a block only once it has been seen N times (per namespace).

A one-off prompt's blocks are saved once and never loaded again; under
pressure they push out blocks that would have been hits. With a threshold
``N > 1`` for a namespace, a save of a block that is not stored yet counts
one sighting of its key, and the block is stored only from its N-th sighting
on (TinyLFU's idea, without its victim comparison). Since a load only uses a
consecutive run, the first key of a save that is refused cuts the save there,
like a key that found no room.

Sightings are counted in a count-min sketch: ``DEPTH`` rows of ``width``
saturating uint8 counters, each key hashed to one counter per row; a key's
count is the minimum over its rows (never below the true count, above it only
when every row collides). After ``width * AGE_FACTOR`` sightings every counter
is halved, so sightings from long ago fade and the structure never grows:
``DEPTH * width`` bytes whatever the traffic. All functions here are pure but
``SeenSketch.add``, which updates its own table.

``AdmissionRule`` maps a namespace name (as the daemon sees it, tenant
qualified) to its threshold: the first glob pattern of ``pool.admit_after_namespaces``
that matches, else ``pool.admit_after``. 1 (the default) admits every block on
its first save: admission off.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np

DEPTH = 4
DEFAULT_WIDTH = 1 << 20  # 4 MiB of counters: a few percent of over-count up to ~1M live keys
AGE_FACTOR = 8  # halve every counter after width * AGE_FACTOR sightings
MAX_COUNT = 255
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93],
                  dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 in, uint64 out; wraps modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key_digest(ns: int, words: np.ndarray, tags: np.ndarray) -> np.ndarray:
    """One uint64 per key of (``ns``, ``words`` (n, 4) uint64, ``tags`` (n,) uint8).

    Deterministic across processes; equal keys give equal digests.
    """
    with np.errstate(over="ignore"):
        h = _mix(np.full(words.shape[0], ns, dtype=np.uint64) ^ _SEEDS[0])
        for j in range(words.shape[1]):
            h = _mix(h ^ words[:, j].astype(np.uint64))
        return _mix(h ^ tags.astype(np.uint64))


def sketch_slots(digests: np.ndarray, width: int) -> np.ndarray:
    """(DEPTH, n) counter index per row for each digest; ``width`` a power of two."""
    if width <= 0 or width & (width - 1):
        raise ValueError(f"sketch width must be a power of two, got {width}")
    with np.errstate(over="ignore"):
        rows = _mix(digests[None, :] ^ _SEEDS[:DEPTH, None])
    return (rows & np.uint64(width - 1)).astype(np.int64)


def admitted(counts: np.ndarray, threshold: int) -> np.ndarray:
    """True per key whose sighting count reached ``threshold`` (>= 1; 1 admits all)."""
    return counts >= min(threshold, MAX_COUNT)


class SeenSketch:
    """A count-min sketch of key sightings, aged by halving; ``DEPTH * width`` bytes."""

    def __init__(self, width: int = DEFAULT_WIDTH) -> None:
        sketch_slots(np.zeros(0, dtype=np.uint64), width)  # checks width
        self.width = width
        self.table = np.zeros((DEPTH, width), dtype=np.uint8)
        self.added = 0

    def add(self, digests: np.ndarray) -> np.ndarray:
        """Count one sighting per digest (a digest twice in the batch: once) and
        return each digest's estimated count including this one."""
        uniq, inverse = np.unique(digests, return_inverse=True)
        slots = sketch_slots(uniq, self.width)
        rows = np.arange(DEPTH)[:, None]
        cur = self.table[rows, slots]
        np.minimum(cur.astype(np.int64) + 1, MAX_COUNT, out=cur, casting="unsafe")
        self.table[rows, slots] = cur
        self.added += int(uniq.size)
        if self.added >= self.width * AGE_FACTOR:
            self.table >>= 1
            self.added = 0
        return cur.min(axis=0)[inverse]


@dataclass(frozen=True)
class AdmissionRule:
    """Threshold per namespace name: first matching glob in ``patterns``, else ``default``."""

    default: int = 1
    patterns: tuple[tuple[str, int], ...] = ()

    def threshold(self, name: str) -> int:
        for pattern, n in self.patterns:
            if fnmatchcase(name, pattern):
                return n
        return self.default

    @property
    def enabled(self) -> bool:
        return self.default > 1 or any(n > 1 for _, n in self.patterns)
