"""Admission: the count-min sketch of sightings and the per-namespace rule."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.pool.admission import (
    DEPTH,
    AdmissionRule,
    SeenSketch,
    admitted,
    key_digest,
    sketch_slots,
)
from emsd.pool.keys import KeyBatch


def digests(ns: int, keys: list[int]) -> np.ndarray:
    kb = KeyBatch.from_ints(np.array(keys, dtype=np.uint64))
    return key_digest(ns, kb.words, kb.tags)


@given(ns=st.integers(0, 1000), keys=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_digests_are_deterministic_and_tell_namespaces_apart(ns: int, keys: list[int]) -> None:
    d = digests(ns, keys)
    assert (d == digests(ns, keys)).all()
    assert (d != digests(ns + 1, keys)).all()


@given(d=st.lists(st.integers(0, 2**64 - 1), max_size=100), width=st.sampled_from([1, 64, 1 << 16]))
def test_slots_stay_in_the_table(d: list[int], width: int) -> None:
    s = sketch_slots(np.array(d, dtype=np.uint64), width)
    assert s.shape == (DEPTH, len(d))
    assert ((s >= 0) & (s < width)).all()


def test_a_width_that_is_not_a_power_of_two_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        SeenSketch(width=1000)


@settings(max_examples=100, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=20), max_size=30),
       width=st.sampled_from([16, 256, 4096]))
def test_counts_never_fall_below_the_true_count_before_ageing(batches: list[list[int]],
                                                               width: int) -> None:
    sketch = SeenSketch(width=width)
    truth: Counter[int] = Counter()
    for batch in batches:
        if sketch.added + len(set(batch)) >= width * 8:
            return  # ageing halves counts: the bound holds until then
        got = sketch.add(digests(0, batch))
        truth.update(set(batch))
        assert all(int(c) >= min(truth[k], 255) for k, c in zip(batch, got.tolist(), strict=True))


def test_a_wide_sketch_counts_exactly() -> None:
    sketch = SeenSketch(width=1 << 16)
    for _ in range(3):
        got = sketch.add(digests(0, [1, 2, 2, 3]))
    assert got.tolist() == [3, 3, 3, 3]
    assert sketch.add(digests(0, [4])).tolist() == [1]


def test_ageing_halves_every_counter_after_width_times_eight_sightings() -> None:
    sketch = SeenSketch(width=16)
    seen = [int(sketch.add(digests(0, [7]))[0]) for _ in range(16 * 8 + 1)]
    assert seen[16 * 8 - 1] == 16 * 8  # the sighting that reaches the budget, then halving
    assert seen[16 * 8] == 16 * 8 // 2 + 1


@given(counts=st.lists(st.integers(0, 255), max_size=20), n=st.integers(1, 300))
def test_admitted_means_count_reached_threshold(counts: list[int], n: int) -> None:
    got = admitted(np.array(counts, dtype=np.uint8), n)
    assert got.tolist() == [c >= min(n, 255) for c in counts]


def test_rule_takes_the_first_matching_glob_else_the_default() -> None:
    rule = AdmissionRule(1, (('*"chat-model"*', 2), ("*", 3)))
    assert rule.threshold('["v1",null,"chat-model"]') == 2
    assert rule.threshold("other") == 3
    assert AdmissionRule(4).threshold("x") == 4
    assert not AdmissionRule().enabled and AdmissionRule(1, (("a", 2),)).enabled
