"""chunk_keys: chained prefix keys, equal exactly for equal prefixes, deterministic, fast."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ems.tokens import DOMAIN, SEED, chunk_keys

TOKENS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)
SMALL_TOKENS = st.lists(st.integers(0, 3), max_size=40)  # many shared prefixes
BLOCK = st.integers(1, 8)


def keys(tokens: list[int], bs: int) -> list[bytes]:
    return chunk_keys(np.asarray(tokens, dtype=np.int64), bs)


def test_first_key_matches_the_documented_formula() -> None:
    tokens = np.array([1, 2, 3], dtype=np.int64)
    data = DOMAIN + SEED + tokens.astype("<i8").tobytes() + (3).to_bytes(8, "little")
    assert keys([1, 2, 3], 4) == [hashlib.blake2b(data, digest_size=32).digest()]


def test_known_vector_is_stable() -> None:
    """Pinned value: a change here breaks every stored token key."""
    assert keys([1, 2, 3, 4, 5], 2)[-1].hex() == (
        "32edcba5b2cbd9488061d833a3b2daf18243ffdf094bd6589768a2769c8086b6")


@given(TOKENS, BLOCK)
def test_one_key_per_chunk_of_32_bytes(tokens: list[int], bs: int) -> None:
    got = keys(tokens, bs)
    assert len(got) == -(-len(tokens) // bs)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in got)


@given(SMALL_TOKENS, SMALL_TOKENS, BLOCK)
def test_key_equal_exactly_when_prefix_equal(a: list[int], b: list[int], bs: int) -> None:
    ka, kb = keys(a, bs), keys(b, bs)
    for c in range(min(len(ka), len(kb))):
        end_a, end_b = min((c + 1) * bs, len(a)), min((c + 1) * bs, len(b))
        assert (ka[c] == kb[c]) == (a[:end_a] == b[:end_b])


@given(TOKENS, BLOCK, st.data())
def test_changing_one_token_changes_its_chunk_and_all_later(tokens: list[int], bs: int,
                                                           data: st.DataObject) -> None:
    assume(tokens)
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = tokens[i] + 1 if tokens[i] < 2**63 - 1 else 0
    before, after = keys(tokens, bs), keys(changed, bs)
    chunk = i // bs
    assert before[:chunk] == after[:chunk]
    assert all(x != y for x, y in zip(before[chunk:], after[chunk:], strict=True))


@given(st.lists(st.integers(0, 100), min_size=2, max_size=30), BLOCK)
def test_partial_last_chunk_differs_from_full_and_other_lengths(tokens: list[int], bs: int) -> None:
    assume(bs > 1)
    full = keys(tokens, bs)
    for cut in range(1, len(tokens)):
        shorter = keys(tokens[:cut], bs)
        if cut % bs:  # the last chunk of the shorter list is partial
            assert shorter[-1] not in full


def test_partial_chunk_with_trailing_zero_differs() -> None:
    assert keys([7], 4) != keys([7, 0], 4)


def test_keys_depend_on_block_size_boundaries() -> None:
    assert keys([1, 2, 3, 4], 2)[-1] != keys([1, 2, 3, 4], 4)[-1]


def test_accepts_int32_and_keeps_values() -> None:
    assert keys([1, 2, 3], 2) == chunk_keys(np.array([1, 2, 3], dtype=np.int32), 2)


def test_empty_tokens_give_no_keys() -> None:
    assert keys([], 16) == []


@pytest.mark.parametrize("bs", [0, -1])
def test_block_size_must_be_positive(bs: int) -> None:
    with pytest.raises(ValueError):
        keys([1], bs)


def test_refuses_2d_tokens() -> None:
    with pytest.raises(ValueError):
        chunk_keys(np.zeros((2, 2), dtype=np.int64), 2)


def test_32k_tokens_in_blocks_of_16_are_fast() -> None:
    tokens = np.random.default_rng(0).integers(0, 150_000, 32_768)
    best = min(_timed(lambda: chunk_keys(tokens, 16)) for _ in range(3))
    assert best < 0.05  # measured ~2 ms on one core; generous for loaded CI machines


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start
