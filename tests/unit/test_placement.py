"""Consistent-hash placement: deterministic, distinct, balanced, minimal movement."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.placement import ClusterView, Member, Ring, key_positions
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
