"""Canonical keys: exact, injective, and wire round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from emsd.pool.keys import INT_TAG, KT_INT, KT_TAGGED, KeyBatch, KeyError_

int_keys = st.integers(-(2**63), 2**64 - 1)
byte_keys = st.binary(max_size=32)
keys = st.lists(st.one_of(int_keys, byte_keys), max_size=40)


def canon(k: int | bytes) -> int | bytes:
    return k % 2**64 if isinstance(k, int) else k


@given(keys)
def test_wire_round_trip_preserves_every_key(ks: list) -> None:
    batch = KeyBatch.from_user(ks)
    kt, raw = batch.to_wire()
    back = KeyBatch.from_wire(kt, raw, len(ks))
    assert [back.key(i) for i in range(len(ks))] == [canon(k) for k in ks]
    assert kt == (KT_INT if all(isinstance(k, int) for k in ks) else KT_TAGGED)


@given(st.one_of(int_keys, byte_keys), st.one_of(int_keys, byte_keys))
def test_distinct_keys_have_distinct_canonical_forms(a: int | bytes, b: int | bytes) -> None:
    ba, bb = KeyBatch.from_user([a]), KeyBatch.from_user([b])
    same = np.array_equal(ba.words, bb.words) and np.array_equal(ba.tags, bb.tags)
    assert same == (type(a) is type(b) and canon(a) == canon(b))


def test_int_and_bytes_that_look_alike_differ() -> None:
    b = KeyBatch.from_user([5, b"\x05", b"\x05\x00"])
    assert list(b.tags) == [INT_TAG, 1, 2]


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1, b"x" * 33, 1.0, "s", None])
def test_bad_keys_are_refused_with_their_index(bad: object) -> None:
    with pytest.raises(KeyError_, match=r"hashes\[1\]"):
        KeyBatch.from_user([1, bad])  # type: ignore[list-item]


def test_wire_decoding_checks_sizes_tags_and_padding() -> None:
    with pytest.raises(KeyError_):
        KeyBatch.from_wire(KT_INT, b"\x00" * 7, 1)
    with pytest.raises(KeyError_):
        KeyBatch.from_wire(KT_TAGGED, bytes([33]) + b"\x00" * 32, 1)
    with pytest.raises(KeyError_):
        KeyBatch.from_wire(KT_TAGGED, bytes([1]) + b"ab" + b"\x00" * 30, 1)
    with pytest.raises(KeyError_):
        KeyBatch.from_wire(7, b"", 0)


@given(keys, st.data())
def test_take_selects_the_keys_asked_for_in_every_form(ks: list, data: st.DataObject) -> None:
    batch = KeyBatch.from_user(ks)
    n = len(ks)
    picks = data.draw(st.lists(st.integers(0, n - 1), max_size=5)) if n else []
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    start, stop = data.draw(st.integers(0, n)), data.draw(st.integers(0, n))
    selections: list[tuple[object, list[int]]] = [
        (np.array(picks, dtype=np.int64), picks),
        (np.array(mask, dtype=bool), [i for i in range(n) if mask[i]]),
        (slice(start, stop), list(range(n))[start:stop]),
        (slice(None), list(range(n))),
    ]
    for idx, want in selections:
        got = batch.take(idx)  # type: ignore[arg-type]
        assert [got.key(i) for i in range(len(got))] == [canon(ks[i]) for i in want]
        assert got.to_wire() == KeyBatch.from_user([ks[i] for i in want]).to_wire()


def test_take_of_every_key_keeps_the_batch_and_its_wire_bytes() -> None:
    one = KeyBatch.from_ints(np.array([7], dtype=np.uint64), wire=np.array([7], "<u8").tobytes())
    assert one.take(slice(0, None)) is one and one.take(np.array([0])) is one
    assert one.take(np.array([False])) is not one and len(one.take(np.array([False]))) == 0
    assert len(one.take(slice(1, None))) == 0
    many = KeyBatch.from_user([1, 2, 3])
    assert many.take(slice(None)) is many and many.take(np.arange(3)) is not many
