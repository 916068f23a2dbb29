"""benchmarks/bench_latency.py: how one call's time is split, and the pool it asks for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_latency import PAGE, batch_pool, pool_bytes, split


def test_a_call_is_split_at_its_first_send_and_the_answer_to_it() -> None:
    marks = [("answer", 0.5), ("send", 1.0), ("send", 1.5), ("answer", 3.0), ("answer", 4.0)]
    assert split(0.0, 10.0, marks) == (10.0, 1.0, 2.0, 7.0)


def test_a_call_that_sent_nothing_is_all_before_and_one_never_answered_all_round_trip() -> None:
    assert split(1.0, 3.0, []) == (2.0, 2.0, 0.0, 0.0)
    assert split(1.0, 3.0, [("send", 1.5)]) == (2.0, 0.5, 1.5, 0.0)


@given(st.lists(st.tuples(st.sampled_from(["send", "answer"]), st.floats(0.0, 1.0)), max_size=8))
def test_the_parts_are_never_negative_and_add_up_to_the_call(raw: list[tuple[str, float]]) -> None:
    marks = sorted(raw, key=lambda m: m[1])
    whole, before, trip, after = split(0.0, 1.0, marks)
    assert whole == 1.0
    assert min(before, trip, after) >= 0.0
    assert before + trip + after == pytest.approx(whole)


@pytest.mark.parametrize(("size", "n"), [(64 << 10, 1000), (2 << 20, 500), (8 << 20, 400), (4096, 10)])
def test_the_pool_holds_a_pass_in_whole_pages_and_at_least_1_gib(size: int, n: int) -> None:
    pool = pool_bytes(size, n)
    assert pool >= max(1 << 30, n * size)
    assert pool % PAGE == 0


@given(st.sampled_from([4096, 64 << 10, 2 << 20, 8 << 20]), st.integers(1, 1024), st.integers(1, 400))
def test_the_batch_pool_is_full_after_the_warm_up_or_holds_every_round(size: int, k: int,
                                                                       rounds: int) -> None:
    batch = size * k
    full, roomy = batch_pool(size, k, rounds, True), batch_pool(size, k, rounds, False)
    assert full % PAGE == 0 and roomy % PAGE == 0
    assert 2 * batch <= full < max(2, rounds // 10) * batch + PAGE  # a RESERVE evicts, never fails
    assert roomy >= (rounds + 1) * batch  # nothing is evicted
