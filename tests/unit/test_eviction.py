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


# A workload of chains: each use touches a prefix of one of a few token sequences
# that share heads (a trie), and stamps the prefix as the store does.
chains = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(seqs=chains, uses=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1,
                                  max_size=40), k=st.integers(1, 30))
def test_victims_never_include_a_block_whose_successor_stays(
        seqs: list[list[int]], uses: list[tuple[int, int]], k: int) -> None:
    ids: dict[tuple[int, ...], int] = {}
    stamps: dict[int, int] = {}
    clock = 0
    for which, length in uses:
        seq = seqs[which % len(seqs)]
        prefix = [tuple(seq[: i + 1]) for i in range(min(length, len(seq)))]
        clock += len(prefix)
        for node, stamp in zip(prefix, chain_stamps(clock, len(prefix)).tolist(), strict=True):
            b = ids.setdefault(node, len(ids))
            stamps[b] = max(stamps.get(b, 0), stamp)
    last_used = np.zeros(len(ids), dtype=np.uint32)
    for b, s in stamps.items():
        last_used[b] = s
    victims = set(lru_victims(last_used, np.arange(len(ids), dtype=np.uint32), k).tolist())
    for node, b in ids.items():
        parent = ids.get(node[:-1])
        if b not in victims and parent is not None:
            assert parent not in victims, f"head {node[:-1]} evicted while its successor {node} stays"
