"""Consistent-hash placement: which nodes own a block (pure functions).

``Ring.build(view)`` turns a membership view into a ring of virtual nodes;
``Ring.owners(namespace, keys)`` maps a batch of keys to owner indices. Both
are pure: the same view gives the same ring in every process, on every
host, whatever the order the members were listed in (nothing here uses
Python's randomised ``hash()``).

- Each member gets ``round(vnodes * capacity / mean capacity)`` points (at
  least one), so a node with twice the pool owns about twice the keys. A
  point's position is the first 8 bytes of blake2b(``"<node_id>#<i>"``).
- A key's position mixes its canonical words (``emsd.pool.keys``) and tag
  with a per-namespace seed (blake2b of the namespace name) through a
  splitmix64 finaliser, vectorised with numpy uint64 arithmetic (it wraps);
  a batch of one key takes the same steps in Python ints modulo 2**64
  (``key_position``: 8 us for ``owners`` against 47, one block a call).
- A key belongs to the first point at or after its position, clockwise;
  with ``replicas = R`` the next R distinct members clockwise own it, the
  first being the primary. The next-distinct table is computed once at
  build time, so ``owners`` is a ``searchsorted`` and a gather.

Balance (measured in tests/unit/test_placement.py): with 512 virtual nodes
per member (the default) and equal capacities, every node's share of
20,000 random keys stays within 12% of 1/N for N = 2..8 (8% measured; 13%
with 160, the default before 2026-11-23). Balance is pool space: the
fullest node evicts first: on the workload benchmark's traffic (seeds
1-3, ``sim.in_cluster``), a 3-node cluster at 25% of the working set loses
0.7-2.3 hit-rate points against one node of the same total size with 160
points, 0.3-1.1 with 512.

Cost: hashing a member's points takes about 0.4 ms (blake2b per point). A
process hashes each member once and keeps its points (``_member_points``),
so the rebuild after a membership change hashes only the newcomers, then
sorts: 5-8 ms for 100 members on this project's 2-core test machine, against
60 ms when every rebuild hashed every point. When one node joins N others,
the keys that move are those the newcomer now owns, about 1/(N+1) of them,
and they all move to it; when a node leaves, only its keys move.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from emsd.pool.keys import KeyBatch

DEFAULT_VNODES = 512
_MULS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
_MUL = np.array(_MULS, dtype=np.uint64)
_TAG_MUL = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_U64 = (1 << 64) - 1
POINT_CACHE_MEMBERS = 4096  # members whose points a process keeps (4 KiB each at 512 points)
_points_cache: dict[str, np.ndarray] = {}
_points_lock = threading.Lock()


@dataclass(frozen=True)
class Member:
    node_id: str
    capacity: int  # pool bytes: the member's weight


@dataclass(frozen=True)
class ClusterView:
    """Members sorted by id, ids unique; ``version`` grows with each change."""

    members: tuple[Member, ...]
    version: int = 0

    @classmethod
    def of(cls, members: Iterable[Member], version: int = 0) -> ClusterView:
        ordered = tuple(sorted(members, key=lambda m: m.node_id))
        ids = [m.node_id for m in ordered]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate node id in the view")
        if any(m.capacity <= 0 for m in ordered):
            raise ValueError("every member needs a positive capacity")
        return cls(ordered, version)


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _member_points(node_id: str, count: int) -> np.ndarray:
    """Positions of ``node_id``'s first ``count`` points (read-only uint64), hashed once per
    process: a member's i-th point never changes, only how many it has (its weight).
    Keeps the points of the last ``POINT_CACHE_MEMBERS`` members asked for."""
    with _points_lock:
        have = _points_cache.pop(node_id, None)  # re-inserted below: the dict keeps use order
        if have is None or have.size < count:
            start = 0 if have is None else have.size
            more = np.array([_point(f"{node_id}#{i}") for i in range(start, count)], dtype=np.uint64)
            have = more if have is None else np.concatenate([have, more])
            have.setflags(write=False)
        _points_cache[node_id] = have
        while len(_points_cache) > POINT_CACHE_MEMBERS:
            del _points_cache[next(iter(_points_cache))]  # the least recently asked for
        return have[:count]


def _splitmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _M1
    h = h ^ (h >> np.uint64(27))
    h = h * _M2
    return h ^ (h >> np.uint64(31))


@functools.lru_cache(maxsize=1024)
def _seed(namespace: str) -> int:
    """The namespace's seed (a blake2b per name, then remembered)."""
    return _point("ns:" + namespace)


