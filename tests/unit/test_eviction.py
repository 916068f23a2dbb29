"""Eviction policy: chain stamps keep every head at least as recent as its tails."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.eviction import POLICIES, chain_stamp, chain_stamps, lru_victims, recency
from emsd.pool.index import READY, BlockIndex
from emsd.pool.keys import KeyBatch


@given(clock=st.integers(0, 2**32 - 1), n=st.integers(0, 5000))
def test_chain_stamps_are_distinct_newer_than_before_and_head_newest(clock: int, n: int) -> None:
    if n > clock:
        with pytest.raises(ValueError, match="n="):
            chain_stamps(clock, n)
        return
    s = chain_stamps(clock, n).astype(np.int64)
    assert s.size == n
    assert (np.diff(s) == -1).all()  # strictly decreasing: head newest
    assert (s > clock - n).all() and (s <= clock).all()


@given(clock=st.integers(0, 10**6), n=st.integers(0, 500), below=st.integers(0, 10**6))
def test_chain_stamps_stay_under_the_predecessor(clock: int, n: int, below: int) -> None:
    if n > clock:
        return
    s = chain_stamps(clock, n, below).astype(np.int64)
    assert (s < max(below, 1)).all() or below == 0 and (s == 0).all()
    assert (s >= 0).all() and (np.diff(s) <= 0).all()
    if below > clock:  # a predecessor newer than the clock bounds nothing
        assert (s == chain_stamps(clock, n)).all()


# A workload of chains: each use touches a run of one of a few token sequences that
# share heads (a trie), from any start (a caller that left out the prefix it has, naming
# the block before as the predecessor), and stamps the run as the store does.
chains = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6)
uses = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 6)), min_size=1,
                max_size=40)


@settings(max_examples=300, deadline=None)
@given(seqs=chains, calls=uses, k=st.integers(1, 30))
def test_victims_never_include_a_block_whose_successor_stays(
        seqs: list[list[int]], calls: list[tuple[int, int, int]], k: int) -> None:
    ids: dict[tuple[int, ...], int] = {}
    stamps: dict[int, int] = {}
    clock = 0
    for which, start, length in calls:
        seq = seqs[which % len(seqs)]
        start = min(start, len(seq) - 1)
        run = [tuple(seq[: i + 1]) for i in range(start, min(start + length, len(seq)))]
        below = stamps.get(ids.get(run[0][:-1], -1)) if start else None
        if start and below is None:
            continue  # the predecessor is not stored: the run would be a chain of its own
        clock += len(run)
        for node, stamp in zip(run, chain_stamps(clock, len(run), below).tolist(), strict=True):
            b = ids.setdefault(node, len(ids))
            stamps[b] = max(stamps.get(b, 0), stamp)
    last_used = np.zeros(len(ids), dtype=np.uint32)
    for b, s in stamps.items():
        last_used[b] = s
    victims = set(lru_victims(last_used, np.arange(len(ids), dtype=np.uint32), k).tolist())
    for node, b in ids.items():
        parent = ids.get(node[:-1])
        if b not in victims and parent is not None and last_used[parent] > 0:
            assert parent not in victims, f"head {node[:-1]} evicted while its successor {node} stays"


# -- the policies as objects ------------------------------------------------------------


def _index_with(n: int) -> tuple[BlockIndex, np.ndarray]:
    """An index holding ``n`` READY entries stamped 0, and their ids in key order."""
    idx = BlockIndex()
    words = np.zeros((n, 4), dtype=np.uint64)
    words[:, 0] = np.arange(1, n + 1, dtype=np.uint64)
    ids = idx.insert_new(0, KeyBatch(words, np.zeros(n, dtype=np.uint8)), np.arange(n, dtype=np.uint32),
                         np.ones(n, dtype=np.uint32), READY, 0)
    return idx, ids


class _Clock:
    def __init__(self) -> None:
        self.now = 10

    def tick(self, n: int) -> int:
        self.now += n
        return self.now


def test_recency_names_each_policy_and_refuses_others() -> None:
    assert [recency(name).name for name in POLICIES] == list(POLICIES)
    with pytest.raises(ValueError, match="lru, prefix"):
        recency("lfu")


@given(st.integers(1, 40), st.sampled_from(POLICIES), st.one_of(st.none(), st.integers(0, 60)))
def test_a_pin_stamps_newer_than_before_and_a_chain_head_first(n: int, name: str, below: int | None) -> None:
    idx, ids = _index_with(n)
    clock = _Clock()
    recency(name).pinned(idx, ids, clock.tick, lambda: below)
    stamps = idx.last_used[ids].astype(np.int64)
    if name == "lru":
        assert clock.now == 11 and (stamps == 11).all()  # one tick for the call, every key on it
        return
    assert clock.now == 10 + n  # one tick per key
    top = clock.now if below is None else min(clock.now, below - 1)
    assert (stamps == np.maximum(top - np.arange(n), 0)).all()  # head newest, under the predecessor


@given(st.integers(1, 40), st.sampled_from(POLICIES))
def test_only_lru_restamps_at_commit_and_release(n: int, name: str) -> None:
    idx, ids = _index_with(n)
    clock = _Clock()
    policy = recency(name)
    policy.committed(idx, ids[: n // 2], clock.tick)
    policy.released(idx, ids[n // 2:], clock.tick)
    stamps = idx.last_used[ids]
    if name == "lru":
        assert (stamps[: n // 2] == 11).all() and (stamps[n // 2:] == 12).all()
    else:
        assert clock.now == 10 and not stamps.any()  # the reserve's and the pin's stamps stand


@given(st.integers(1, 40), st.one_of(st.none(), st.integers(0, 60)))
def test_a_prefix_reserve_stamps_its_new_blocks_as_chain_stamps_says(n: int, below: int | None) -> None:
    idx, ids = _index_with(n)
    absent = np.zeros(n, dtype=np.uint32)  # find's answer before the call: every key new
    recency("prefix").reserved(idx, 50, n, lambda: below, absent, np.arange(n), ids, n,
                               np.zeros(0, dtype=np.uint32))
    assert (idx.last_used[ids] == chain_stamps(50, n, below)).all()


@given(st.integers(1, 2**32 - 1), st.one_of(st.none(), st.integers(0, 2**32 - 1)))  # the clock is 32-bit
def test_chain_stamp_of_one_key_is_chain_stamps_of_one(clock: int, below: int | None) -> None:
    assert chain_stamp(clock, below) == int(chain_stamps(clock, 1, below)[0])
