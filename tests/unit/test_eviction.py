"""Eviction policy: chain stamps keep every head at least as recent as its tails."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.eviction import chain_stamps, lru_victims


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
