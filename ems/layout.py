"""KvLayout: what ``register_kvcache`` records, and the copies between tensors and the pool.

Registration
------------
``KvLayout.from_kvcache(kvcache)`` takes ``List[List[X]]`` (outer = layers,
inner = the per-layer tensors, e.g. K and V) where X is a ``torch.Tensor``
(CPU or CUDA), a ``numpy.ndarray`` or a ``KvBufferWrapper``. It records, per
tensor, only addresses and geometry; no data moves and no tensor is copied.
References to the tensors are kept so their memory stays alive.

Every tensor's first two dimensions are ``[num_blocks, block_size]``, shared
by all tensors; slot ``s`` is block ``s // block_size``, position
``s % block_size``. A slot's *row* (all dimensions after the first two) must be
contiguous in memory; rows hold ``row_bytes = prod(shape[2:]) * itemsize``
bytes. The first two dimensions may be strided (e.g. K and V sliced out of one
``[num_blocks, 2, block_size, ...]`` tensor): slot ``s`` lives at

    base + (s // block_size) * stride0_bytes + (s % block_size) * stride1_bytes

Slots must not overlap in memory. torch is never imported here: a tensor is
recognised as a torch tensor only if torch is already loaded, so numpy arrays
and ``KvBufferWrapper`` work without torch installed.

The layout signature (``signature``) is a stable text naming the layers,
tensors per layer, dtype and row bytes. It goes into the block namespace so
that two layouts whose bytes would be read differently never share blocks.
It deliberately leaves out ``num_blocks`` (which varies with free GPU memory
between instances of one model), ``block_size`` (it does not change the bytes
of a slot), the device and the strides.

Block layout in the pool (the contract with the other components)
------------------------------------------------------------------
A request names ``K`` keys; key ``j`` covers ``counts[j]`` consecutive entries
of ``slots`` (the slot mapping), starting at ``starts[j] = sum(counts[:j])``,
and its value lives at pool offset ``offsets[j]``, tensor-major: for each
tensor ``t`` in registration order (layer-major, then inner index), the
``counts[j]`` rows of that tensor, in slot-mapping order, occupy

    offsets[j] + counts[j] * prefix_t  ...  + counts[j] * row_bytes_t

where ``prefix_t`` is the sum of the row bytes of the tensors before ``t``.
The value is ``counts[j] * slot_bytes`` bytes, ``slot_bytes`` being the sum of
all tensors' row bytes.

The copy
--------
``save`` copies every (key, tensor) from the slots into the pool, ``load`` the
reverse; ``load``'s ``skip[j]`` leading positions of key ``j`` are not written
back (a token-mask prefix that is already in the tensors). Both compute, with
vectorised numpy and no per-block Python loop, the (destination, source,
length) address triple of every segment and issue ONE batched
``ems.copy.copy_segments`` call that moves the bytes exactly once. The work
is split in two: ``plan`` computes everything that does not depend on where
the keys' values are in the pool (a save runs it while the daemon reserves),
``place`` adds the places (and may keep only some keys). A segment
is a *run*: a maximal sequence of positions of one key whose slot addresses
are consecutive in a tensor, so a whole vLLM block becomes one memcpy per
tensor. Runs depend only on a tensor's (stride0, stride1, row_bytes), so they
are computed once per distinct geometry and broadcast over its tensors.

CUDA tensors go through ``torch`` copies between device memory and a
page-locked (``cudaHostRegister``) view of the pool, one ``copy_`` per
segment on the current stream, then a stream synchronisation. That path is
UNTESTED here (no GPU on the development machine); see ``_copy_cuda``.

Validation raises ``EmsException(EMS_INVALID_ARGUMENT)`` whose message names
the offending element (``kvcache[i][j]``, ``slot_mapping[i]``...) and the rule.
Bad slots are always rejected before any byte moves: a slot out of range
would otherwise be a write to arbitrary memory.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ems.buffer import KvBufferWrapper
from ems.common.exception import EmsErrorCode, EmsException, invalid
from ems.copy import copy_segments

__all__ = [
    "CopyPlan", "KvLayout", "Segments", "TensorInfo", "register_pool_for_cuda", "unregister_pool_for_cuda",
]


@dataclass(frozen=True)
class TensorInfo:
    """One registered tensor: where its slots are and how big a row is."""

    name: str  # "kvcache[i][j]"
    base: int  # address of slot 0
    stride0: int  # bytes between blocks
    stride1: int  # bytes between positions of a block
    row_bytes: int
    dtype: str  # "float16", "bfloat16", "uint8" (KvBufferWrapper)...
    device: str  # "cpu" or "cuda"
    num_blocks: int
    block_size: int
    ref: Any  # the tensor itself, kept alive (and used by the CUDA path)


# ---------------------------------------------------------------------------
# Describing one registered element
# ---------------------------------------------------------------------------


def _row_is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether dimensions 2.. of a (shape, byte strides) form one dense C-order row."""
    expected = itemsize
    for size, stride in zip(reversed(shape[2:]), reversed(strides[2:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _slots_overlap(num_blocks: int, block_size: int, s0: int, s1: int, row: int) -> bool:
    """A sufficient test that distinct slots never share a byte (blocks-outer or blocks-inner)."""
    a0 = abs(s0) if num_blocks > 1 else None
    a1 = abs(s1) if block_size > 1 else None
    if a0 is None and a1 is None:
        return False
    if a0 is None:
        return a1 is not None and a1 < row
    if a1 is None:
        return a0 < row
    blocks_outer = a1 >= row and a0 >= block_size * a1
    blocks_inner = a0 >= row and a1 >= num_blocks * a0
    return not (blocks_outer or blocks_inner)


def _geometry(
    name: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
) -> tuple[int, int, int]:
    """Validate a strided tensor's geometry; return (stride0, stride1, row_bytes) in bytes."""
    if len(shape) < 2:
        raise invalid(
            f"{name}: needs at least 2 dimensions [num_blocks, block_size, ...], got shape {tuple(shape)}"
        )
    if any(d <= 0 for d in shape):
        raise invalid(f"{name}: every dimension must be positive, got shape {tuple(shape)}")
    if not _row_is_contiguous(shape, strides, itemsize):
        raise invalid(
            f"{name}: the per-slot row (dimensions 2..) must be contiguous in memory, "
            f"got shape {tuple(shape)} with byte strides {tuple(strides)}"
        )
    row = int(np.prod(shape[2:], dtype=np.int64)) * itemsize
    if _slots_overlap(shape[0], shape[1], strides[0], strides[1], row):
        raise invalid(
            f"{name}: slots must not overlap in memory, got byte strides "
            f"{tuple(strides[:2])} for rows of {row} bytes"
        )
    return int(strides[0]), int(strides[1]), row


def _describe_numpy(x: np.ndarray, name: str) -> TensorInfo:
    if x.dtype.hasobject:
        raise invalid(f"{name}: numpy arrays of Python objects cannot hold KV data")
    if not x.flags.writeable:
        raise invalid(f"{name}: the numpy array must be writable (loads write into it)")
    s0, s1, row = _geometry(name, x.shape, x.strides, x.itemsize)
    return TensorInfo(name, int(x.ctypes.data), s0, s1, row, x.dtype.name, "cpu", x.shape[0], x.shape[1], x)


def _describe_wrapper(x: KvBufferWrapper, name: str) -> TensorInfo:
    s1 = x.row_bytes
    return TensorInfo(
        name, x.address, x.block_size * s1, s1, x.row_bytes, "uint8", "cpu",
        x.num_blocks, x.block_size, x,
    )  # fmt: skip


def _describe_torch(x: Any, name: str) -> TensorInfo:
    torch = sys.modules["torch"]
    if x.layout != torch.strided:
        raise invalid(f"{name}: only dense (strided) tensors are supported, got {x.layout}")
    device = x.device.type
    if device not in ("cpu", "cuda"):
        raise invalid(f"{name}: tensors must be on a CPU or CUDA device, got {x.device}")
    itemsize = x.element_size()
    strides = tuple(s * itemsize for s in x.stride())
    s0, s1, row = _geometry(name, tuple(x.shape), strides, itemsize)
    dtype = str(x.dtype).removeprefix("torch.")
    return TensorInfo(name, int(x.data_ptr()), s0, s1, row, dtype, device, x.shape[0], x.shape[1], x)


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never import torch ourselves
    return torch is not None and isinstance(x, torch.Tensor)


def describe(x: Any, name: str) -> TensorInfo:
    """Describe one element of ``kvcache``; raises INVALID_ARGUMENT naming ``name``."""
    if isinstance(x, KvBufferWrapper):
        return _describe_wrapper(x, name)
    if isinstance(x, np.ndarray):
        return _describe_numpy(x, name)
    if _is_torch_tensor(x):
        return _describe_torch(x, name)
    raise invalid(
        f"{name}: expected a torch.Tensor, numpy.ndarray or KvBufferWrapper, got {type(x).__name__}"
    )


def _describe_all(kvcache: Any) -> list[list[TensorInfo]]:
    if not isinstance(kvcache, list | tuple) or len(kvcache) == 0:
        raise invalid("kvcache must be a non-empty list of layers (List[List[Tensor]])")
    layers = []
    for i, layer in enumerate(kvcache):
        if not isinstance(layer, list | tuple) or len(layer) == 0:
            raise invalid(f"kvcache[{i}] must be a non-empty list of tensors")
        layers.append([describe(x, f"kvcache[{i}][{j}]") for j, x in enumerate(layer)])
    return layers


def _check_consistent(infos: list[TensorInfo]) -> None:
    first = infos[0]
    for t in infos[1:]:
        if t.num_blocks != first.num_blocks:
            raise invalid(
                f"{t.name}: num_blocks (dimension 0) is {t.num_blocks}, but {first.name} has "
                f"{first.num_blocks}; all tensors must share num_blocks"
            )
        if t.block_size != first.block_size:
            raise invalid(
                f"{t.name}: block_size (dimension 1) is {t.block_size}, but {first.name} has "
                f"{first.block_size}; all tensors must share block_size"
            )
        if t.device != first.device:
            raise invalid(
                f"{t.name}: is on {t.device} but {first.name} is on {first.device}; "
                "all tensors must be on the same kind of device"
            )


def layout_signature(layers: list[list[TensorInfo]]) -> str:
    """Stable text for the namespace: ``kv1/L32xT2/float16:2048,float16:2048`` when every
    layer holds the same tensors, else ``kv1/L3/<layer>;<layer>;...``."""
    rows = [",".join(f"{t.dtype}:{t.row_bytes}" for t in layer) for layer in layers]
    if all(r == rows[0] for r in rows):
        return f"kv1/L{len(layers)}xT{len(layers[0])}/{rows[0]}"
    return f"kv1/L{len(layers)}/" + ";".join(rows)


# ---------------------------------------------------------------------------
# Request arguments
# ---------------------------------------------------------------------------


def _int_array(values: Any, name: str) -> np.ndarray:
    """A request argument (sequence, numpy array or torch tensor, on any device) as int64."""
    if type(values) is np.ndarray and values.ndim == 1:  # the usual cases, in fewer steps
        if values.dtype == np.int64:
            return values  # canonical already (``ems.requests`` makes these)
        if values.dtype == np.uint64 and values.size and int(values.max()) <= _INT64_MAX:
            return values.view(np.int64)  # e.g. the daemon's offsets: the same numbers
    if _is_torch_tensor(values):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise invalid(f"{name} must be 1-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise invalid(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise invalid(f"{name}[{i}] = {int(arr[i])} is too large")
    return arr.astype(np.int64, copy=False)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _first_bad(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _check_pool_addr(pool_addr: Any) -> None:
    if isinstance(pool_addr, bool) or not isinstance(pool_addr, int | np.integer):
        raise invalid(f"pool_addr must be an int address, got {type(pool_addr).__name__}")
    if pool_addr <= 0:
        raise invalid(f"pool_addr must be a positive address, got {pool_addr}")


@dataclass(frozen=True)
class Segments:
    """One batch of copies: tensor-side address, pool-side address, byte count, tensor index."""

    tensor_addr: np.ndarray  # int64
    pool_addr: np.ndarray  # int64
    length: np.ndarray  # int64
    tensor: np.ndarray  # int64 index into KvLayout.tensors


@dataclass(frozen=True)
class CopyPlan:
    """A request's segments before the pool places of its keys are known.

    Segment ``i`` moves ``length[i]`` bytes between ``tensor_addr[i]`` and the
    pool at ``offsets[key[i]] + block_off[i]``, ``key[i]`` being the index of
    its key in the request and ``block_off[i]`` the byte offset inside that
    key's value (the block layout above). ``counts`` are the request's slots
    per key. Built by ``KvLayout.plan`` from validated arguments, so that a
    save can plan while the daemon reserves and only add the places after.
    """

    tensor_addr: np.ndarray  # int64
    block_off: np.ndarray  # int64
    length: np.ndarray  # int64
    tensor: np.ndarray  # int64 index into KvLayout.tensors
    key: np.ndarray  # int64 index into counts
    counts: np.ndarray  # int64 [K]


# ---------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _GeometryGroup:
    """Tensors sharing (stride0, stride1, row_bytes): their runs are the same."""

    stride0: int
    stride1: int
    row_bytes: int
    tensor: np.ndarray  # int64 indices into the layout's tensors
    base: np.ndarray  # int64 base addresses
    prefix: np.ndarray  # int64 prefix_t of each tensor


class KvLayout:
    """The registered KV cache: geometry of every tensor, the pool block layout, the copies.

    Immutable after construction; ``save``/``load`` may run concurrently from
    several threads (they only read the layout, and the copy releases the GIL).
    """

    def __init__(self, layers: list[list[TensorInfo]]) -> None:
        tensors = [t for layer in layers for t in layer]
        _check_consistent(tensors)
        self.tensors: tuple[TensorInfo, ...] = tuple(tensors)
        self.num_layers = len(layers)
        self.num_blocks = tensors[0].num_blocks
        self.block_size = tensors[0].block_size
        self.num_slots = self.num_blocks * self.block_size
        self.device = tensors[0].device
        rows = np.array([t.row_bytes for t in tensors], dtype=np.int64)
        self.slot_bytes = int(rows.sum())
        self.signature = layout_signature(layers)
        prefix = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)
        self._groups = _group_by_geometry(tensors, prefix)
        self._one = _one_block_columns(self._groups, self.block_size)
        self._cuda_views: list[Any] | None = None

    @classmethod
    def from_kvcache(cls, kvcache: Any) -> KvLayout:
        """Validate ``kvcache`` (List[List[tensor-like]]) and record its layout."""
        return cls(_describe_all(kvcache))

    def __repr__(self) -> str:
        return (
            f"KvLayout(layers={self.num_layers}, tensors={len(self.tensors)}, "
            f"num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"slot_bytes={self.slot_bytes}, device={self.device!r}, "
            f"signature={self.signature!r})"
        )

    # -- sizes and checks ---------------------------------------------------

    def block_bytes(self, counts: np.ndarray) -> np.ndarray:
        """Bytes of each key's value: ``counts[j] * slot_bytes`` (int64)."""
        return _int_array(counts, "counts") * self.slot_bytes

    def check_slots(self, slots: np.ndarray) -> None:
        """Every slot in ``[0, num_slots)``, else INVALID_ARGUMENT naming the first bad one."""
        s = _int_array(slots, "slot_mapping")
        if s.size and (int(s.min()) < 0 or int(s.max()) >= self.num_slots):
            i = _first_bad((s < 0) | (s >= self.num_slots))
            raise invalid(
                f"slot_mapping[{i}] = {int(s[i])} is out of range [0, {self.num_slots}) "
                f"(num_blocks {self.num_blocks} * block_size {self.block_size})"
            )

    # -- segments -----------------------------------------------------------

    def plan(self, slots: Any, counts: Any, skip: Any = None) -> CopyPlan:
        """Validate a request's slots, counts and (loads) skip and compute its
        segments relative to each key's place in the pool (vectorised; no copy).

        ``skip[j]`` leading positions of key ``j`` get no segment. Raises
        INVALID_ARGUMENT naming the first bad argument.
        """
        s = _int_array(slots, "slot_mapping")
        c = _int_array(counts, "counts")
        if skip is None:
            one = self._plan_one(s, c)
            if one is not None:
                return one
        if (c < 0).any():
            i = _first_bad(c < 0)
            raise invalid(f"counts[{i}] = {int(c[i])} must be >= 0")
        if int(c.sum()) != len(s):
            raise invalid(f"sum(counts) = {int(c.sum())} must equal len(slot_mapping) = {len(s)}")
        self.check_slots(s)
        if skip is None:
            blocks = self._whole_blocks(s, c)
            if blocks is not None:
                return self._plan_blocks(blocks, c)
        key, pos = _positions(c)
        if skip is not None:
            sk = _int_array(skip, "skip")
            if len(sk) != len(c):
                raise invalid(f"skip has {len(sk)} entries but counts has {len(c)}; must be equal")
            bad = (sk < 0) | (sk > c)
            if bad.any():
                i = _first_bad(bad)
                raise invalid(f"skip[{i}] = {int(sk[i])} must be in [0, counts[{i}]]")
            keep = pos >= sk[key]
            key, pos, s = key[keep], pos[keep], s[keep]
        block, within = np.divmod(s, self.block_size)
        return _joined_plan([_group_segments(g, c, key, pos, block, within) for g in self._groups], c)

    def _plan_one(self, s: np.ndarray, c: np.ndarray) -> CopyPlan | None:
        """``plan`` of one key that covers one whole block in order (the usual one-block
        call), from columns computed at registration: the plan ``_plan_blocks`` makes, in
        a few scalar steps. None for any other request (the general path checks it)."""
        one, bs = self._one, self.block_size
        if one is None or len(c) != 1 or int(c[0]) != bs or len(s) != bs:
            return None
        first = int(s[0])
        if first < 0 or first % bs or first >= self.num_slots:
            return None
        if bs > 1 and (int(s[-1]) != first + bs - 1 or not bool((np.diff(s) == 1).all())):
            return None
        stride, base, off, length, tensor, key = one
        return CopyPlan(stride * (first // bs) + base, off, length, tensor, key, c)

    def place_one(self, slots: np.ndarray, pool_addr: int, offset: int,
                  pool_size: int | None) -> Segments | None:
        """``place(plan(slots, [block_size]), pool_addr, [offset], pool_size=pool_size)`` of one
        key whose ``slots`` cover one whole block in order (the usual one-block save), from the
        columns kept at registration and without the plan's arrays: the same segments. None
        for anything else (the caller then plans in full, which names what is wrong)."""
        one, bs = self._one, self.block_size
        if one is None or len(slots) != bs or offset < 0 or not pool_addr:
            return None
        first = int(slots[0])
        if first < 0 or first % bs or first >= self.num_slots:
            return None
        if pool_size is not None and offset + bs * self.slot_bytes > pool_size:
            return None
        if bs > 1 and (int(slots[-1]) != first + bs - 1 or not bool((np.diff(slots) == 1).all())):
            return None
        stride, base, off, length, tensor, _ = one
        return Segments(stride * (first // bs) + base, (int(pool_addr) + offset) + off, length, tensor)

    def _whole_blocks(self, s: np.ndarray, c: np.ndarray) -> np.ndarray | None:
        """The block of each key when every key covers one whole block in order (the usual
        request: vLLM's full blocks), else None (the general path decides)."""
        bs = self.block_size
        if not len(c) or int(c.min()) != bs or int(c.max()) != bs:
            return None
        rows = s.reshape(len(c), bs)
        first = rows[:, 0]
        if bs > 1 and ((first % bs).any() or (rows != first[:, None] + np.arange(bs)).any()):
            return None
        return first // bs if bs > 1 else first

    def _plan_blocks(self, blocks: np.ndarray, c: np.ndarray) -> CopyPlan:
        """``plan`` for whole blocks: one segment per key and tensor where a block's rows are
        contiguous, the same segments the general path finds (key-major, then tensor)."""
        bs, parts = self.block_size, []
        k = len(blocks)
        for g in self._groups:
            if bs > 1 and g.stride1 != g.row_bytes:  # rows apart: the general path's runs
                key, pos = _positions(c)
                parts.append(_group_segments(g, c, key, pos, *np.divmod(blocks.repeat(bs) * bs + pos, bs)))
                continue
            shape = (k, g.tensor.size)
            tensor_addr = (blocks * g.stride0)[:, None] + g.base[None, :]
            parts.append((tensor_addr.ravel(), np.broadcast_to(g.prefix * bs, shape).ravel(),
                          np.full(tensor_addr.size, bs * g.row_bytes, dtype=np.int64),
                          np.broadcast_to(g.tensor, shape).ravel(), np.arange(k).repeat(g.tensor.size)))
        return _joined_plan(parts, c)

    def place(
        self,
        plan: CopyPlan,
        pool_addr: int,
        offsets: Any,
        keys: np.ndarray | None = None,
        *,
        pool_size: int | None = None,
    ) -> Segments:
        """The segments of ``plan``'s keys ``keys`` (ascending indices; None: all) with
        their values at byte ``offsets`` (one per key of ``keys``) in the pool mapped
        at ``pool_addr``. ``pool_size``, when given, bounds-checks every key's range.

        Raises INVALID_ARGUMENT before anything is computed on bad arguments.
        """
        _check_pool_addr(pool_addr)
        if keys is None and len(plan.counts) == 1 and isinstance(offsets, np.ndarray) and len(offsets) == 1:
            first = int(offsets[0])  # one key: the same checks in scalar steps
            end = first + int(plan.counts[0]) * self.slot_bytes
            if first >= 0 and (pool_size is None or end <= pool_size):
                return Segments(plan.tensor_addr, (int(pool_addr) + first) + plan.block_off, plan.length,
                                plan.tensor)
        o = _int_array(offsets, "offsets")
        counts = plan.counts if keys is None else plan.counts[keys]
        if len(o) != len(counts):
            raise invalid(f"offsets has {len(o)} entries but counts has {len(counts)}; must be equal")
        if (o < 0).any():
            i = _first_bad(o < 0)
            raise invalid(f"offsets[{i}] = {int(o[i])} must be >= 0")
        if pool_size is not None and len(o):
            end = o + counts * self.slot_bytes
            if (end > pool_size).any():
                i = _first_bad(end > pool_size)
                k = i if keys is None else int(keys[i])
                raise invalid(
                    f"key {k}: pool range [{int(o[i])}, {int(end[i])}) exceeds the pool size {pool_size}"
                )
        if keys is None or len(keys) == len(plan.counts):
            return Segments(plan.tensor_addr, int(pool_addr) + o[plan.key] + plan.block_off,
                            plan.length, plan.tensor)
        at = np.zeros(len(plan.counts), dtype=np.int64)
        at[keys] = o
        kept = np.zeros(len(plan.counts), dtype=bool)
        kept[keys] = True
        m = kept[plan.key]
        return Segments(plan.tensor_addr[m], int(pool_addr) + at[plan.key[m]] + plan.block_off[m],
                        plan.length[m], plan.tensor[m])

    def segments(
        self,
        pool_addr: int,
        slots: Any,
        counts: Any,
        offsets: Any,
        skip: Any = None,
        *,
        pool_size: int | None = None,
    ) -> Segments:
        """Validate a request and compute all its copy segments (vectorised; no copy):
        ``place(plan(slots, counts, skip), pool_addr, offsets)``."""
        _check_pool_addr(pool_addr)
        o = _int_array(offsets, "offsets")
        c = _int_array(counts, "counts")
        if len(o) != len(c):  # named before the slots: the offsets are the request's places
            raise invalid(f"offsets has {len(o)} entries but counts has {len(c)}; must be equal")
        return self.place(self.plan(slots, c, skip), pool_addr, o, pool_size=pool_size)

    # -- copies -------------------------------------------------------------

    def save(
        self,
        pool_addr: int,
        slots: np.ndarray,
        counts: np.ndarray,
        offsets: np.ndarray,
        *,
        pool_size: int | None = None,
    ) -> None:
        """Copy the slots of every key, for every tensor, into the pool (layout above).

        ``pool_addr`` is the address of the mapped pool; ``offsets`` are byte
        offsets into it. ``pool_size``, when given, bounds-checks every key's
        range (required for CUDA layouts, which register the pool page-locked).
        Raises INVALID_ARGUMENT before any byte moves on bad arguments.
        """
        self.copy(self.segments(pool_addr, slots, counts, offsets, pool_size=pool_size), pool_addr,
                  pool_size, to_pool=True)

    def load(
        self,
        pool_addr: int,
        slots: np.ndarray,
        counts: np.ndarray,
        offsets: np.ndarray,
        skip: np.ndarray | None = None,
        *,
        pool_size: int | None = None,
    ) -> None:
        """Copy every key's value from the pool back into the slots.

        ``skip[j]`` leading positions of key ``j`` are left untouched in the
        tensors (0 <= skip[j] <= counts[j]). When a slot appears more than once
        among the written positions, which copy lands last is unspecified.
        """
        self.copy(self.segments(pool_addr, slots, counts, offsets, skip, pool_size=pool_size), pool_addr,
                  pool_size, to_pool=False)

    def copy(self, segs: Segments, pool_addr: int, pool_size: int | None, *, to_pool: bool) -> None:
        """Move the bytes of ``segs`` (from ``segments`` or ``place``): into the pool
        mapped at ``pool_addr`` (``to_pool``) or out of it, in one batched call."""
        if self.device == "cuda":
            self._copy_cuda(segs, pool_addr, pool_size, to_pool=to_pool)
        elif to_pool:
            copy_segments(segs.pool_addr, segs.tensor_addr, segs.length)
        else:
            copy_segments(segs.tensor_addr, segs.pool_addr, segs.length)

    # -- CUDA (untested here: no GPU on the development machine) -------------

    def _copy_cuda(self, segs: Segments, pool_addr: int, pool_size: int | None, *, to_pool: bool) -> None:
        """CUDA path: per-segment ``torch`` copies between device memory and the pinned pool.

        UNTESTED on real hardware. The pool is registered page-locked once
        (``register_pool_for_cuda``), so each ``copy_(non_blocking=True)`` is
        a DMA on the tensor device's current stream, ordered after the
        compute that produced (save) or before the compute that consumes
        (load) the KV data; the call returns after those streams synchronise,
        so a save is complete in the pool and a load complete in the tensors.
        Cost: one Python-level ``copy_`` per segment (a few microseconds
        each); a batched ``cudaMemcpyBatchAsync`` or a gather kernel over the
        mapped pool would remove that overhead.
        """
        if not len(segs.length):
            return
        if pool_size is None:
            raise invalid("pool_size is required to save or load CUDA tensors")
        torch = sys.modules["torch"]
        pool = register_pool_for_cuda(pool_addr, pool_size)
        views = self._device_byte_views()
        bases = np.array([t.base for t in self.tensors], dtype=np.int64)
        toff = segs.tensor_addr - bases[segs.tensor]
        poff = segs.pool_addr - pool_addr
        try:
            copy_torch_segments(
                views, pool, segs.tensor.tolist(), toff.tolist(), poff.tolist(),
                segs.length.tolist(), to_pool=to_pool,
            )  # fmt: skip
            for dev in {self.tensors[t].ref.device for t in set(segs.tensor.tolist())}:
                torch.cuda.current_stream(dev).synchronize()
        except RuntimeError as e:
            raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"CUDA copy failed: {e}") from e

    def _device_byte_views(self) -> list[Any]:
        if self._cuda_views is None:
            self._cuda_views = [torch_byte_view(t.ref) for t in self.tensors]
        return self._cuda_views


def _group_by_geometry(tensors: list[TensorInfo], prefix: np.ndarray) -> list[_GeometryGroup]:
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.stride0, t.stride1, t.row_bytes), []).append(i)
    out = []
    for (s0, s1, row), idx in groups.items():
        ids = np.array(idx, dtype=np.int64)
        bases = np.array([tensors[i].base for i in idx], dtype=np.int64)
        out.append(_GeometryGroup(s0, s1, row, ids, bases, prefix[ids]))
    return out


def _one_block_columns(groups: list[_GeometryGroup], bs: int) -> tuple[np.ndarray, ...] | None:
    """The columns of the plan of one whole block, in ``_plan_blocks``' order (group, then
    tensor): (stride0, base, block_off, length, tensor, key) per segment, so that a block's
    tensor addresses are ``stride0 * block + base``; None when some group's rows are apart
    (the general path's runs)."""
    if bs > 1 and any(g.stride1 != g.row_bytes for g in groups):
        return None
    cols = [np.concatenate([np.full(g.tensor.size, g.stride0, dtype=np.int64) for g in groups]),
            np.concatenate([g.base for g in groups]),
            np.concatenate([g.prefix * bs for g in groups]),
            np.concatenate([np.full(g.tensor.size, bs * g.row_bytes, dtype=np.int64) for g in groups]),
            np.concatenate([g.tensor for g in groups])]
    cols.append(np.zeros(cols[0].size, dtype=np.int64))
    for col in cols:
        col.setflags(write=False)  # shared by every one-block plan
    return tuple(cols)


def _positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each slot-mapping entry: its key index and its position within the key."""
    n = int(counts.sum())
    key = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    pos = np.arange(n, dtype=np.int64) - starts[key]
    return key, pos


def _joined_plan(parts: Sequence[tuple[np.ndarray, ...]], counts: np.ndarray) -> CopyPlan:
    """One ``CopyPlan`` from the per-group segment columns (``_group_segments``' five), in
    group order."""
    cols = parts[0] if len(parts) == 1 else [np.concatenate([p[j] for p in parts]) for j in range(5)]
    return CopyPlan(cols[0], cols[1], cols[2], cols[3], cols[4], counts)


def _group_segments(
    g: _GeometryGroup,
    counts: np.ndarray,
    key: np.ndarray,
    pos: np.ndarray,
    block: np.ndarray,
    within: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of one geometry group, broadcast over its tensors (key-major, then tensor):
    (tensor address, offset in the key's value, length, tensor index, key index)."""
    rel = block * g.stride0 + within * g.stride1  # slot address relative to a tensor's base
    m = len(rel)
    starts_run = np.ones(m, dtype=bool)
    starts_run[1:] = (key[1:] != key[:-1]) | (pos[1:] != pos[:-1] + 1) | (rel[1:] != rel[:-1] + g.row_bytes)
    first = np.flatnonzero(starts_run)
    rows = np.diff(np.append(first, m))  # rows per run
    rkey = key[first]
    tensor_addr = rel[first][:, None] + g.base[None, :]
    block_off = counts[rkey][:, None] * g.prefix[None, :] + (pos[first] * g.row_bytes)[:, None]
    shape = tensor_addr.shape
    length = np.broadcast_to((rows * g.row_bytes)[:, None], shape)
    tensor = np.broadcast_to(g.tensor[None, :], shape)
    keys = np.broadcast_to(rkey[:, None], shape)
    return tensor_addr.ravel(), block_off.ravel(), length.ravel(), tensor.ravel(), keys.ravel()


# ---------------------------------------------------------------------------
# torch helpers for the CUDA path (device-agnostic; only registration is CUDA)
# ---------------------------------------------------------------------------

_registered_pools: dict[tuple[int, int], Any] = {}


def register_pool_for_cuda(pool_addr: int, pool_size: int) -> Any:
    """Page-lock the mapped pool for CUDA DMA (once) and return a uint8 CPU tensor over it.

    UNTESTED here. Raises EMS_INTERNAL_ERROR if ``cudaHostRegister`` fails.
    Call ``unregister_pool_for_cuda`` before unmapping the pool.
    """
    view = _registered_pools.get((pool_addr, pool_size))
    if view is not None:
        return view
    torch = sys.modules["torch"]
    rc = int(torch.cuda.cudart().cudaHostRegister(pool_addr, pool_size, 1))  # 1 = Portable
    if rc != 0:
        raise EmsException(
            EmsErrorCode.EMS_INTERNAL_ERROR,
            f"cudaHostRegister of the pool ({pool_size} bytes) failed with cudaError {rc}",
        )
    view = torch.frombuffer((ctypes.c_char * pool_size).from_address(pool_addr), dtype=torch.uint8)
    _registered_pools[(pool_addr, pool_size)] = view
    return view


def unregister_pool_for_cuda(pool_addr: int) -> None:
    """Undo ``register_pool_for_cuda`` for the pool at ``pool_addr`` (no-op if not registered)."""
    for key in [k for k in _registered_pools if k[0] == pool_addr]:
        del _registered_pools[key]
        torch = sys.modules["torch"]
        torch.cuda.cudart().cudaHostUnregister(pool_addr)


def torch_byte_view(x: Any) -> Any:
    """A 1-D uint8 tensor over ``x``'s storage starting at ``x.data_ptr()`` (same device)."""
    torch = sys.modules["torch"]
    storage = x.untyped_storage()
    offset = x.storage_offset() * x.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=x.device)
    return view.set_(storage, offset, (storage.nbytes() - offset,), (1,))


def copy_torch_segments(
    views: list[Any],
    pool: Any,
    tensor: list[int],
    tensor_off: list[int],
    pool_off: list[int],
    length: list[int],
    *,
    to_pool: bool,
) -> None:
    """One non-blocking ``copy_`` per segment between tensor byte views and the pool view."""
    for t, a, b, n in zip(tensor, tensor_off, pool_off, length, strict=True):
        dev = views[t][a : a + n]
        host = pool[b : b + n]
        if to_pool:
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)
