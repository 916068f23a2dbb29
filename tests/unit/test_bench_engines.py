"""The pure parts of benchmarks/engines: the trace, percentiles, summaries, log parsing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.engines.engine import admissible, prompt_of, serve_all
from benchmarks.engines.run import (
    Bench,
    concurrency_sweep,
    connector_totals,
    equal_outputs,
    percentile,
    quick_trace,
    report,
    resolve,
    summarise,
    taken_over,
)
from benchmarks.engines.trace import (
    SPECIAL,
    VOCAB,
    EngineRequest,
    distinct_blocks,
    engine_trace,
    reusable_tokens,
    to_vocab,
)


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


BLOCK = 4
tokens = st.lists(st.integers(0, 3), max_size=40)  # few words: prompts often share blocks


@given(st.lists(st.tuples(tokens, tokens), max_size=8))
def test_reusable_tokens_are_whole_leading_blocks_short_of_the_last_prompt_token(
        served: list[tuple[list[int], list[int]]]) -> None:
    got = reusable_tokens(served, BLOCK)
    assert len(got) == len(served)
    if served:
        assert got[0] == 0  # nothing ran before the first
    for (prompt, _), n in zip(served, got, strict=True):
        assert 0 <= n <= max(0, len(prompt) - 1)
        assert n % BLOCK == 0 or n == len(prompt) - 1  # whole blocks, or all but the last token


@given(st.lists(st.tuples(tokens, tokens), max_size=6), tokens, tokens, tokens)
def test_a_turn_can_reuse_its_parents_prompt_and_answer_but_not_the_answers_last_token(
        before: list[tuple[list[int], list[int]]], prompt: list[int], answer: list[int],
        new: list[int]) -> None:
    turn = prompt + answer + new
    got = reusable_tokens([*before, (prompt, answer), (turn, [])], BLOCK)[-1]
    computed = len(prompt) + max(0, len(answer) - 1)  # the parent's KV: its last token never fed back
    assert got >= min(computed // BLOCK * BLOCK, len(turn) - 1)


@given(st.lists(st.tuples(tokens, tokens), max_size=6), st.lists(st.tuples(tokens, tokens), max_size=6))
def test_more_requests_before_never_leave_less_to_reuse(
        history: list[tuple[list[int], list[int]]], served: list[tuple[list[int], list[int]]]) -> None:
    alone = reusable_tokens(served, BLOCK)
    after = reusable_tokens(history + served, BLOCK)[len(history):]
    assert all(a >= b for a, b in zip(after, alone, strict=True))


def test_a_prompt_whose_first_block_differs_reuses_nothing() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert reusable_tokens([(a, [1, 1]), ([0] + a[1:], [])], BLOCK) == [0, 0]
    assert reusable_tokens([(a, [1, 1]), (a, [])], BLOCK) == [0, 8]  # 2 whole blocks of 4; not the 9th
    # the answer's last token (8) was sampled, never fed back: its block was not computed whole
    assert reusable_tokens([([1, 2, 3], [4, 5, 6, 7, 8]), (list(range(1, 10)), [])], BLOCK) == [0, 4]


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
                     "token_ids": [i], "prompt_token_ids": r.prompt} for i, r in enumerate(trace)}
    same = summarise(trace, served, {k: dict(v) for k, v in served.items()})
    assert same["outputs_equal"] is True
    assert same["returning_ttft_p50"] == 2.0  # the one returning request, q1
    assert same["requests"] == 3
    other = {k: dict(v, token_ids=[99]) if k == "q2-s1" else dict(v) for k, v in served.items()}
    assert summarise(trace, served, other)["outputs_equal"] is False
    assert summarise(trace, served, None)["outputs_equal"] is None
    tokens = sum(len(r.prompt) + 1 for r in trace)
    assert same["throughput_tok_s"] == tokens / 6.0  # over the summed request times by default
    assert summarise(trace, served, None, seconds=3.0)["throughput_tok_s"] == tokens / 3.0


def test_summarise_names_the_requests_whose_engines_computed_what_a_cache_could_have_supplied() -> None:
    trace = quick_trace()  # q1 is q0's prompt and answer, then new tokens; q2 shares nothing
    answer = list(range(3, 3 + 40))
    prompts = {"q0-s0": trace[0].prompt, "q1-s0": trace[0].prompt + answer + trace[1].new,
               "q2-s1": trace[2].prompt}
    can = (len(trace[0].prompt) + len(answer) - 1) // 32 * 32  # q0's KV: its answer's last token never fed
    served = {k: {"ttft": 1.0, "e2e": 2.0, "prompt_tokens": len(v), "cached_tokens": 0,
                  "token_ids": answer if k == "q0-s0" else [5], "prompt_token_ids": v}
              for k, v in prompts.items()}
    cold = summarise(trace, served, None)
    assert cold["below_ceiling"] == ["q1-s0"]
    assert cold["reusable_share"] == can / sum(len(v) for v in prompts.values())
    assert cold["returning_reusable_share"] == can / len(prompts["q1-s0"])
    full = {k: dict(v, cached_tokens=can if k == "q1-s0" else 0) for k, v in served.items()}
    assert summarise(trace, full, None)["below_ceiling"] == []
    assert summarise(trace, full, None)["returning_cached_share"] == can / len(prompts["q1-s0"])


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


def _chain_requests(parents: list[int | None]) -> list[dict[str, Any]]:
    """Request i with parent ``parents[i]`` (an earlier index, or None)."""
    return [{"id": f"r{i}", "parent": None if p is None else f"r{p}", "prompt_token_ids": [i + 1],
             "max_tokens": 1 + i % 3} for i, p in enumerate(parents)]


_parents = st.lists(st.integers(0, 1000), max_size=12).map(
    lambda xs: [None if x % 3 == 0 or i == 0 else x % i for i, x in enumerate(xs)])


@given(_parents, st.sets(st.integers(0, 11)), st.integers(0, 6), st.integers(1, 6))
def test_admissible_takes_ready_requests_in_order_up_to_the_room(
        parents: list[int | None], done_idx: set[int], in_flight: int, limit: int) -> None:
    pending = _chain_requests(parents)
    done = {f"r{i}" for i in done_idx}
    out = admissible(pending, done, in_flight, limit)
    ready = [r for r in pending if r["parent"] is None or r["parent"] in done]
    assert out == ready[:max(0, limit - in_flight)]  # a prefix of the ready ones, in order


@dataclass
class _Out:
    request_id: str
    outputs: list[Any]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class _Tokens:
    token_ids: list[int]


@dataclass
class _Engine:
    """A stand-in for vLLM's engine loop: each step gives every request one more token, and a
    request finishes once it has ``max_tokens``; it records how many were in it at each step."""

    running: dict[str, list[int]] = field(default_factory=dict)
    wanted: dict[str, int] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    widths: list[int] = field(default_factory=list)

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: int) -> None:
        self.running[rid], self.wanted[rid] = [], params
        self.prompts[rid] = prompt["prompt_token_ids"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[_Out]:
        self.widths.append(len(self.running))
        outs = []
        for rid, toks in list(self.running.items()):
            toks.append(100 + len(toks))
            done = len(toks) >= self.wanted[rid]
            outs.append(_Out(rid, [_Tokens(list(toks))], done))
            if done:
                del self.running[rid]
        return outs


@given(_parents, st.integers(1, 5))
def test_serve_all_keeps_at_most_the_limit_in_flight_and_sends_each_turn_after_its_parent(
        parents: list[int | None], limit: int) -> None:
    requests = _chain_requests(parents)
    engine = _Engine()
    served, seconds = serve_all(engine, requests, limit, lambda r: int(r["max_tokens"]))
    assert set(served) == {r["id"] for r in requests} and seconds >= 0
    assert max(engine.widths, default=0) <= limit
    for r in requests:
        got = served[r["id"]]
        assert got["token_ids"] == [100 + k for k in range(int(r["max_tokens"]))]
        assert 0 <= got["ttft"] <= got["e2e"]
        if r["parent"] is not None:  # the parent's prompt and answer, then its own tokens
            parent = served[r["parent"]]
            assert engine.prompts[r["id"]] == parent["prompt_token_ids"] + parent["token_ids"] + [
                r["prompt_token_ids"][0]]


def test_serve_all_fills_the_engine_when_requests_are_independent_and_one_at_a_time_at_limit_one() -> None:
    requests = _chain_requests([None] * 6)
    wide, narrow = _Engine(), _Engine()
    serve_all(wide, requests, 4, lambda r: 3)
    serve_all(narrow, requests, 1, lambda r: 3)
    assert max(wide.widths) == 4
    assert set(narrow.widths) == {1}


def test_serve_all_refuses_a_request_whose_parent_is_not_served() -> None:
    with pytest.raises(RuntimeError, match="waits for"):
        serve_all(_Engine(), [{"id": "b", "parent": "nowhere", "prompt_token_ids": [1], "max_tokens": 1}],
                  2, lambda r: 1)


def test_report_gives_the_sweep_ratios_the_saved_check_and_unequal_outputs_as_counts() -> None:
    row = {"ttft_p50": 1.0, "ttft_p90": 2.0, "returning_ttft_p50": 1.0, "returning_ttft_p90": 2.0,
           "taken_over_ttft_p50": 2.0, "taken_over_ttft_p90": 3.0, "throughput_tok_s": 100.0,
           "cached_share": 0.5, "returning_cached_share": 0.8, "reusable_share": 0.67,
           "returning_reusable_share": 0.9, "below_ceiling": [], "other_cpu_seconds": 0.0, "requests": 21}
    results = {"concurrency": 4, "trace": {"requests": 21},
               "systems": {"cold": dict(row, outputs_equal=True, equal_outputs=21),
                           "emsd": dict(row, returning_ttft_p50=0.25, outputs_equal=False, equal_outputs=18,
                                        saved_check={"blocks": 600, "equal": 600, "missing": 4})},
               "concurrency_sweep": {
                   "levels": [1, 4],
                   "cold": {"returning_ttft_p50": [1.0, 4.0], "taken_over_ttft_p50": [2.0, 8.0],
                            "throughput_tok_s": [100.0, 120.0], "equal_outputs": [21, 21]},
                   "emsd": {"returning_ttft_p50": [0.5, 1.0], "taken_over_ttft_p50": [0.2, 0.8],
                            "throughput_tok_s": [120.0, 150.0], "equal_outputs": [21, 18]}}}
    text = report(results)
    assert "Requests in each engine at once: 4" in text
    assert "| 18 of 21 |" in text and equal_outputs(results["systems"]["cold"]) == "yes"
    assert "returning TTFT p50 0.250x" in text
    assert "0.67 of the prompt tokens, the ceiling of the cached column" in text
    assert "of the returning turns' 0.90, where the engines found cold 0.80, emsd 0.80" in text
    assert "Requests below the ceiling: cold 0; emsd 0" in text
    assert "of the 604 blocks left in the engines' prefix caches, emsd held 600, 600 of them" in text
    assert ("| 4 | 4.000 / 1.000 | 0.250x | 8.000 / 0.800 | 0.100x | 120.000 / 150.000 | 1.250x "
            "| 18 of 21 |") in text


def test_the_sweep_takes_the_traces_own_results_at_its_level_instead_of_serving_again(tmp_path: Path) -> None:
    row = {"returning_ttft_p50": 1.0, "taken_over_ttft_p50": 2.0, "throughput_tok_s": 3.0,
           "equal_outputs": 21}
    measured = {"cold": dict(row), "emsd": dict(row, returning_ttft_p50=0.5,
                                              saved_check={"blocks": 9, "equal": 9, "missing": 0})}
    # no model and no daemons: serving the trace here would fail
    out = concurrency_sweep(tmp_path, Bench(tmp_path / "no-model"), quick_trace(), [1], 1 << 20, measured)
    assert out["cold"]["returning_ttft_p50"] == [1.0] and out["emsd"]["returning_ttft_p50"] == [0.5]
    assert out["saved_check"] == [{"blocks": 9, "equal": 9, "missing": 0}]
