"""The workload generator (benchmarks/workload): deterministic per seed, distributions as stated."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.workload import sim
from benchmarks.workload.generator import Lognormal, Mix, generate
from benchmarks.workload.ttft import LoadCost, ModelCost, ttft, ttft_curve

SMALL = Mix(sessions=120, span_s=300.0)


def test_same_seed_same_trace_and_another_seed_another() -> None:
    a, b, c = generate(SMALL, 3), generate(SMALL, 3), generate(SMALL, 4)
    assert [(r.time, r.session, r.kind) for r in a] == [(r.time, r.session, r.kind) for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.answer_tokens, y.answer_tokens)
               for x, y in zip(a, b, strict=True))
    assert [r.time for r in a] != [r.time for r in c]


def test_trace_is_in_time_order_and_turns_extend_their_context() -> None:
    trace = generate(SMALL, 5)
    assert [r.time for r in trace] == sorted(r.time for r in trace)
    last: dict[int, np.ndarray] = {}
    for r in trace:
        if r.session in last:  # the next turn starts with everything the engine held
            prev = last[r.session]
            assert np.array_equal(r.prompt[: prev.size], prev)
        last[r.session] = r.sequence
    assert max(r.prompt.size for r in trace) <= SMALL.max_context


def test_session_mix_and_lengths_follow_the_stated_parameters() -> None:
    mix = Mix(sessions=2000, span_s=300.0)
    trace = generate(mix, 7)
    kinds = {k: len({r.session for r in trace if r.kind == k}) for k in ("chat", "agent", "oneoff")}
    assert abs(kinds["chat"] / mix.sessions - mix.chat) < 0.04
    assert abs(kinds["agent"] / mix.sessions - mix.agent) < 0.04
    turns = np.bincount([r.session for r in trace if r.kind == "chat"])
    turns = turns[turns > 0]
    assert abs(turns.mean() - 1 / mix.turn_p) < 0.3  # Geometric(p): mean 1 / p
    answers = np.array([r.answer_tokens.size for r in trace if r.kind == "chat"])
    assert abs(np.median(answers) - mix.answer_len.median) < 0.15 * mix.answer_len.median
    shared = {r.prompt[:64].tobytes() for r in trace if r.kind == "chat"}
    assert len(shared) <= mix.system_prompts  # every chat opens with a shared system prompt


def test_lognormal_is_clipped_and_centred_on_its_median() -> None:
    d = Lognormal(100, 1.0, 10, 500)
    x = d.draw(np.random.default_rng(0), 20000)
    assert x.min() >= 10 and x.max() <= 500
    assert abs(np.median(x) - 100) < 5


def test_infinite_cache_hits_every_block_seen_before() -> None:
    trace = generate(SMALL, 2)
    chained = sim.chain(trace, 64)
    inf = sim.infinite(chained)
    assert (inf <= np.array([c.prompt_blocks for c in chained])).all()
    assert inf[0] == 0 and inf.sum() > 0
    big = sim.in_store(chained, 64 << 20, 4096, 64 << 10, "prefix")
    assert np.array_equal(big, inf)  # a pool that holds everything is an infinite cache


def test_in_process_cluster_of_one_node_is_the_store_and_a_big_one_the_infinite_cache() -> None:
    chained = sim.chain(generate(SMALL, 3), 64)
    small = 256 << 10
    one = sim.in_cluster(chained, 1, small, 4096, 64 << 10, "prefix", 16)
    assert np.array_equal(one, sim.in_store(chained, small, 4096, 64 << 10, "prefix"))
    assert one.sum() < sim.infinite(chained).sum()  # the small pool does evict
    big = sim.in_cluster(chained, 3, 64 << 20, 4096, 64 << 10, "prefix", 16)
    assert np.array_equal(big, sim.infinite(chained))


def test_ttft_model_falls_further_the_longer_the_context() -> None:
    model, load = ModelCost(), LoadCost(0.001, 10e9)
    without, with_cache = ttft_curve(model, load, np.array([1000, 10_000, 100_000]), 100)
    ratio = with_cache / without
    assert (np.diff(ratio) < 0).all()
    assert float(ttft(model, load, 1000, 0)) == float(model.prefill_s(1000, 0))
    assert model.kv_bytes_per_token == 131072


def _request(keys: list[bytes], prompt_blocks: int) -> sim.Chained:
    return sim.Chained(keys, prompt_blocks, prompt_blocks * 64)


def test_belady_keeps_the_block_needed_again_where_lru_does_not() -> None:
    # One block of room: a is saved, then a one-off b, then a is loaded. Knowing the
    # future, the cache does not keep b (never used again); LRU keeps b and loses a.
    chained = [_request([b"a"], 0), _request([b"b"], 0), _request([b"a"], 1)]
    assert sim.belady(chained, 1).tolist() == [0, 0, 1]
    assert sim.in_store(chained, 4096, 4096, 4096, "lru").tolist() == [0, 0, 0]
    assert sim.belady(chained, 0).tolist() == [0, 0, 0]


def test_belady_is_the_infinite_cache_when_everything_fits_and_beats_the_store_when_not() -> None:
    chained = sim.chain(generate(SMALL, 3), 64)
    ws = sim.working_set(chained)
    assert np.array_equal(sim.belady(chained, ws), sim.infinite(chained))
    for blocks in (ws // 10, ws // 4):
        offline = int(sim.belady(chained, blocks).sum())
        assert offline < sim.infinite(chained).sum()
        for policy in ("lru", "prefix"):
            assert offline >= sim.in_store(chained, blocks * 4096, 4096, 4096, policy).sum()


def test_live_working_set_of_a_hand_built_trace() -> None:
    # r0 saves a, b; r1 loads them (the very next request: live) and saves c; r2's one
    # prompt block d is saved by r2 itself (its load came first) and never loaded again;
    # r3 loads a; r4 loads a, b, c. Live before r1..r4: {a, b}, then {a, b, c}; d, e, f never.
    chained = [_request([b"a", b"b"], 1), _request([b"a", b"b", b"c"], 2), _request([b"d"], 1),
               _request([b"a", b"e"], 1), _request([b"a", b"b", b"c", b"f"], 3)]
    assert sim.live_blocks(chained).tolist() == [0, 2, 3, 3, 3]
    assert sim.live_working_set(chained) == 3
    assert sim.working_set(chained) == 6
    assert sim.infinite(chained).tolist() == [0, 2, 0, 1, 3]
    assert np.array_equal(sim.belady(chained, 3), sim.infinite(chained))
    assert sim.belady(chained, 2).sum() < sim.infinite(chained).sum()  # r4 finds b or c gone
    assert sim.live_working_set(chained[:3]) == 2  # ends after r2: a, b last loaded by r1
    assert sim.live_working_set([_request([b"x"], 1), _request([b"y"], 1)]) == 0
    assert sim.live_working_set([]) == 0


def _saved_blocks_come_back_only_in_prompts(chained: list[sim.Chained]) -> bool:
    """No request has, past its prompt, a block saved by an earlier request."""
    seen: set[bytes] = set()
    for c in chained:
        if seen.intersection(c.keys[c.prompt_blocks:]):
            return False
        seen.update(c.keys)
    return True


def _infinite_hits_every_saved_prompt_block(chained: list[sim.Chained]) -> bool:
    """Every prompt block saved before is within the infinite cache's leading hits."""
    seen: set[bytes] = set()
    for c, h in zip(chained, sim.infinite(chained).tolist(), strict=True):
        if sum(k in seen for k in c.keys[: c.prompt_blocks]) != h:
            return False
        seen.update(c.keys)
    return True


@pytest.mark.parametrize(("sessions", "seed"), [(20, 1), (30, 2), (40, 3), (40, 4)])
def test_live_working_set_is_the_smallest_cache_that_knowing_the_future_hits_as_often_as_an_infinite_one(
        sessions: int, seed: int) -> None:
    chained = sim.chain(generate(Mix(sessions=sessions, span_s=3.0 * sessions, agent_steps=(3, 8)), seed), 64)
    live, inf = sim.live_working_set(chained), sim.infinite(chained)
    assert 0 < live < sim.working_set(chained)
    assert np.array_equal(sim.belady(chained, live), inf)
    # One block fewer must lose a hit only where the peak's missing block cannot come back
    # before its load and an infinite cache would hit it there: generated traces are so.
    assert _saved_blocks_come_back_only_in_prompts(chained)
    assert _infinite_hits_every_saved_prompt_block(chained)
    assert sim.belady(chained, live - 1).sum() < inf.sum()
