"""The pure parts of benchmarks/engines: the trace, percentiles, summaries, log parsing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.engines.engine import prompt_of
from benchmarks.engines.run import connector_totals, percentile, quick_trace, resolve, summarise, taken_over
from benchmarks.engines.trace import SPECIAL, VOCAB, EngineRequest, distinct_blocks, engine_trace, to_vocab


@given(st.lists(st.integers(0, 10**9), max_size=200))
def test_to_vocab_maps_every_token_into_the_models_words(tokens: list[int]) -> None:
    out = to_vocab(tokens)
    assert len(out) == len(tokens)
    assert all(SPECIAL <= t < VOCAB for t in out)


def test_engine_b_takes_the_second_half_and_continues_sessions_a_started() -> None:
    trace = engine_trace(10, seed=1)
    engines = [r.engine for r in trace]
    assert engines == sorted(engines)  # every A before every B
    assert engines.count("A") == len(trace) // 2
    first_engine = {}
    for r in trace:
        first_engine.setdefault(r.session, r.engine)
        assert r.returning == (r.id != next(x.id for x in trace if x.session == r.session))
    continued = [r for r in trace if r.engine == "B" and first_engine[r.session] == "A"]
    assert len(continued) >= 5
    assert all(len(r.prompt) <= 8192 for r in trace)


def test_engine_trace_is_the_same_for_a_seed_and_differs_across_seeds() -> None:
    assert [r.prompt for r in engine_trace(6, 3)] == [r.prompt for r in engine_trace(6, 3)]
    assert [r.prompt for r in engine_trace(6, 3)] != [r.prompt for r in engine_trace(6, 4)]


def test_distinct_blocks_counts_shared_prefixes_once() -> None:
    a = list(range(100))
    trace = [EngineRequest("x", "A", 0, False, a), EngineRequest("y", "B", 0, True, a + [7] * 40),
             EngineRequest("z", "B", 1, False, [5] + a[1:])]
    # x: 3 whole blocks of 32; y: the same 3, then 1 more (tokens 96-127); z: 3 new (its first differs)
    assert distinct_blocks(trace, 32) == 3 + 1 + 3


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_lies_between_the_extremes_and_matches_the_ends(xs: list[float], q: float) -> None:
    p = percentile(xs, q)
    assert min(xs) <= p <= max(xs)
    assert percentile(xs, 0.0) == min(xs) and percentile(xs, 1.0) == max(xs)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 0.5))


def test_summarise_compares_outputs_with_the_baseline_token_for_token() -> None:
    trace = quick_trace()
    served = {r.id: {"ttft": 1.0 + i, "e2e": 2.0, "prompt_tokens": len(r.prompt), "cached_tokens": 32,
                     "token_ids": [i]} for i, r in enumerate(trace)}
    same = summarise(trace, served, {k: dict(v) for k, v in served.items()})
    assert same["outputs_equal"] is True
    assert same["returning_ttft_p50"] == 2.0  # the one returning request, q1
    assert same["requests"] == 3
    other = {k: dict(v, token_ids=[99]) if k == "q2-s1" else dict(v) for k, v in served.items()}
    assert summarise(trace, served, other)["outputs_equal"] is False
    assert summarise(trace, served, None)["outputs_equal"] is None


def test_connector_totals_reads_the_last_totals_line_and_nothing_else() -> None:
    log = ('noise\n(MainProcess) INFO [vllm.py:996] EmsStoreConnector worker totals: '
           '{"loaded_blocks": 3, "saved_blocks": 5}\n'
           'INFO EmsStoreConnector worker totals: {"loaded_blocks": 31, "saved_blocks": 2}\n')
    assert connector_totals(log) == {"loaded_blocks": 31, "saved_blocks": 2}
    assert connector_totals("no connector here\n") == {}


def test_a_returning_request_is_its_parents_prompt_and_answer_then_new_tokens() -> None:
    trace = engine_trace(10, seed=1)
    by_id = {r.id: r for r in trace}
    order = [r.id for r in trace]
    for r in trace:
        assert (r.parent is not None) == r.returning
        if r.parent is None:
            assert r.new is None
            continue
        p = by_id[r.parent]
        assert p.session == r.session and order.index(p.id) < order.index(r.id)
        assert r.prompt[: len(p.prompt)] == p.prompt  # then the drawn answer, then the new tokens
        assert r.new is not None and len(r.prompt) == len(p.prompt) + p.answer + len(r.new)
        assert r.prompt[len(r.prompt) - len(r.new):] == r.new
        assert r.as_json(64)["prompt_token_ids"] == r.new and r.as_json(64)["parent"] == p.id
    assert all(0 < r.as_json(64)["max_tokens"] <= 64 for r in trace)  # type: ignore[operator]


def test_a_parent_from_an_earlier_engine_is_spelled_out_with_its_generated_answer() -> None:
    served = {"a0": {"prompt_token_ids": [5, 6, 7], "token_ids": [9, 9]}}
    reqs = [{"id": "b0", "parent": "a0", "prompt_token_ids": [4], "max_tokens": 2},
            {"id": "b1", "parent": "b0", "prompt_token_ids": [3], "max_tokens": 2},
            {"id": "b2", "parent": None, "prompt_token_ids": [8], "max_tokens": 2}]
    out = resolve(reqs, served)
    assert out[0] == {"id": "b0", "parent": None, "prompt_token_ids": [5, 6, 7, 9, 9, 4], "max_tokens": 2}
    assert out[1:] == reqs[1:]  # b1's parent is served by the same engine, which spells it out
    engine_side = {"b0": {"prompt_token_ids": [5, 6, 7, 9, 9, 4], "token_ids": [1]}}
    assert prompt_of(out[1], engine_side) == [5, 6, 7, 9, 9, 4, 1, 3]
    with pytest.raises(KeyError):
        prompt_of(out[1], {})


def test_taken_over_turns_are_those_whose_last_turn_the_other_engine_served() -> None:
    trace = engine_trace(10, seed=1)
    engine = {r.id: r.engine for r in trace}
    taken = taken_over(trace)
    assert taken and all(r.engine == "B" and engine[r.parent] == "A" for r in taken)  # type: ignore[index]
    kept = [r for r in trace if r.returning and r not in taken]
    assert kept and all(engine[r.parent] == r.engine for r in kept)  # type: ignore[index]
    assert [r.id for r in taken_over(quick_trace())] == ["q1-s0"]
