"""ems.copy: the batched memcpy primitive, C extension and ctypes fallback."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems import copy as ems_copy

needs_c = pytest.mark.skipif(ems_copy.COPY_IMPL != "c", reason="ems._memcopy is not built")


@st.composite
def batches(draw: st.DrawFn) -> tuple[bytes, list[int], list[int], list[int], int]:
    """A source buffer and segments whose destinations never overlap (sources may)."""
    size = draw(st.integers(1, 5000))  # long enough for the streaming-store path (>= 1 KiB)
    src = np.random.default_rng(draw(st.integers(0, 2**32))).bytes(size)
    lengths = draw(st.lists(st.integers(0, len(src)), max_size=12))
    src_off = [draw(st.integers(0, len(src) - n)) for n in lengths]
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(lengths), max_size=len(lengths)))
    dst_off, at = [], 0
    for n, gap in zip(lengths, gaps, strict=True):
        dst_off.append(at + gap)
        at += gap + n
    order = draw(st.permutations(range(len(lengths))))
    pick = [lengths[i] for i in order], [src_off[i] for i in order], [dst_off[i] for i in order]
    return src, pick[0], pick[1], pick[2], at + 3


def expected_dst(src: bytes, lengths: list[int], src_off: list[int], dst_off: list[int],
                 size: int) -> bytes:  # fmt: skip
    out = bytearray(b"\xee" * size)
    for n, s, d in zip(lengths, src_off, dst_off, strict=True):
        out[d : d + n] = src[s : s + n]
    return bytes(out)


def run(impl: str, batch: tuple, threads: int = 0, nontemporal: int = -1) -> bytes:
    src_bytes, lengths, src_off, dst_off, size = batch
    src = np.frombuffer(src_bytes, dtype=np.uint8).copy()
    dst = np.full(size, 0xEE, dtype=np.uint8)
    d = np.array(dst_off, dtype=np.int64) + dst.ctypes.data
    s = np.array(src_off, dtype=np.int64) + src.ctypes.data
    n = np.array(lengths, dtype=np.uint64)
    if impl == "c":
        ems_copy.copy_segments_c(d.astype(np.uint64), s, n, threads, nontemporal)
    else:
        ems_copy.copy_segments_ctypes(d, s, n)
    return dst.tobytes()


@given(batches())
def test_ctypes_fallback_copies_every_segment(batch: tuple) -> None:
    assert run("ctypes", batch) == expected_dst(*batch)


@needs_c
@given(batches(), st.integers(0, 8), st.sampled_from([-1, 0, 1]))
@settings(max_examples=200)
def test_c_extension_matches_the_reference_for_any_split_and_store_kind(
    batch: tuple, threads: int, nontemporal: int
) -> None:
    assert run("c", batch, threads, nontemporal) == expected_dst(*batch) == run("ctypes", batch)


@needs_c
def test_c_extension_splits_a_big_batch_and_one_huge_segment_exactly() -> None:
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, size=9 << 20, dtype=np.uint8)
    for lengths in ([9 << 20], [3, 0, (6 << 20) + 5, 0, (3 << 20) - 8, 0]):
        dst = np.zeros_like(src)
        n = np.array(lengths, dtype=np.uint64)
        off = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.uint64)
        for threads, nontemporal in ((0, -1), (2, 0), (3, 1), (1, 1)):
            dst[:] = 0
            d, s = dst.ctypes.data + off, src.ctypes.data + off
            ems_copy.copy_segments_c(d, s, n, threads, nontemporal)
            assert np.array_equal(dst, src)


def test_copy_segments_uses_the_extension_when_built() -> None:
    assert ems_copy.COPY_IMPL in ("c", "ctypes")
    assert (ems_copy._memcopy is not None) == (ems_copy.COPY_IMPL == "c")


def test_copy_segments_falls_back_to_ctypes_without_the_extension(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ems_copy, "_memcopy", None)
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    ems_copy.copy_segments(np.array([dst.ctypes.data + 4]), np.array([src.ctypes.data]), [4])
    assert dst[4:8].tolist() == [0, 1, 2, 3] and dst.sum() == 6


def test_empty_batch_is_a_no_op() -> None:
    empty = np.zeros(0, dtype=np.uint64)
    ems_copy.copy_segments(empty, empty, empty)
    ems_copy.copy_segments_ctypes(empty, empty, empty)


@pytest.mark.parametrize("impl", ["c", "ctypes"])
@pytest.mark.parametrize(
    ("dst", "src", "lengths", "error", "text"),
    [
        ([1, 2], [1], [0], ValueError, "equal length"),
        ([[1]], [1], [0], ValueError, "1-dimensional"),
        ([1.5], [1], [0], TypeError, "integers"),
        ([8], [8], [-1], ValueError, "negative"),
        ([0], [8], [4], ValueError, "null address"),
    ],
)
def test_malformed_batches_are_rejected_before_copying(
    impl: str, dst: list, src: list, lengths: list, error: type, text: str
) -> None:
    if impl == "c" and ems_copy.COPY_IMPL != "c":
        pytest.skip("ems._memcopy is not built")
    fn = ems_copy.copy_segments_c if impl == "c" else ems_copy.copy_segments_ctypes
    with pytest.raises(error, match=text):
        fn(np.array(dst), np.array(src), np.array(lengths))


@needs_c
def test_extension_validates_raw_buffers_itself() -> None:
    from ems import _memcopy

    ok = np.zeros(1, dtype=np.uint64)
    with pytest.raises(TypeError, match="8-byte integers"):
        _memcopy.copy_segments(np.zeros(1, dtype=np.int32), ok, ok)
    with pytest.raises(TypeError, match="dst"):
        _memcopy.copy_segments(b"12345678", ok, ok)
    with pytest.raises(TypeError, match="buffer"):
        _memcopy.copy_segments(ok, object(), ok)
    with pytest.raises(ValueError, match="equal length"):
        _memcopy.copy_segments(ok, ok, np.zeros(2, dtype=np.uint64))
    with pytest.raises(ValueError, match="negative"):
        _memcopy.copy_segments(ok, ok, np.array([-5], dtype=np.int64))
    with pytest.raises(ValueError, match="nontemporal"):
        _memcopy.copy_segments(ok, ok, ok, nontemporal=2)
    with pytest.raises(ValueError, match="threads"):
        _memcopy.copy_segments(ok, ok, ok, threads=_memcopy.max_threads() + 1)
    with pytest.raises(TypeError, match="C-contiguous"):
        _memcopy.copy_segments(np.zeros(4, dtype=np.uint64)[::2], ok, ok)


@needs_c
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_big_batch_taken_in_pieces_by_several_threads_copies_every_byte(seed: int) -> None:
    """Several MiB in segments of odd sizes: cut into ~1 MiB pieces (some cutting a segment,
    some several segments) that the threads take in turn."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700_000, size=40).astype(np.uint64)
    lengths[::7] = 0
    total = int(lengths.sum())
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    perm = rng.permutation(lengths.size)  # destinations in another order, with 3-byte gaps
    dst = np.zeros(total + 3 * lengths.size, dtype=np.uint8)
    dst_starts = np.empty(lengths.size, dtype=np.int64)
    dst_starts[perm] = np.concatenate([[0], np.cumsum(lengths[perm] + 3)[:-1]])
    for threads, nontemporal in ((2, 1), (3, 0), (8, -1)):
        dst[:] = 0
        ems_copy.copy_segments_c((dst.ctypes.data + dst_starts).astype(np.uint64),
                                 (src.ctypes.data + starts).astype(np.uint64), lengths, threads, nontemporal)
        for i in range(lengths.size):
            a, b, n = int(dst_starts[i]), int(starts[i]), int(lengths[i])
            assert np.array_equal(dst[a : a + n], src[b : b + n])
        assert int(dst.astype(np.int64).sum()) == int(src.astype(np.int64).sum())
