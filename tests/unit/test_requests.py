"""Argument normalisation for save/load/exists: hash and token semantics, errors, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from ems.common.exception import EmsErrorCode, EmsException
from ems.requests import (
    MAX_BATCH_KEYS,
    BatchRequest,
    as_int_array,
    exists_keys,
    hash_request,
    request_part,
    slots_within,
    token_request,
)
from ems.tokens import chunk_keys
from emsd.pool.keys import KeyBatch


def invalid_message(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(EmsException) as info:
        fn(*args, **kw)  # type: ignore[operator]
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    return info.value.message()


def user_keys(req: BatchRequest) -> list[int | bytes]:
    return [req.keys.key(i) for i in range(len(req.keys))]


# -- hash semantics -----------------------------------------------------------------------


def test_hash_request_from_lists() -> None:
    req = hash_request([10, 11, 12, 20, 21], [-1, 2**64 - 2], [3, 2])
    assert user_keys(req) == [2**64 - 1, 2**64 - 2]  # signed hashes wrap to unsigned
    assert req.slots.dtype == np.int64 and req.slots.tolist() == [10, 11, 12, 20, 21]
    assert req.counts.dtype == np.int64 and req.counts.tolist() == [3, 2]
    assert req.skip is None and req.total == 2


def test_hash_request_from_numpy_and_torch() -> None:
    expected = hash_request([0, 1, 2, 3], [5, 6], [2, 2])
    for slots, hashes, offsets in [
        (np.arange(4, dtype=np.int32), np.array([5, 6]), np.array([2, 2], dtype=np.uint8)),
        (torch.arange(4), (5, 6), torch.tensor([2, 2], dtype=torch.int32)),
        (torch.arange(4, dtype=torch.int64), torch.tensor([5, 6]), [2, 2]),
    ]:
        req = hash_request(slots, hashes, offsets)
        assert req.slots.tolist() == expected.slots.tolist()
        assert req.counts.tolist() == expected.counts.tolist()
        assert user_keys(req) == user_keys(expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_hash_request_from_cuda_tensors() -> None:
    req = hash_request(torch.arange(4, device="cuda"), [1], torch.tensor([4], device="cuda"))
    assert req.slots.tolist() == [0, 1, 2, 3]


def test_hash_request_bytes_keys() -> None:
    digest = bytes(range(32))
    req = hash_request([0, 1], [digest, b"ab"], [1, 1])
    assert user_keys(req) == [digest, b"ab"]


def test_request_owns_read_only_copies() -> None:
    slots = np.arange(4)
    tensor = torch.arange(4)
    listed = [0, 1, 2, 3]
    reqs = [hash_request(s, [1], [4]) for s in (slots, tensor, listed)]
    slots[0], tensor[0], listed[0] = 99, 99, 99
    for req in reqs:
        assert req.slots.tolist() == [0, 1, 2, 3]
        assert not req.slots.flags.writeable and not req.counts.flags.writeable


def test_empty_hash_request_is_valid() -> None:
    req = hash_request([], [], [])
    assert (req.total, len(req.keys), req.slots.size, req.counts.size) == (0, 0, 0, 0)


def test_hashes_and_offsets_lengths_must_match() -> None:
    msg = invalid_message(hash_request, [0, 1], [1, 2], [2])
    assert "len(hashes)" in msg and "len(offsets)" in msg


def test_offsets_must_sum_to_slot_mapping_length() -> None:
    assert "sum(offsets)" in invalid_message(hash_request, [0, 1, 2], [1, 2], [1, 1])
    assert "sum(offsets)" in invalid_message(hash_request, [0, 1], [1], [2**62])
    assert "sum(offsets)" in invalid_message(hash_request, [0, 1], [], [])


@pytest.mark.parametrize("bad", [[0, 2], [-1, 3]])
def test_offsets_must_be_positive(bad: list[int]) -> None:
    assert "offsets[0]" in invalid_message(hash_request, [0, 1], [1, 2], bad)


def test_negative_slot_is_refused_and_named() -> None:
    assert "slot_mapping[1] = -1" in invalid_message(hash_request, [0, -1], [1], [2])


@pytest.mark.parametrize(("bad", "needle"), [
    ([0.0, 1.0], "slot_mapping[0] is a float"),
    ([0, 2**63], "slot_mapping[1] = 9223372036854775808 is outside the int64 range"),
    (np.array([0.0, 1.0]), "slot_mapping must hold integers"),
    (np.array([True, False]), "slot_mapping must hold integers"),
    (np.array([2**63, 0], dtype=np.uint64), "int64 range"),
    (np.zeros((1, 2), dtype=np.int64), "slot_mapping must be 1-D"),
    (torch.zeros(2), "slot_mapping must hold integers"),
    ("01", "slot_mapping must be a 1-D sequence"),
    (5, "slot_mapping must be 1-D"),
])
def test_slot_mapping_must_be_1d_integers(bad: object, needle: str) -> None:
    assert needle in invalid_message(hash_request, bad, [1], [2])


@pytest.mark.parametrize(("bad", "needle"), [
    ([1.5], "hashes[0] is a float"),
    ([b"x" * 33], "hashes[0] has 33 bytes"),
    ([2**64], "hashes[0]"),
    ({1: 2}, "hashes must be a list, tuple or array"),
    ("ab", "hashes must be a list, tuple or array"),
    (np.zeros((1, 1), dtype=np.int64), "hashes must be 1-D"),
])
def test_bad_hashes_are_named(bad: object, needle: str) -> None:
    assert needle in invalid_message(hash_request, [0], bad, [1])


def test_batch_limit() -> None:
    n = MAX_BATCH_KEYS + 1
    assert str(MAX_BATCH_KEYS) in invalid_message(
        hash_request, np.arange(n), np.arange(n), np.ones(n, dtype=np.int64))
    assert len(exists_keys(np.arange(MAX_BATCH_KEYS))) == MAX_BATCH_KEYS


def test_exists_keys() -> None:
    batch = exists_keys([1, -1, b"k"])
    assert isinstance(batch, KeyBatch) and len(batch) == 3
    assert [batch.key(i) for i in range(3)] == [1, 2**64 - 1, b"k"]
    assert len(exists_keys([])) == 0
    assert len(exists_keys(torch.tensor([1, 2]))) == 2
    assert "hashes" in invalid_message(exists_keys, None)


def test_as_int_array_allows_bool_only_when_asked() -> None:
    assert as_int_array(torch.tensor([False, True]), "mask", allow_bool=True).tolist() == [0, 1]
    assert "mask must hold integers" in invalid_message(as_int_array, np.array([True]), "mask")


# -- token semantics ----------------------------------------------------------------------

TOKENS = list(range(100, 110))  # 10 tokens: chunks of 4 are [0,4) [4,8) [8,10)
SLOTS = list(range(40, 50))


def test_token_request_without_mask_covers_every_chunk() -> None:
    req = token_request(SLOTS, TOKENS, [1] * 10, 4, for_save=True)
    assert user_keys(req) == chunk_keys(np.array(TOKENS), 4)
    assert req.counts.tolist() == [4, 4, 2]
    assert req.slots.tolist() == SLOTS
    assert req.total == 3 and req.skip is None
    assert user_keys(token_request(SLOTS, TOKENS, None, 4, True)) == user_keys(req)


def test_token_request_skips_chunks_fully_inside_the_masked_prefix() -> None:
    mask = [0] * 8 + [1] * 2
    for for_save in (True, False):
        req = token_request(SLOTS, TOKENS, mask, 4, for_save)
        assert req.total == 1 and req.counts.tolist() == [2]
        assert req.slots.tolist() == SLOTS[8:]
        assert user_keys(req) == chunk_keys(np.array(TOKENS), 4)[2:]
        assert req.skip is None


def test_token_request_names_the_chunk_before_a_masked_prefix_as_prev() -> None:
    keys = chunk_keys(np.array(TOKENS), 4)
    req = token_request(SLOTS, TOKENS, [0] * 8 + [1] * 2, 4, for_save=True)
    assert req.prev is not None and req.prev.key(0) == keys[1] and len(req.prev) == 1
    assert token_request(SLOTS, TOKENS, [1] * 10, 4, for_save=True).prev is None
    assert token_request(SLOTS, TOKENS, [0] * 10, 4, for_save=True).prev is None  # nothing to send
    assert hash_request([0, 1], [5], [2]).prev is None


def test_straddling_chunk_is_saved_whole() -> None:
    req = token_request(SLOTS, TOKENS, [0] * 6 + [1] * 4, 4, for_save=True)
    assert req.total == 2 and req.counts.tolist() == [4, 2]
    assert req.slots.tolist() == SLOTS[4:]
    assert req.skip is None


def test_straddling_chunk_on_load_skips_its_masked_positions() -> None:
    req = token_request(SLOTS, TOKENS, [0] * 6 + [1] * 4, 4, for_save=False)
    assert req.total == 2 and req.counts.tolist() == [4, 2]
    assert req.slots.tolist() == SLOTS[4:]
    assert req.skip is not None and req.skip.tolist() == [2, 0]


def test_all_masked_is_an_empty_request() -> None:
    req = token_request(SLOTS, TOKENS, [0] * 10, 4, for_save=False)
    assert (req.total, len(req.keys), req.slots.size) == (0, 0, 0)


def test_empty_tokens_are_an_empty_request() -> None:
    assert token_request([], [], [], 16, True).total == 0


def test_slots_of_skipped_chunks_are_not_checked() -> None:
    slots = [-1] * 4 + SLOTS[4:]
    assert token_request(slots, TOKENS, [0] * 5 + [1] * 5, 4, False).total == 2
    assert "slot_mapping[3] = -1" in invalid_message(
        token_request, [0, 1, 2, -1] + SLOTS[4:], TOKENS, [0] * 3 + [1] * 7, 4, False)


def test_token_request_accepts_tensors_and_bool_mask() -> None:
    req = token_request(torch.tensor(SLOTS), torch.tensor(TOKENS),
                        torch.tensor([False] * 6 + [True] * 4), 4, False)
    assert req.skip is not None and req.skip.tolist() == [2, 0]


@pytest.mark.parametrize(("mask", "needle"), [
    ([1] * 5 + [0] * 5, "zeros followed by ones"),
    ([0, 1, 0] + [1] * 7, "zeros followed by ones"),
    ([2] * 10, "only 0 and 1"),
    ([-1] * 10, "only 0 and 1"),
    ([0.0] * 10, "mask[0] is a float"),
    ([1] * 9, "len(mask) = 9"),
])
def test_bad_mask(mask: list[object], needle: str) -> None:
    assert needle in invalid_message(token_request, SLOTS, TOKENS, mask, 4, True)


def test_token_lengths_must_match() -> None:
    assert "len(slot_mapping) = 9" in invalid_message(token_request, SLOTS[:9], TOKENS, None, 4,
                                                      True)


@pytest.mark.parametrize("bs", [0, -4, 4.0, True])
def test_block_size_must_be_positive_int(bs: object) -> None:
    assert "block_size" in invalid_message(token_request, SLOTS, TOKENS, None, bs, True)


def test_token_batch_limit() -> None:
    n = MAX_BATCH_KEYS + 1
    assert "token_ids" in invalid_message(token_request, np.arange(n), np.arange(n), None, 1, True)


@given(st.integers(0, 40), st.integers(1, 8), st.data(), st.booleans())
def test_token_request_model(n: int, bs: int, data: st.DataObject, for_save: bool) -> None:
    """Against the spec: keys, slots, counts, skip and total for any mask boundary."""
    n0 = data.draw(st.integers(0, n))
    tokens = np.arange(n) * 7
    slots = np.arange(n) + 1000
    req = token_request(slots, tokens, [0] * n0 + [1] * (n - n0), bs, for_save)
    included = [c for c in range(-(-n // bs)) if min((c + 1) * bs, n) > n0]
    assert req.total == len(included) == len(req.keys)
    assert user_keys(req) == [chunk_keys(tokens, bs)[c] for c in included]
    assert req.counts.tolist() == [min((c + 1) * bs, n) - c * bs for c in included]
    assert int(req.counts.sum()) == req.slots.size
    assert req.slots.tolist() == (slots[included[0] * bs:].tolist() if included else [])
    skips = [max(0, n0 - c * bs) for c in included]
    if for_save or not any(skips):
        assert req.skip is None
    else:
        assert req.skip is not None and req.skip.tolist() == skips


# -- speed --------------------------------------------------------------------------------


def best_of(fn: object, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def test_hash_request_is_fast_for_a_forward_step() -> None:
    n, bs = 8192, 16
    slots = list(range(n))
    hashes = [hash((i, i)) for i in range(n // bs)]
    offsets = [bs] * (n // bs)
    # measured ~0.3 ms from lists, ~0.12 ms from a tensor; bounds generous for busy CI
    assert best_of(lambda: hash_request(slots, hashes, offsets)) < 0.01
    assert best_of(lambda: hash_request(torch.arange(n), hashes, offsets)) < 0.01


def test_token_request_is_fast_for_a_forward_step() -> None:
    n = 8192
    tokens = list(range(n))
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    # measured ~1 ms (mostly hashing 512 chunks); bound generous for busy CI
    assert best_of(lambda: token_request(list(range(n)), tokens, mask, 16, False)) < 0.03


@given(h=st.integers(-(1 << 63), (1 << 64) - 1), c=st.integers(1, 4), first=st.integers(0, 100))
def test_a_one_block_request_is_the_same_through_the_scalar_path(h: int, c: int, first: int) -> None:
    """Lists of one int hash and one offset take a scalar path (``_one_int_key``); tuples
    take the general one: the requests are equal."""
    slots = list(range(first, first + c))
    fast, slow = hash_request(slots, [h], [c]), hash_request(tuple(slots), (h,), (c,))
    assert fast.keys.to_wire() == slow.keys.to_wire()
    assert fast.keys.words.tolist() == slow.keys.words.tolist()
    assert fast.keys.tags.tolist() == slow.keys.tags.tolist()
    assert fast.slots.tolist() == slow.slots.tolist() and fast.counts.tolist() == slow.counts.tolist()
    assert (fast.total, fast.skip, fast.prev) == (slow.total, slow.skip, slow.prev)
    assert not fast.slots.flags.writeable and not fast.counts.flags.writeable
    assert not fast.keys.tags.flags.writeable  # shared by one-block requests: never written


@given(slots=st.lists(st.one_of(st.integers(-3, 20), st.integers(-3, 20).map(np.int64)), max_size=6))
@example(slots=[16])
@example(slots=[0, 15])
@example(slots=[-1, 3])
@example(slots=[])
def test_slots_within_is_never_wrong_and_says_yes_for_ints_in_range(slots: list) -> None:
    inside = bool(slots) and all(0 <= int(s) < 16 for s in slots)
    if slots_within(slots, 16):
        assert inside
    if inside and all(type(s) is int for s in slots):
        assert slots_within(slots, 16)
    assert not slots_within(tuple(slots), 16) and not slots_within(np.array(slots, dtype=np.int64), 16)
    assert not slots_within(list(range(65)), 100)  # a long list: the array check is cheaper


@pytest.mark.parametrize("args", [([-1], [5], [1]), ([0], [1 << 64], [1]), ([0, 1], [5], [1]),
                                  ([0], [5], [0]), ([0.0], [5], [1]), ([0], [5.0], [1])])
def test_a_bad_one_block_request_is_refused_as_before(args: tuple) -> None:
    with pytest.raises(EmsException) as err:
        hash_request(*args)
    assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT


# -- a load in parts ------------------------------------------------------------------------


@given(st.lists(st.integers(1, 5), min_size=1, max_size=40), st.integers(0, 12), st.booleans())
def test_request_parts_cover_a_request_in_order_each_as_large_as_fits(
        counts: list[int], most: int, skipped: bool) -> None:
    req = hash_request(list(range(100, 100 + sum(counts))), list(range(7, 7 + len(counts))), counts)
    if skipped:
        req = BatchRequest(req.keys, req.slots, req.counts, req.counts // 2, req.total)
    sizes = req.counts.astype(np.uint64) * 2  # bytes: 2 a slot
    if most == 0 or int(sizes.sum()) <= most:
        assert request_part(req, sizes, 0, most) is req  # all of it: the call itself
    parts, start = [], 0
    while start < len(counts):  # as a load that finds every block takes them
        part = request_part(req, sizes, start, most)
        n = len(part.keys)
        assert n >= 1
        assert most == 0 or int(sizes[start:start + n].sum()) <= most or n == 1  # over: one block alone
        if most and start + n < len(counts):  # as many as fit
            assert int(sizes[start:start + n + 1].sum()) > most
        if start == 0:
            assert part.prev is None
        else:  # the part continues the chain of the key before it
            assert part.prev is not None and part.prev.key(0) == req.keys.key(start - 1)
        assert part.total == req.total
        parts.append(part)
        start += n
    assert user_keys(req) == [k for part in parts for k in user_keys(part)]
    assert np.array_equal(np.concatenate([part.slots for part in parts]), req.slots)
    assert np.array_equal(np.concatenate([part.counts for part in parts]), req.counts)
    if skipped:
        assert np.array_equal(np.concatenate([part.skip for part in parts]), req.skip)  # type: ignore[misc]
    mid = request_part(req, sizes, len(counts) - 1, most)  # any start: from that key on
    assert user_keys(mid) == [req.keys.key(len(counts) - 1)]