def key_positions(namespace: str, keys: KeyBatch) -> np.ndarray:
    """Ring positions (uint64) of ``keys`` in ``namespace``; the same in every process."""
    h = keys.words @ _MUL
    h ^= keys.tags.astype(np.uint64) * _TAG_MUL
    h ^= np.uint64(_seed(namespace))
    return _splitmix(h)


def key_position(namespace: str, keys: KeyBatch) -> int:
    """``key_positions`` of a batch of one key, in Python int steps (a tenth of the time):
    the same arithmetic modulo 2**64."""
    w0, w1, w2, w3 = keys.words[0].tolist()
    m0, m1, m2, m3 = _MULS
    h = (w0 * m0 + w1 * m1 + w2 * m2 + w3 * m3) & _U64
    h ^= (int(keys.tags[0]) * int(_TAG_MUL)) & _U64
    h ^= _seed(namespace)
    h ^= h >> 30
    h = (h * int(_M1)) & _U64
    h ^= h >> 27
    h = (h * int(_M2)) & _U64
    return h ^ (h >> 31)


@dataclass(frozen=True)
class Ring:
    view: ClusterView
    replicas: int
    points: np.ndarray  # (P,) uint64, sorted
    owners_at: np.ndarray  # (P, replicas) int32: the distinct members from each point on

    @classmethod
    def build(cls, view: ClusterView, vnodes: int = DEFAULT_VNODES, replicas: int = 1) -> Ring:
        if vnodes < 1 or replicas < 1:
            raise ValueError("vnodes and replicas must be at least 1")
        members = view.members
        r = min(replicas, len(members))
        if not members:
            return cls(view, r, np.zeros(0, np.uint64), np.zeros((0, r), np.int32))
        mean = sum(m.capacity for m in members) / len(members)
        per = [_member_points(m.node_id, max(1, round(vnodes * m.capacity / mean))) for m in members]
        pos = np.concatenate(per)
        own = np.repeat(np.arange(len(members), dtype=np.int32), [p.size for p in per])
        order = np.lexsort((own, pos))  # by position; a tie (never seen) by member index
        return cls(view, r, pos[order], _next_distinct(own[order], r))

    def owners(self, namespace: str, keys: KeyBatch) -> np.ndarray:
        """(n, r) member indices into ``view.members``, distinct per row, primary first."""
        if self.points.size == 0:
            raise ValueError("no members in the view: nobody owns anything")
        if len(keys) == 1:  # one block a call: scalar steps
            one = int(self.points.searchsorted(np.uint64(key_position(namespace, keys))))
            one = one if one < self.points.size else 0  # past the last point: wrap to the first
            return self.owners_at[one : one + 1].copy()
        at = np.searchsorted(self.points, key_positions(namespace, keys), side="left")
        at[at == self.points.size] = 0  # past the last point: wrap to the first
        return self.owners_at[at]

    def owner_ids(self, namespace: str, keys: KeyBatch) -> list[list[str]]:
        ids = [m.node_id for m in self.view.members]
        return [[ids[i] for i in row] for row in self.owners(namespace, keys).tolist()]

    def share(self) -> dict[str, float]:
        """Fraction of the hash space each member owns as primary."""
        if self.points.size == 0:
            return {}
        arcs = np.diff(self.points.astype(np.float64), prepend=0.0)
        arcs[0] += 2.0**64 - float(self.points[-1])  # the arc that wraps round to the first point
        totals = np.bincount(self.owners_at[:, 0], weights=arcs, minlength=len(self.view.members))
        return {m.node_id: float(t / 2.0**64) for m, t in zip(self.view.members, totals, strict=True)}


def _next_distinct(owner: np.ndarray, r: int) -> np.ndarray:
    """For each point, the first ``r`` distinct owners from it clockwise.

    ``r`` must be at most the number of distinct owners. Vectorised over the
    points: for each further replica every row steps clockwise from where its
    last owner was found until it meets one it does not hold yet (a few steps
    with many members).
    """
    n = owner.size
    out = np.empty((n, r), dtype=np.int32)
    out[:, 0] = owner
    at = np.arange(n)  # per row: where its latest owner was found (unwrapped)
    for k in range(1, r):
        rows = np.arange(n)
        step = at + 1
        while rows.size:
            cand = owner[step % n]
            held = (out[rows, :k] == cand[:, None]).any(axis=1)
            found = rows[~held]
            out[found, k] = cand[~held]
            at[found] = step[~held]
            rows, step = rows[held], step[held] + 1
    return out
