"""``emsd.placement.agreement``: what a node advertises of its ring, and which members differ."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from emsd.membership.base import NodeInfo
from emsd.placement.agreement import RING_KEY, advertised, disagreeing, follows_record, params_of


def node(node_id: str, extra: dict[str, Any]) -> NodeInfo:
    return NodeInfo(node_id, "127.0.0.1:1", 1 << 30, 1, extra)


def test_what_a_node_advertises_reads_back_through_its_membership_entry() -> None:
    info = node("a", {**advertised(160, 2), "rdma": {"x": 1}})
    assert params_of(NodeInfo.decode(info.encode()).extra) == (160, 2)


def test_nothing_or_nonsense_advertised_is_unknown() -> None:
    for extra in ({}, {RING_KEY: 512}, {RING_KEY: {"vnodes": 512}},
                  {RING_KEY: {"vnodes": "512", "replicas": 1}}, {RING_KEY: {"vnodes": 0, "replicas": 1}},
                  {RING_KEY: {"vnodes": True, "replicas": 1}}):
        assert params_of(extra) is None


def test_members_that_differ_are_named_with_their_values() -> None:
    view = [node("a", advertised(512, 1)), node("b", advertised(160, 1)), node("c", advertised(512, 2)),
            node("d", advertised(512, 1)), node("old", {})]
    assert disagreeing(view, "a", (512, 1)) == {"b": (160, 1), "c": (512, 2)}
    assert disagreeing(view, "b", (160, 1)) == {"a": (512, 1), "c": (512, 2), "d": (512, 1)}


params = st.tuples(st.integers(1, 4096), st.integers(1, 8))


@given(st.lists(st.one_of(params, st.none()), max_size=8), params)
def test_exactly_the_other_members_with_known_other_values_are_named(theirs: list[Any], mine: Any) -> None:
    view = [node("me", advertised(*mine))] + [
        node(f"n{i}", {} if p is None else advertised(*p)) for i, p in enumerate(theirs)]
    assert disagreeing(view, "me", mine) == {f"n{i}": p for i, p in enumerate(theirs)
                                             if p is not None and p != mine}


@given(st.lists(st.tuples(st.one_of(params, st.none()), st.booleans()), max_size=8), params)
def test_under_a_record_only_members_that_do_not_follow_it_are_named(theirs: list[Any], record: Any) -> None:
    view = [node("me", advertised(512, 1, follows_record=True))]
    view += [node(f"n{i}", {} if p is None else advertised(*p, follows_record=f))
             for i, (p, f) in enumerate(theirs)]
    assert disagreeing(view, "me", record, skip_followers=True) == {
        f"n{i}": p for i, (p, f) in enumerate(theirs) if p is not None and not f and p != record}


def test_following_the_record_reads_back_through_the_membership_entry() -> None:
    info = node("a", advertised(160, 2, follows_record=True))
    extra = NodeInfo.decode(info.encode()).extra
    assert follows_record(extra) and params_of(extra) == (160, 2)
    assert not follows_record(advertised(160, 2)) and not follows_record({}) and not follows_record(
        {RING_KEY: {"vnodes": 160, "replicas": 2, "record": "yes"}})
