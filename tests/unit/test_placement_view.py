"""``emsd.placement.view.PlacementView``: a daemon's members, ring and placement agreement."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.membership.base import NodeInfo
from emsd.placement.agreement import advertised
from emsd.placement.record import Record
from emsd.placement.ring import ClusterView, Member, Ring
from emsd.placement.view import PlacementView
from emsd.pool.keys import KeyBatch

NS = "ns"


def node(node_id: str, capacity: int = 1 << 30, params: tuple[int, int] = (64, 2)) -> NodeInfo:
    return NodeInfo(node_id, f"10.0.0.{len(node_id)}:7000", capacity, 1, advertised(*params))


members = st.lists(st.sampled_from("bcdefg"), unique=True, max_size=5)
key_ints = st.lists(st.integers(1, 2**63), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(members, st.booleans(), key_ints, st.sampled_from([1, 2, 3]))
def test_the_ring_and_ownership_follow_the_view(others: list[str], with_me: bool, ints: list[int],
                                                 replicas: int) -> None:
    """After ``update`` the ring is the one built from the view's members with the params in use,
    and this node owns a key exactly when it is among the key's owners on that ring."""
    view = PlacementView(node("a"), (64, replicas))
    given_view = tuple(node(n) for n in (["a"] if with_me else []) + others)
    present = view.update(given_view)
    expected = given_view or (node("a"),)  # nobody left: this node alone
    assert present == {n.node_id for n in expected}
    assert view.members == expected
    ring = Ring.build(ClusterView.of(Member(n.node_id, n.capacity) for n in expected), 64, replicas)
    keys = KeyBatch.from_ints(np.array(ints, dtype=np.uint64))
    assert view.owner_ids(NS, keys) == ring.owner_ids(NS, keys)
    assert view.owned_here(NS, keys).tolist() == ["a" in ids for ids in ring.owner_ids(NS, keys)]
    assert view.alone() == (not [n for n in expected if n.node_id != "a"])
    assert view.others() == [m.node_id for m in ring.view.members if m.node_id != "a"]


@given(members, key_ints)
def test_a_draining_node_leaves_itself_out_and_owns_nothing(others: list[str], ints: list[int]) -> None:
    view = PlacementView(node("a"), (64, 1))
    view.draining = True
    view.update(tuple(node(n) for n in ["a", *others]))
    keys = KeyBatch.from_ints(np.array(ints, dtype=np.uint64))
    if others:
        assert [n.node_id for n in view.members] == others
        assert not view.owned_here(NS, keys).any()
        assert all("a" not in ids for ids in view.owner_ids(NS, keys))
    else:  # keys must still be placed somewhere: on itself
        assert [n.node_id for n in view.members] == ["a"]


def test_member_finds_a_node_of_the_current_view_only() -> None:
    view = PlacementView(node("a"), (64, 1))
    view.update((node("a"), node("bb")))
    assert view.member("bb") == node("bb")
    view.update((node("a"),))
    assert view.member("bb") is None


def test_the_record_replaces_the_config_and_is_adopted_once() -> None:
    view = PlacementView(node("a"), (64, 1))
    assert view.params == (64, 1) and not view.config_differs
    assert view.adopt(Record(128, 2, 1))
    assert not view.adopt(Record(128, 2, 1))  # the same record: nothing to rebuild
    assert view.params == (128, 2) and view.config_differs
    view.update((node("a"), node("bb")))
    assert view.ring.replicas == 2
    assert view.adopt(Record(64, 1, 2))
    assert view.params == (64, 1) and not view.config_differs


def test_members_with_other_ring_params_are_named() -> None:
    view = PlacementView(node("a"), (64, 1))
    view.update((node("a", params=(64, 1)), node("bb", params=(160, 1)), node("cc", params=(64, 1))))
    assert view.disagree == {"bb": (160, 1)}


@given(members, st.lists(st.integers(0, 5), min_size=1, max_size=30))
def test_group_splits_positions_by_owner_and_skips_this_node(others: list[str], picks: list[int]) -> None:
    view = PlacementView(node("a"), (64, 1))
    view.update(tuple(node(n) for n in ["a", *others]))
    ring = view.ring
    count = len(ring.view.members)
    owner_idx = np.array([p % count for p in picks])
    positions = np.arange(len(picks)) * 3
    groups = view.group(ring, owner_idx, positions)
    ids = [m.node_id for m in ring.view.members]
    assert "a" not in groups
    expected = {ids[o]: sorted(positions[owner_idx == o].tolist()) for o in set(owner_idx.tolist())
                if ids[o] != "a"}
    assert {k: sorted(v.tolist()) for k, v in groups.items()} == expected
    assert view.my_index(ring) == ids.index("a")
