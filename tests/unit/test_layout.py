"""ems.layout: registration checks, the pool block layout contract, save/load round trips."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ems import copy as ems_copy
from ems.buffer import KvBufferWrapper
from ems.common.exception import EmsErrorCode, EmsException
from ems.layout import KvLayout, TensorInfo, copy_torch_segments, torch_byte_view

ROOT = Path(__file__).resolve().parents[2]
SENTINEL = 0xAB

# ---------------------------------------------------------------------------
# Tensors of every supported kind, with an independent way to read a slot's row
# ---------------------------------------------------------------------------


@dataclass
class Handle:
    """A registered element plus reference accessors that do not use ems.layout."""

    obj: Any
    row: Callable[[int, int], bytes]  # (block, position) -> the slot's row bytes
    fill: Callable[[np.random.Generator], None]
    zero: Callable[[], None]
    outside: Callable[[], bytes]  # bytes of the parent buffer that are not the tensor's slots


def _np_handle(parent: np.ndarray, x: np.ndarray, outside: Callable[[], bytes]) -> Handle:
    def row(b: int, o: int) -> bytes:
        return np.ascontiguousarray(x[b : b + 1, o : o + 1]).tobytes()

    def fill(rng: np.random.Generator) -> None:
        x[...] = rng.integers(-100, 100, size=x.shape).astype(x.dtype)

    def zero() -> None:
        x[...] = 0

    return Handle(x, row, fill, zero, outside)


def make_numpy(kind: str, nb: int, bs: int, inner: tuple, dtype: str) -> Handle:
    shape = (nb, bs, *inner)
    if kind == "np":
        x = np.zeros(shape, dtype=dtype)
        return _np_handle(x, x, lambda: b"")
    if kind == "np_interleaved":  # K/V sliced out of [num_blocks, 2, block_size, ...]
        parent = np.full((nb, 2, bs, *inner), 7, dtype=dtype)
        return _np_handle(parent, parent[:, 1], lambda: parent[:, 0].tobytes())
    if kind == "np_strided_pos":  # every other position: stride1 = 2 rows
        parent = np.full((nb, 2 * bs, *inner), 7, dtype=dtype)
        return _np_handle(parent, parent[:, ::2], lambda: parent[:, 1::2].tobytes())
    if kind == "np_reversed":  # negative stride0
        parent = np.zeros(shape, dtype=dtype)
        return _np_handle(parent, parent[::-1], lambda: b"")
    if kind == "np_blocks_inner":  # stored [block_size, num_blocks, ...], viewed transposed
        parent = np.zeros((bs, nb, *inner), dtype=dtype)
        axes = (1, 0, *range(2, parent.ndim))
        return _np_handle(parent, parent.transpose(axes), lambda: b"")
    raise AssertionError(kind)


def make_torch(kind: str, nb: int, bs: int, inner: tuple, dtype: str) -> Handle:
    import torch

    tdtype = getattr(torch, dtype)
    if kind == "torch":
        x = torch.zeros(nb, bs, *inner, dtype=tdtype)
        parent_other: Callable[[], bytes] = lambda: b""  # noqa: E731
    else:  # "torch_interleaved": K/V of one [num_blocks, 2, block_size, ...] tensor
        parent = torch.full((nb, 2, bs, *inner), 7, dtype=tdtype)
        x = parent[:, 1]
        parent_other = lambda: _torch_bytes(parent[:, 0])  # noqa: E731

    def row(b: int, o: int) -> bytes:
        return _torch_bytes(x[b : b + 1, o : o + 1])

    def fill(rng: np.random.Generator) -> None:
        vals = rng.integers(-100, 100, size=tuple(x.shape))
        x.copy_(torch.from_numpy(vals).to(tdtype))

    return Handle(x, row, fill, lambda: x.zero_(), parent_other)


def _torch_bytes(x: Any) -> bytes:
    import torch

    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_wrapper(nb: int, bs: int, inner: tuple, dtype: str) -> Handle:
    row_bytes = int(np.prod(inner, dtype=np.int64)) * np.dtype(dtype).itemsize
    buf = bytearray(nb * bs * row_bytes)
    w = KvBufferWrapper(buf, num_blocks=nb, block_size=bs)
    view = np.frombuffer(buf, dtype=np.uint8).reshape(nb, bs, row_bytes)

    def fill(rng: np.random.Generator) -> None:
        view[...] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)

    def zero() -> None:
        view[...] = 0

    return Handle(w, lambda b, o: view[b, o].tobytes(), fill, zero, lambda: b"")


NUMPY_KINDS = ["np", "np_interleaved", "np_strided_pos", "np_reversed", "np_blocks_inner"]
TORCH_KINDS = ["torch", "torch_interleaved"]
NUMPY_DTYPES = ["float16", "float32", "int8", "float64"]
TORCH_DTYPES = ["float16", "bfloat16", "float32", "int8"]


def make_handle(kind: str, nb: int, bs: int, inner: tuple, dtype: str) -> Handle:
    if kind == "wrapper":
        return make_wrapper(nb, bs, inner, "int8" if dtype == "bfloat16" else dtype)
    if kind in TORCH_KINDS:
        return make_torch(kind, nb, bs, inner, dtype)
    return make_numpy(kind, nb, bs, inner, "float16" if dtype == "bfloat16" else dtype)


# ---------------------------------------------------------------------------
# Requests and the slow reference of the pool layout contract
# ---------------------------------------------------------------------------


@dataclass
class Request:
    slots: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    skip: np.ndarray
    pool_size: int


def reference_save(handles: list[Handle], bs: int, req: Request, pool: bytearray) -> None:
    """The contract, literally: key j at offsets[j], tensor-major, counts[j] rows each."""
    rows = [len(h.row(0, 0)) for h in handles]
    start = 0
    for j, c in enumerate(req.counts.tolist()):
        prefix = 0
        for h, r in zip(handles, rows, strict=True):
            for p in range(c):
                s = int(req.slots[start + p])
                at = int(req.offsets[j]) + c * prefix + p * r
                pool[at : at + r] = h.row(s // bs, s % bs)
            prefix += r
        start += c


@st.composite
def requests(draw: st.DrawFn, nb: int, bs: int, slot_bytes: int) -> Request:
    num_slots = nb * bs
    mode = draw(st.sampled_from(["random", "blocks", "sequential"]))
    if mode == "random":
        slots = draw(st.permutations(range(num_slots)))[: draw(st.integers(0, num_slots))]
    elif mode == "blocks":
        blocks = draw(st.permutations(range(nb)))[: draw(st.integers(0, nb))]
        slots = [b * bs + o for b in blocks for o in range(bs)]
        slots = slots[: draw(st.integers(max(0, len(slots) - bs + 1), len(slots)))]
    else:
        start = draw(st.integers(0, num_slots - 1))
        slots = list(range(start, draw(st.integers(start, num_slots))))
    n = len(slots)
    if mode == "blocks":
        counts = [bs] * (n // bs) + ([n % bs] if n % bs else [])
    else:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))
        counts = np.diff([0, *cuts, n]).tolist()
    order = draw(st.permutations(range(len(counts))))
    gaps = draw(st.lists(st.integers(0, 9), min_size=len(counts), max_size=len(counts)))
    offsets, at = [0] * len(counts), 0
    for j in order:  # keys placed in a shuffled order with odd gaps: unaligned offsets
        at += gaps[j]
        offsets[j] = at
        at += counts[j] * slot_bytes
    skip = [draw(st.integers(0, c)) for c in counts]
    return Request(
        np.array(slots, dtype=np.int64),
        np.array(counts, dtype=np.int64),
        np.array(offsets, dtype=np.uint64),
        np.array(skip, dtype=np.int64),
        at + 5,
    )


@st.composite
def layouts(draw: st.DrawFn, kinds: list[str]) -> tuple[list[list[Handle]], int, int]:
    nb = draw(st.integers(1, 5))
    bs = draw(st.integers(1, 4))
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        layer = []
        for _ in range(draw(st.integers(1, 2))):
            kind = draw(st.sampled_from(kinds))
            dtypes = TORCH_DTYPES if kind in TORCH_KINDS else NUMPY_DTYPES
            inner = draw(st.sampled_from([(), (2,), (3,), (2, 3), (1, 4)]))
            layer.append(make_handle(kind, nb, bs, inner, draw(st.sampled_from(dtypes))))
        layers.append(layer)
    return layers, nb, bs


def round_trip(layers: list[list[Handle]], nb: int, bs: int, data: st.DataObject) -> None:
    """Save, check pool bytes against the reference; zero, load with skip, check the tensors."""
    handles = [h for layer in layers for h in layer]
    layout = KvLayout.from_kvcache([[h.obj for h in layer] for layer in layers])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for h in handles:
        h.fill(rng)
    outside = [h.outside() for h in handles]
    req = data.draw(requests(nb, bs, layout.slot_bytes))
    before = {(t, s): h.row(s // bs, s % bs) for t, h in enumerate(handles) for s in range(nb * bs)}

    pool = np.full(req.pool_size, SENTINEL, dtype=np.uint8)
    expected = bytearray(pool.tobytes())
    reference_save(handles, bs, req, expected)
    layout.save(pool.ctypes.data, req.slots, req.counts, req.offsets, pool_size=req.pool_size)
    assert pool.tobytes() == bytes(expected)

    for h in handles:
        h.zero()
    layout.load(pool.ctypes.data, req.slots, req.counts, req.offsets, req.skip)
    key = np.repeat(np.arange(len(req.counts)), req.counts)
    pos = np.arange(len(req.slots)) - (np.cumsum(req.counts) - req.counts)[key]
    loaded = set(req.slots[pos >= req.skip[key]].tolist())
    for t, h in enumerate(handles):
        for s in range(nb * bs):
            want = before[(t, s)] if s in loaded else bytes(len(before[(t, s)]))
            assert h.row(s // bs, s % bs) == want, (t, s)
        assert h.outside() == outside[t]


@given(layouts(NUMPY_KINDS + ["wrapper"]), st.data())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_numpy_and_buffer_layouts_round_trip_through_the_pool(layout: tuple, data: Any) -> None:
    round_trip(*layout, data)


@given(layouts(TORCH_KINDS + ["np", "wrapper"]), st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_torch_layouts_round_trip_through_the_pool(layout: tuple, data: Any) -> None:
    pytest.importorskip("torch")
    round_trip(*layout, data)


@pytest.mark.skipif(ems_copy.COPY_IMPL != "c", reason="ems._memcopy is not built")
@given(layouts(NUMPY_KINDS), st.data())
@settings(max_examples=40, deadline=None)
def test_c_extension_and_ctypes_fallback_fill_the_pool_identically(layout: tuple, data: Any) -> None:
    layers, nb, bs = layout
    kv = KvLayout.from_kvcache([[h.obj for h in layer] for layer in layers])
    rng = np.random.default_rng(0)
    for layer in layers:
        for h in layer:
            h.fill(rng)
    req = data.draw(requests(nb, bs, kv.slot_bytes))
    pools = []
    for memcopy in (ems_copy._memcopy, None):
        pool = np.zeros(req.pool_size, dtype=np.uint8)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ems_copy, "_memcopy", memcopy)
            kv.save(pool.ctypes.data, req.slots, req.counts, req.offsets)
        pools.append(pool)
    assert np.array_equal(pools[0], pools[1])


# ---------------------------------------------------------------------------
# Specific behaviours
# ---------------------------------------------------------------------------


def kv_numpy(layers: int = 2, nb: int = 4, bs: int = 4, inner: tuple = (3,)) -> list:
    return [[np.zeros((nb, bs, *inner), np.float16) for _ in range(2)] for _ in range(layers)]


def test_whole_blocks_become_one_segment_per_key_and_tensor() -> None:
    layout = KvLayout.from_kvcache(kv_numpy(layers=3, nb=8, bs=4))
    slots = np.concatenate([np.arange(4) + 4 * b for b in (1, 2, 5)])  # blocks 1 and 2 adjacent
    segs = layout.segments(0x1000, slots, [4, 4, 4], [0, 1000, 2000])
    assert len(segs.length) == 3 * 6  # runs never cross keys, even when slots are adjacent
    assert set(segs.length.tolist()) == {4 * 6}


def test_load_skip_leaves_the_leading_positions_untouched() -> None:
    kv = kv_numpy(layers=1, nb=2, bs=4, inner=())
    kv[0][0][:] = np.arange(8, dtype=np.float16).reshape(2, 4)
    kv[0][1][:] = -np.arange(8, dtype=np.float16).reshape(2, 4)
    layout = KvLayout.from_kvcache(kv)
    pool = np.zeros(64, np.uint8)
    slots = np.arange(8)
    layout.save(pool.ctypes.data, slots, [4, 4], [0, 32])
    for t in kv[0]:
        t[:] = 100
    layout.load(pool.ctypes.data, slots, [4, 4], [0, 32], skip=[3, 0])
    assert kv[0][0].ravel().tolist() == [100, 100, 100, 3, 4, 5, 6, 7]
    assert kv[0][1].ravel().tolist() == [100, 100, 100, -3, -4, -5, -6, -7]


def _mixed_layout() -> KvLayout:
    """Two geometry groups (dense and K/V interleaved), so segments are not key-major overall."""
    dense = [np.zeros((8, 4, 3), np.float16) for _ in range(2)]
    parent = np.zeros((8, 2, 4, 3), np.float16)
    return KvLayout.from_kvcache([dense, [parent[:, 0], parent[:, 1]]])


def _as_set(segs: Any) -> set[tuple[int, int, int, int]]:
    cols = (segs.tensor_addr, segs.pool_addr, segs.length, segs.tensor)
    return set(zip(*(c.tolist() for c in cols), strict=True))


def test_plan_then_place_gives_the_segments_of_the_request() -> None:
    layout = _mixed_layout()
    slots = np.array([4, 5, 6, 7, 13, 12, 20, 21, 22, 23, 24])  # runs broken by order and blocks
    counts, offsets, skip = [4, 2, 5], [0, 4096, 8192], [1, 0, 2]
    plan = layout.plan(slots, counts, skip)
    placed = layout.place(plan, 0x10000, offsets, pool_size=1 << 20)
    want = layout.segments(0x10000, slots, counts, offsets, skip, pool_size=1 << 20)
    assert _as_set(placed) == _as_set(want) and len(placed.length) == len(want.length)


@pytest.mark.parametrize("bs", [1, 4])
def test_whole_block_requests_plan_the_same_segments_as_the_general_path(bs: int, monkeypatch: Any) -> None:
    """Every kind of tensor (rows contiguous or not, blocks reversed or inner) in one layout."""
    kinds = [make_numpy(k, 8, bs, (3,), "float16").obj for k in NUMPY_KINDS]
    layout = KvLayout.from_kvcache([kinds[:2], kinds[2:]])
    blocks = np.array([5, 0, 7, 2])
    slots = (blocks[:, None] * bs + np.arange(bs)).ravel()
    counts = np.full(4, bs)
    fast = layout.plan(slots, counts)
    monkeypatch.setattr(KvLayout, "_whole_blocks", lambda *_: None)
    slow = layout.plan(slots, counts)
    for field in ("tensor_addr", "block_off", "length", "tensor", "key"):
        assert getattr(fast, field).tolist() == getattr(slow, field).tolist(), field


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bs=st.sampled_from([1, 2, 4]), kinds=st.lists(st.sampled_from(NUMPY_KINDS), min_size=1, max_size=4),
       block=st.integers(0, 7), shift=st.sampled_from([0, 0, 0, 1]), at=st.integers(0, 1 << 20))
def test_one_block_plans_and_places_as_the_general_path(bs: int, kinds: list[str], block: int, shift: int,
                                                        at: int) -> None:
    """The one-block fast path (``_plan_one``, ``place`` of one key) gives the general path's
    segments, and declines what is not one whole block in order (``shift``)."""
    layout = KvLayout.from_kvcache([[make_numpy(k, 8, bs, (3,), "float16").obj for k in kinds]])
    slots = block * bs + np.arange(bs) + shift
    counts = np.array([bs])
    if block * bs + bs - 1 + shift >= layout.num_slots:
        return
    fast = layout.plan(slots, counts)
    whole = shift % bs == 0  # the slots are one block, in order
    one = layout.place_one(slots, 0x10000, at, 1 << 21)  # plan and place in one step (the SDK's save)
    if layout._plan_one(slots, counts) is None:  # a layout whose rows are apart, or shifted slots
        assert not whole or layout._one is None
        assert one is None
        return
    assert one is not None and _as_set(one) == _as_set(layout.place(fast, 0x10000, np.array([at]),
                                                                    pool_size=1 << 21))
    assert layout.place_one(slots, 0x10000, (1 << 21) - 1, 1 << 21) is None  # past the pool: declined
    assert whole
    slow = layout._plan_blocks(np.array([int(slots[0]) // bs]), counts)
    for field in ("tensor_addr", "block_off", "length", "tensor", "key"):
        assert getattr(fast, field).tolist() == getattr(slow, field).tolist(), field
    placed = layout.place(fast, 0x10000, np.array([at], dtype=np.uint64), pool_size=1 << 21)
    general = layout.place(slow, 0x10000, [at], np.array([0]), pool_size=1 << 21)
    assert _as_set(placed) == _as_set(general)
    with pytest.raises(EmsException):
        layout.place(fast, 0x10000, np.array([(1 << 21) - 1], dtype=np.uint64), pool_size=1 << 21)


def test_requests_that_are_not_whole_blocks_take_the_general_path() -> None:
    layout = KvLayout.from_kvcache(kv_numpy(layers=1, nb=4, bs=4))
    s = np.arange(16)
    assert layout._whole_blocks(s, np.full(4, 4)) is not None
    assert layout._whole_blocks(s[::-1].copy(), np.full(4, 4)) is None  # positions out of order
    assert layout._whole_blocks(s + 2, np.full(4, 4)) is None  # not from a block's start
    assert layout._whole_blocks(s[:8], np.array([4, 2, 2])) is None  # partial blocks


def test_place_keeps_only_the_keys_given_with_their_offsets() -> None:
    layout = _mixed_layout()
    slots = np.arange(12)
    plan = layout.plan(slots, [4, 4, 4])
    kept = layout.place(plan, 0x10000, [500, 9000], np.array([0, 2]))
    want = layout.segments(0x10000, np.concatenate([slots[:4], slots[8:]]), [4, 4], [500, 9000])
    assert _as_set(kept) == _as_set(want)


def test_place_checks_the_offsets_and_names_the_requests_key() -> None:
    layout = _mixed_layout()
    plan = layout.plan(np.arange(8), [4, 4])
    size = 4 * layout.slot_bytes
    with pytest.raises(EmsException, match="offsets has 1 entries but counts has 2"):
        layout.place(plan, 0x10000, [0])
    with pytest.raises(EmsException, match=r"offsets\[0\] = -1 must be >= 0"):
        layout.place(plan, 0x10000, [-1], np.array([1]))
    with pytest.raises(EmsException, match=r"key 1: pool range \[1, "):
        layout.place(plan, 0x10000, [1], np.array([1]), pool_size=size)
    with pytest.raises(EmsException, match="pool_addr must be a positive address"):
        layout.place(plan, 0, [0, size])


def test_empty_request_copies_nothing() -> None:
    layout = KvLayout.from_kvcache(kv_numpy())
    layout.save(0x1000, [], [], [])
    layout.load(0x1000, [], [0, 0], [0, 0], skip=[0, 0])


def test_layout_records_sizes_and_device() -> None:
    kv = kv_numpy(layers=2, nb=4, bs=8, inner=(2, 5))
    layout = KvLayout.from_kvcache(kv)
    assert (layout.num_blocks, layout.block_size, layout.num_slots) == (4, 8, 32)
    assert layout.slot_bytes == 4 * 2 * 5 * 2
    assert layout.device == "cpu"
    assert layout.block_bytes(np.array([16, 3])).tolist() == [16 * 80, 3 * 80]


def test_signature_names_rows_and_ignores_num_blocks_block_size_and_strides() -> None:
    a = KvLayout.from_kvcache(kv_numpy(layers=2, nb=4, bs=4, inner=(3,)))
    b = KvLayout.from_kvcache(kv_numpy(layers=2, nb=9, bs=16, inner=(3,)))
    parent = np.zeros((5, 2, 4, 3), np.float16)
    c = KvLayout.from_kvcache([[parent[:, 0], parent[:, 1]]] * 2)
    assert a.signature == b.signature == c.signature == "kv1/L2xT2/float16:6,float16:6"
    other = {
        KvLayout.from_kvcache(kv_numpy(layers=3)).signature,
        KvLayout.from_kvcache([[np.zeros((4, 4, 3), np.int16)] * 2] * 2).signature,
        KvLayout.from_kvcache([[np.zeros((4, 4, 6), np.float16)] * 2] * 2).signature,
        KvLayout.from_kvcache([[np.zeros((4, 4, 3), np.float16)]] * 2).signature,
    }
    assert a.signature not in other and len(other) == 4
    mixed = KvLayout.from_kvcache([[np.zeros((4, 4, 3), np.float16)], [np.zeros((4, 4), np.int8)]])
    assert mixed.signature == "kv1/L2/float16:6;int8:1"


def test_buffer_wrapper_registers_as_a_byte_tensor() -> None:
    w = KvBufferWrapper(bytearray(4 * 2 * 6), num_blocks=4, block_size=2)
    layout = KvLayout.from_kvcache([[w]])
    assert (layout.num_blocks, layout.block_size, layout.slot_bytes) == (4, 2, 6)
    assert layout.signature == "kv1/L1xT1/uint8:6"
    addr_w = KvBufferWrapper(w.address, w.length, num_blocks=8, block_size=1)
    assert addr_w.row_bytes == 6 and addr_w.numpy().shape == (8, 1, 6)


def test_buffer_wrapper_rejects_a_length_that_does_not_divide() -> None:
    with pytest.raises(EmsException) as e:
        KvBufferWrapper(bytearray(10), num_blocks=2, block_size=2)
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "multiple of num_blocks * block_size" in e.value.message()


def test_layout_works_without_torch_installed() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from ems.buffer import KvBufferWrapper
        from ems.layout import KvLayout
        k = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
        v = KvBufferWrapper(bytearray(range(2 * 4 * 5)), num_blocks=2, block_size=4)
        layout = KvLayout.from_kvcache([[k, v]])
        pool = np.zeros(4 * layout.slot_bytes, np.uint8)
        layout.save(pool.ctypes.data, np.array([4, 5, 6, 7]), [4], [0])
        k[:] = 0
        v.numpy()[:] = 0
        layout.load(pool.ctypes.data, np.array([4, 5, 6, 7]), [4], [0])
        assert k[1].ravel().tolist() == list(range(12, 24)) and not k[0].any()
        assert v.numpy()[1].ravel().tolist() == list(range(20, 40))
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_torch_segment_copies_match_the_memcpy_path_on_cpu() -> None:
    """The CUDA path's copy loop is device-agnostic; exercise it with CPU tensors."""
    torch = pytest.importorskip("torch")
    parent = torch.arange(3 * 2 * 4 * 5, dtype=torch.float32).reshape(3, 2, 4, 5)
    kv = [[parent[:, 0], parent[:, 1]]]
    layout = KvLayout.from_kvcache(kv)
    slots, counts, offsets = np.array([5, 6, 7, 8, 1]), [4, 1], [0, 200]
    want = np.zeros(300, np.uint8)
    layout.save(want.ctypes.data, slots, counts, offsets)
    pool = torch.zeros(300, dtype=torch.uint8)
    segs = layout.segments(pool.data_ptr(), slots, counts, offsets)
    views = [torch_byte_view(t.ref) for t in layout.tensors]
    bases = np.array([t.base for t in layout.tensors])
    args = (segs.tensor.tolist(), (segs.tensor_addr - bases[segs.tensor]).tolist(),
            (segs.pool_addr - pool.data_ptr()).tolist(), segs.length.tolist())  # fmt: skip
    copy_torch_segments(views, pool, *args, to_pool=True)
    assert np.array_equal(pool.numpy(), want)
    before = parent.clone()
    parent.zero_()
    copy_torch_segments(views, pool, *args, to_pool=False)
    for s in (5, 6, 7, 8, 1):
        assert torch.equal(parent[s // 4, :, s % 4], before[s // 4, :, s % 4])
    assert parent[0, :, 0].eq(0).all()


# ---------------------------------------------------------------------------
# Validation: EMS_INVALID_ARGUMENT naming the field and the rule
# ---------------------------------------------------------------------------


def ro_array() -> np.ndarray:
    x = np.zeros((2, 2, 3), np.float16)
    x.setflags(write=False)
    return x


GOOD = np.zeros((2, 2, 3), np.float16)
BAD_KVCACHE = [
    ([], "kvcache must be a non-empty list"),
    ("kv", "kvcache must be a non-empty list"),
    ([[]], "kvcache[0] must be a non-empty list"),
    ([[GOOD], np.zeros(3)], "kvcache[1] must be a non-empty list"),
    ([[GOOD, "x"]], "kvcache[0][1]: expected a torch.Tensor, numpy.ndarray or KvBufferWrapper"),
    ([[np.zeros(4)]], "kvcache[0][0]: needs at least 2 dimensions"),
    ([[GOOD], [np.zeros((3, 2, 3), np.float16)]], "kvcache[1][0]: num_blocks"),
    ([[GOOD, np.zeros((2, 4, 3), np.float16)]], "kvcache[0][1]: block_size"),
    ([[np.zeros((2, 2, 6))[..., ::2]]], "kvcache[0][0]: the per-slot row (dimensions 2..) must"),
    ([[ro_array()]], "kvcache[0][0]: the numpy array must be writable"),
    ([[np.empty((2, 2), dtype=object)]], "kvcache[0][0]: numpy arrays of Python objects"),
    ([[np.zeros((0, 2, 3))]], "kvcache[0][0]: every dimension must be positive"),
    (
        [[np.lib.stride_tricks.as_strided(GOOD, (4, 2, 3), (0, 6, 2), writeable=True)]],
        "kvcache[0][0]: slots must not overlap",
    ),
]


@pytest.mark.parametrize(("kvcache", "text"), BAD_KVCACHE)
def test_bad_kvcache_is_invalid_argument_naming_the_element(kvcache: Any, text: str) -> None:
    with pytest.raises(EmsException) as e:
        KvLayout.from_kvcache(kvcache)
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert text in e.value.message()


def test_bad_torch_tensors_are_invalid_argument() -> None:
    torch = pytest.importorskip("torch")
    cases = [
        (torch.zeros(1, 2, 3).expand(4, 2, 3), "slots must not overlap"),
        (torch.zeros(2, 2, 3, device="meta"), "CPU or CUDA device"),
        (torch.zeros(2, 2, 3).to_sparse(), "dense (strided)"),
        (torch.zeros(2, 2, 6)[..., ::2], "must be contiguous"),
    ]
    for x, text in cases:
        with pytest.raises(EmsException) as e:
            KvLayout.from_kvcache([[torch.zeros(4, 2, 3)], [x]])
        assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "kvcache[1][0]" in e.value.message() and text in e.value.message()


def fake_info(device: str) -> TensorInfo:
    return TensorInfo("kvcache[0][0]", 0x10000, 64, 16, 16, "float16", device, 2, 4, None)


def test_mixed_device_kinds_are_invalid_argument() -> None:
    cpu = fake_info("cpu")
    cuda = replace(fake_info("cuda"), name="kvcache[1][0]")
    with pytest.raises(EmsException, match=r"kvcache\[1\]\[0\]: is on cuda") as e:
        KvLayout([[cpu], [cuda]])
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT


def test_cuda_layout_requires_the_pool_size() -> None:
    layout = KvLayout([[fake_info("cuda")]])
    with pytest.raises(EmsException, match="pool_size is required"):
        layout.save(0x20000, [0, 1], [2], [0])


LAYOUT = KvLayout.from_kvcache(kv_numpy(layers=1, nb=4, bs=4))  # 16 slots, 12 bytes a slot
BAD_REQUESTS = [
    (dict(slots=[0, 16], counts=[2], offsets=[0]), "slot_mapping[1] = 16 is out of range [0, 16)"),
    (dict(slots=[-1], counts=[1], offsets=[0]), "slot_mapping[0] = -1 is out of range"),
    (dict(slots=[0, 1], counts=[1], offsets=[0]), "sum(counts) = 1 must equal len(slot_mapping)"),
    (dict(slots=[0, 1], counts=[1, 1], offsets=[0]), "offsets has 1 entries but counts has 2"),
    (dict(slots=[0], counts=[2, -1], offsets=[0, 0]), "counts[1] = -1 must be >= 0"),
    (dict(slots=[0], counts=[1], offsets=[-4]), "offsets[0] = -4 must be >= 0"),
    (dict(slots=[0.5], counts=[1], offsets=[0]), "slot_mapping must hold integers"),
    (dict(slots=[[0]], counts=[1], offsets=[0]), "slot_mapping must be 1-dimensional"),
    (dict(slots=[0, 1], counts=[2], offsets=[90], pool_size=100), "exceeds the pool size 100"),
    (dict(slots=[0, 1], counts=[2], offsets=[0], skip=[3]), "skip[0] = 3 must be in [0, counts"),
    (dict(slots=[0, 1], counts=[2], offsets=[0], skip=[0, 0]), "skip has 2 entries"),
]


@pytest.mark.parametrize(("args", "text"), BAD_REQUESTS)
def test_bad_requests_are_invalid_argument_before_any_copy(args: dict, text: str) -> None:
    pool = np.full(100, SENTINEL, np.uint8)
    call = dict(pool_addr=pool.ctypes.data, **args)
    with pytest.raises(EmsException) as e:
        if "skip" in args:
            LAYOUT.load(**call)
        else:
            LAYOUT.save(**call)
    assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert text in e.value.message()
    assert (pool == SENTINEL).all()


def test_request_arguments_may_be_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    kv = kv_numpy(layers=1, nb=2, bs=2, inner=())
    kv[0][0][:] = np.arange(4).reshape(2, 2)
    layout = KvLayout.from_kvcache(kv)
    pool = np.zeros(16, np.uint8)
    layout.save(pool.ctypes.data, torch.tensor([3, 2]), torch.tensor([2]), torch.tensor([0]))
    assert pool[:4].view(np.float16).tolist() == [3, 2]


def test_pool_address_must_be_a_positive_int() -> None:
    for addr in (0, -8, 1.0, None):
        with pytest.raises(EmsException, match="pool_addr must be") as e:
            LAYOUT.save(addr, [0], [1], [0])
        assert e.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT


def test_check_slots_names_the_first_bad_index() -> None:
    with pytest.raises(EmsException, match=r"slot_mapping\[2\] = 99"):
        LAYOUT.check_slots(np.array([0, 15, 99, -1]))
    LAYOUT.check_slots(np.arange(16))
