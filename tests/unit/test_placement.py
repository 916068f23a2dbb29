"""Consistent-hash placement: deterministic, distinct, balanced, minimal movement."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.placement import ClusterView, Member, Ring, key_positions
from emsd.placement.ring import key_position
from emsd.pool.keys import KeyBatch

GiB = 1 << 30
KEYS = KeyBatch.from_ints(np.random.default_rng(0).integers(0, 2**63, 20_000, dtype=np.int64)
                          .astype(np.uint64))


def view(n: int, cap: int = 4 * GiB, start: int = 0) -> ClusterView:
    return ClusterView.of(Member(f"node-{i}", cap) for i in range(start, start + n))


def primary_ids(ring: Ring) -> np.ndarray:
    ids = np.array([m.node_id for m in ring.view.members])
    return ids[ring.owners("ns", KEYS)[:, 0]]


def test_owners_are_the_same_in_another_process_whatever_the_hash_seed() -> None:
    ring = Ring.build(view(5), replicas=2)
    sample = KeyBatch.from_user([1, -1, b"digest" * 5, 2**63 + 7, b""])
    mine = ring.owner_ids("model-x", sample)
    code = (
        "from emsd.placement import Ring, ClusterView, Member\n"
        "from emsd.pool.keys import KeyBatch\n"
        "v = ClusterView.of(Member(f'node-{i}', 4 << 30) for i in reversed(range(5)))\n"
        "print(Ring.build(v, replicas=2).owner_ids('model-x', "
        "KeyBatch.from_user([1, -1, b'digest' * 5, 2**63 + 7, b''])))\n"
    )
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert out.stdout.strip() == str(mine)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**32))
@settings(max_examples=40, deadline=None)
def test_replica_owners_are_distinct_and_as_many_as_possible(n: int, r: int, seed: int) -> None:
    ring = Ring.build(view(n), vnodes=16, replicas=r)
    keys = KeyBatch.from_ints(np.random.default_rng(seed).integers(0, 2**63, 300).astype(np.uint64))
    owners = ring.owners("ns", keys)
    assert owners.shape == (300, min(n, r))
    assert all(len(set(row)) == len(row) for row in owners.tolist())


@pytest.mark.parametrize("n", range(2, 9))
def test_equal_nodes_get_an_equal_share_within_12_percent(n: int) -> None:
    counts = np.unique(primary_ids(Ring.build(view(n))), return_counts=True)[1]
    assert len(counts) == n
    share = counts / counts.sum()
    assert np.all(np.abs(share * n - 1) <= 0.12), share


def test_capacity_weights_the_share() -> None:
    v = ClusterView.of([Member("big", 8 * GiB), Member("small-1", 4 * GiB), Member("small-2", 4 * GiB)])
    ids, counts = np.unique(primary_ids(Ring.build(v)), return_counts=True)
    got = dict(zip(ids.tolist(), (counts / counts.sum()).tolist(), strict=True))
    assert abs(got["big"] / 0.5 - 1) <= 0.25
    assert abs(Ring.build(v).share()["big"] / 0.5 - 1) <= 0.25


@pytest.mark.parametrize("n", [1, 3, 7])
def test_a_joining_node_takes_about_one_in_n_plus_one_keys_and_only_those_move(n: int) -> None:
    before = primary_ids(Ring.build(view(n)))
    after = primary_ids(Ring.build(view(n + 1)))
    moved = before != after
    assert np.all(after[moved] == f"node-{n}")  # every moved key moved to the newcomer
    assert moved.mean() <= 1.5 / (n + 1)
    assert moved.mean() >= 0.5 / (n + 1)


def test_a_leaving_node_moves_only_its_own_keys() -> None:
    before = primary_ids(Ring.build(view(5)))
    gone = "node-2"
    after = primary_ids(Ring.build(ClusterView.of(m for m in view(5).members if m.node_id != gone)))
    moved = before != after
    assert np.all(before[moved] == gone)
    assert not np.any(after == gone)


def test_member_order_does_not_matter_and_views_are_checked() -> None:
    a = Ring.build(ClusterView.of([Member("x", 1), Member("y", 2), Member("z", 3)]), replicas=2)
    b = Ring.build(ClusterView.of([Member("z", 3), Member("x", 1), Member("y", 2)]), replicas=2)
    assert np.array_equal(a.points, b.points) and np.array_equal(a.owners_at, b.owners_at)
    with pytest.raises(ValueError, match="duplicate"):
        ClusterView.of([Member("x", 1), Member("x", 2)])
    with pytest.raises(ValueError, match="no members"):
        Ring.build(ClusterView.of([])).owners("ns", KEYS)


def test_namespaces_place_the_same_key_independently() -> None:
    keys = KeyBatch.from_user([42])
    positions = {int(key_positions(f"model-{i}", keys)[0]) for i in range(50)}
    assert len(positions) == 50


def test_placement_is_a_wire_contract_these_owners_never_change() -> None:
    """Every node of a cluster must place a key alike, across versions: a change of the
    point hash, the key mix or the walk would send keys to nodes that do not hold them.
    (Values from the ring as first released; also what the code of 2026-11-23 gives.)"""
    ring = Ring.build(view(4), replicas=2)
    got = ring.owner_ids("model-x", KeyBatch.from_user([1, -1, b"digest" * 5, 2**63 + 7, b"", 12345]))
    assert got == [["node-3", "node-2"], ["node-1", "node-0"], ["node-1", "node-0"],
                   ["node-0", "node-2"], ["node-1", "node-3"], ["node-1", "node-3"]]
    alone = [ring.owner_ids("model-x", KeyBatch.from_user([k]))[0]
             for k in (1, -1, b"digest" * 5, 2**63 + 7, b"", 12345)]  # one key a call: scalar steps
    assert alone == got


_KEY = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=32))


@given(st.lists(_KEY, min_size=2, max_size=40), st.integers(1, 5), st.integers(1, 3), st.integers(1, 8),
       st.text(max_size=12))
@settings(max_examples=200, deadline=None)
def test_one_key_owners_equal_the_batch_rows(keys: list[int | bytes], n: int, r: int, vnodes: int,
                                              namespace: str) -> None:
    """A batch of one key takes scalar steps (``key_position``): each key alone gets the row
    the vectorised batch gives it, with few points too, where positions past the last one
    wrap round to the first."""
    ring = Ring.build(view(n), vnodes=vnodes, replicas=r)
    batch = KeyBatch.from_user(keys)
    rows = ring.owners(namespace, batch)
    for i in range(len(keys)):
        one = ring.owners(namespace, batch.take(np.array([i])))
        assert one.shape == (1, rows.shape[1]) and one.tolist() == rows[i : i + 1].tolist()
        assert key_position(namespace, batch.take(np.array([i]))) == int(key_positions(namespace, batch)[i])
    ring.owners(namespace, batch.take(np.array([0])))[0, 0] = -1  # the caller's own array
    assert ring.owners(namespace, batch).tolist() == rows.tolist()


def _next_distinct_by_walking(owner: list[int], r: int) -> list[list[int]]:
    """The definition, one point at a time: from each point clockwise, the first r distinct owners."""
    n = len(owner)
    out = []
    for i in range(n):
        found: list[int] = []
        j = i
        while len(found) < r:
            if owner[j % n] not in found:
                found.append(owner[j % n])
            j += 1
        out.append(found)
    return out


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_next_distinct_matches_walking_the_ring(owner: list[int], r: int) -> None:
    from emsd.placement.ring import _next_distinct

    r = min(r, len(set(owner)))
    got = _next_distinct(np.array(owner, dtype=np.int32), r)
    assert got.tolist() == _next_distinct_by_walking(owner, r)


def test_a_rebuild_hashes_only_new_members_and_the_point_cache_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from emsd.placement import ring as ring_mod

    monkeypatch.setattr(ring_mod, "_points_cache", {})
    monkeypatch.setattr(ring_mod, "POINT_CACHE_MEMBERS", 6)
    hashed: list[str] = []
    real = ring_mod._point
    monkeypatch.setattr(ring_mod, "_point", lambda text: hashed.append(text) or real(text))
    first = Ring.build(view(5), vnodes=8)
    assert len(hashed) == 5 * 8
    hashed.clear()
    grown = Ring.build(view(6), vnodes=8)  # one member joins: only its points are hashed
    assert {t.split("#")[0] for t in hashed} == {"node-5"} and len(hashed) == 8
    assert np.array_equal(first.points, Ring.build(view(5), vnodes=8).points)
    hashed.clear()
    weighted = Ring.build(ClusterView.of([*view(5).members, Member("node-5", 8 * GiB)]), vnodes=8)
    assert {t.split("#")[0] for t in hashed} <= {"node-0", "node-1", "node-2", "node-3", "node-4",
                                                  "node-5"}  # more points: only the extra ones
    assert len(hashed) == len(set(hashed)) and all(int(t.split("#")[1]) >= 8 for t in hashed)
    assert weighted.points.size > grown.points.size
    Ring.build(view(4, start=10), vnodes=8)  # four more members: the oldest asked for are dropped
    assert len(ring_mod._points_cache) == 6
    assert "node-10" in ring_mod._points_cache and "node-0" not in ring_mod._points_cache
