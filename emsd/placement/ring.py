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
  splitmix64 finaliser, vectorised with numpy uint64 arithmetic (it wraps).
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
points, 0.3-1.1 with 512. Building costs about
0.7 ms per member (blake2b per point). When one node joins N others, the keys
that move are those the newcomer now owns, about 1/(N+1) of them, and they
all move to it; when a node leaves, only its keys move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from emsd.pool.keys import KeyBatch

DEFAULT_VNODES = 512
_MUL = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
                dtype=np.uint64)
_TAG_MUL = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


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


def _splitmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _M1
    h = h ^ (h >> np.uint64(27))
    h = h * _M2
    return h ^ (h >> np.uint64(31))


def key_positions(namespace: str, keys: KeyBatch) -> np.ndarray:
    """Ring positions (uint64) of ``keys`` in ``namespace``; the same in every process."""
    seed = np.uint64(_point("ns:" + namespace))
    h = keys.words @ _MUL
    h ^= keys.tags.astype(np.uint64) * _TAG_MUL
    h ^= seed
    return _splitmix(h)


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
        pos: list[int] = []
        own: list[int] = []
        for idx, m in enumerate(members):
            for i in range(max(1, round(vnodes * m.capacity / mean))):
                pos.append(_point(f"{m.node_id}#{i}"))
                own.append(idx)
        order = np.lexsort((np.array(own), np.array(pos, dtype=np.uint64)))
        points = np.array(pos, dtype=np.uint64)[order]
        owner = np.array(own, dtype=np.int32)[order]
        return cls(view, r, points, _next_distinct(owner, r))

    def owners(self, namespace: str, keys: KeyBatch) -> np.ndarray:
        """(n, r) member indices into ``view.members``, distinct per row, primary first."""
        if self.points.size == 0:
            raise ValueError("no members in the view: nobody owns anything")
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
    """For each point, the first ``r`` distinct owners from it clockwise."""
    n = owner.size
    out = np.empty((n, r), dtype=np.int32)
    seq = owner.tolist()
    for i in range(n):
        found: list[int] = []
        j = i
        while len(found) < r:
            o = seq[j % n]
            if o not in found:
                found.append(o)
            j += 1
        out[i] = found
    return out
