"""Argument normalisation for save/load/exists: user arguments to a ``BatchRequest``.

Pure and fast (a connector calls this every forward step): arrays are
converted once, checks are vectorised, nothing touches the daemon or the
registered tensors (slot ranges are checked against the layout elsewhere,
``layout.check_slots``). Every violation raises
``EmsException(EMS_INVALID_ARGUMENT)`` whose message names the argument.

Array arguments (``slot_mapping``, ``offsets``, ``token_ids``, ``mask``) may be
Python lists or tuples, numpy arrays or torch tensors (CPU or CUDA; torch is
never imported here, a tensor is recognised only if torch is already loaded).
They must be 1-D and integer-typed (``mask`` may also be bool); floats are
refused, not truncated. The request always holds its own copies, so the
caller may reuse its buffers as soon as the call returns, even for
``async_save``/``async_load``; the copies are read-only.

Hash semantics (``hash_request``): ``hashes[j]`` owns the next ``offsets[j]``
entries of ``slot_mapping``. ``total`` is ``len(hashes)``.

Token semantics (``token_request``), with ``bs`` the registered block size
and ``n0`` the number of leading zeros of ``mask``:

- ``token_ids`` is cut into chunks of ``bs`` tokens; chunk ``c`` covers
  positions ``[c*bs, min((c+1)*bs, n))``, and the last chunk may be partial.
  Its key is the chained prefix hash of ``ems.tokens`` (32 bytes), so a
  chunk, partial or not, matches only the exact same token prefix.
- ``mask`` must be zeros followed by ones (the prefix already cached, then the
  new part). Chunks lying entirely inside the zero prefix are not part of the
  request: no key, no slots, not counted in ``total``.
- The first chunk in the request may straddle the boundary (it starts before
  ``n0``). A save stores it whole, with all its slots: stored blocks are always
  whole chunks. A load reads it whole but does not write back its first
  ``n0 - c*bs`` positions: ``skip[0]`` says so (``skip`` is ``None`` when no
  chunk straddles, and always ``None`` for a save).
- ``total`` is the number of chunks in the request. Slots of chunks in the
  request must be ``>= 0``; slots of skipped chunks are not inspected (they
  may hold padding such as ``-1``).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ems.common.exception import invalid
from ems.tokens import chunk_keys
from emsd.pool.keys import MAX_KEY_BYTES, ONE_INT_TAG, KeyBatch, KeyError_

MAX_BATCH_KEYS = 65536
_INT64_MAX = np.iinfo(np.int64).max
_INT_KINDS = "iu"


@dataclass(frozen=True, eq=False)
class BatchRequest:
    """One save/load call in canonical form.

    - ``keys``: one key per block;
    - ``slots``: int64 slot mapping, the slots of key 0, then of key 1...;
    - ``counts``: int64 ``(n_keys,)``, slots per key, ``sum(counts) == len(slots)``;
    - ``skip``: int64 ``(n_keys,)``, leading slots of each key a load must not
      write back, or ``None`` for all zero;
    - ``total``: the ``total`` reported in ``CcResult``;
    - ``prev``: token semantics with a mask that leaves chunks out: the key
      of the chunk just before the first one in the request (the daemon's
      prefix eviction keeps a chain's tail older than its head), else None.
    """

    keys: KeyBatch
    slots: np.ndarray
    counts: np.ndarray
    skip: np.ndarray | None
    total: int
    prev: KeyBatch | None = None


# -- array conversion ---------------------------------------------------------------


def _from_torch(value: Any, name: str) -> Any:
    """A tensor as a numpy array (host copy for CUDA); anything else unchanged."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return value
    try:
        return value.detach().cpu().numpy()
    except (TypeError, RuntimeError, NotImplementedError) as exc:
        raise invalid(f"{name}: cannot read this {value.dtype} tensor on {value.device} "
                      f"as integers ({exc})") from None


def _first_bad(values: list[Any] | tuple[Any, ...], name: str) -> str:
    """Describe the first element of ``values`` that is not an int64 integer."""
    for i, v in enumerate(values):
        try:
            array.array("q", [v])
        except OverflowError:
            return f"{name}[{i}] = {v} is outside the int64 range"
        except TypeError:
            return f"{name}[{i}] is a {type(v).__name__}, not an int"
    return f"{name} holds a value that is not an int64 integer"


def as_int_array(value: Any, name: str, allow_bool: bool = False) -> np.ndarray:
    """``value`` as a fresh, read-only, 1-D int64 array; EMS_INVALID_ARGUMENT otherwise.

    Lists and tuples go through ``array.array("q")`` (fast, and strict: a
    float or a too-large int is refused). ``allow_bool`` admits bool arrays
    (as 0/1); bool elements of a list are ints in Python and always pass.
    """
    value = _from_torch(value, name)
    if isinstance(value, list | tuple):
        try:
            arr = np.frombuffer(array.array("q", value), dtype=np.int64)
        except (TypeError, OverflowError):
            raise invalid(_first_bad(value, name)) from None
        arr.setflags(write=False)  # frombuffer shares the array.array: ours alone
        return arr
    if isinstance(value, str | bytes | dict | set):
        raise invalid(f"{name} must be a 1-D sequence of ints, got {type(value).__name__}")
    try:
        src = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise invalid(f"{name} must be a 1-D sequence of ints ({exc})") from None
    if src.ndim != 1:
        raise invalid(f"{name} must be 1-D, got shape {tuple(src.shape)}")
    if src.size == 0:
        src = src.astype(np.int64)
    kind = src.dtype.kind
    if kind == "b" and allow_bool:
        src = src.astype(np.int64)
    elif kind not in _INT_KINDS:
        raise invalid(f"{name} must hold integers, got dtype {src.dtype}")
    elif kind == "u" and src.dtype.itemsize == 8 and src.size and int(src.max()) > _INT64_MAX:
        raise invalid(f"{name} holds a value outside the int64 range")
    arr = np.array(src, dtype=np.int64, copy=True)
    arr.setflags(write=False)
    return arr


def _slots(slot_mapping: Any) -> np.ndarray:
    slots = as_int_array(slot_mapping, "slot_mapping")
    if slots.size and int(slots.min()) < 0:
        i = int(np.argmax(slots < 0))
        raise invalid(f"slot_mapping[{i}] = {int(slots[i])} is negative; slots are >= 0")
    return slots


_U64 = (1 << 64) - 1


def _check_batch(n: int, what: str) -> None:
    if n > MAX_BATCH_KEYS:
        raise invalid(f"{what}: {n} keys in one call; at most {MAX_BATCH_KEYS}")


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


# -- keys ----------------------------------------------------------------------------


def exists_keys(hashes: Any) -> KeyBatch:
    """``hashes`` as a ``KeyBatch``; EMS_INVALID_ARGUMENT names a bad key.

    ``hashes``: a list, tuple, numpy array (or torch tensor) of ints in the
    signed or unsigned 64-bit range, or of ``bytes`` of at most 32 bytes; at
    most ``MAX_BATCH_KEYS`` of them. An empty sequence is valid.
    """
    hashes = _from_torch(hashes, "hashes")
    if not isinstance(hashes, list | tuple | np.ndarray):
        raise invalid(f"hashes must be a list, tuple or array of ints or bytes, "
                      f"got {type(hashes).__name__}")
    if isinstance(hashes, np.ndarray) and hashes.ndim != 1:
        raise invalid(f"hashes must be 1-D, got shape {tuple(hashes.shape)}")
    _check_batch(len(hashes), "hashes")
    try:
        return KeyBatch.from_user(cast(Sequence[int | bytes], hashes))
    except KeyError_ as exc:
        raise invalid(str(exc)) from None


def _digest_batch(digests: list[bytes]) -> KeyBatch:
    """32-byte digests as bytes keys (tag 32), without a per-key Python loop."""
    n = len(digests)
    words = np.frombuffer(b"".join(digests), dtype="<u8").reshape(n, 4).astype(np.uint64)
    tags = np.full(n, MAX_KEY_BYTES, dtype=np.uint8)  # 32-byte bytes keys
    return KeyBatch(words, tags)


# -- requests ------------------------------------------------------------------------


def hash_request(slot_mapping: Any, hashes: Any, offsets: Any) -> BatchRequest:
    """A hash-semantics request: ``hashes[j]`` owns the next ``offsets[j]`` slots.

    Rules: ``slot_mapping`` 1-D ints ``>= 0``; ``hashes`` as in ``exists_keys``;
    ``offsets`` 1-D ints ``> 0``; ``len(hashes) == len(offsets)``;
    ``sum(offsets) == len(slot_mapping)``. ``total = len(hashes)``.
    """
    one = _one_int_key(slot_mapping, hashes, offsets)
    if one is not None:
        return one
    keys = exists_keys(hashes)
    counts = as_int_array(offsets, "offsets")
    if counts.shape[0] != len(keys):
        raise invalid(f"len(hashes) = {len(keys)} but len(offsets) = {counts.shape[0]}; "
                      "they must be equal (one offset per hash)")
    slots = _slots(slot_mapping)
    if counts.size:
        if int(counts.min()) <= 0:
            i = int(np.argmax(counts <= 0))
            raise invalid(f"offsets[{i}] = {int(counts[i])}; offsets must be > 0")
        # Bound each offset first, so the sum of up to MAX_BATCH_KEYS cannot overflow.
        if int(counts.max()) > slots.shape[0]:
            i = int(np.argmax(counts > slots.shape[0]))
            raise invalid(f"offsets[{i}] = {int(counts[i])} exceeds len(slot_mapping) = "
                          f"{slots.shape[0]}; sum(offsets) must equal len(slot_mapping)")
    total_slots = int(counts.sum())
    if total_slots != slots.shape[0]:
        raise invalid(f"sum(offsets) = {total_slots} must equal len(slot_mapping) = "
                      f"{slots.shape[0]}")
    return BatchRequest(keys, slots, counts, None, len(keys))


def _one_int_key(slot_mapping: Any, hashes: Any, offsets: Any) -> BatchRequest | None:
    """``hash_request`` of the usual one-block call (lists: one int hash, one int offset,
    its slots) in scalar steps, the same request the general path builds; None for anything
    else, valid or not (the general path then decides, and names what is wrong)."""
    if not (type(hashes) is list and type(offsets) is list and type(slot_mapping) is list
            and len(hashes) == 1 == len(offsets)):
        return None
    h, c = hashes[0], offsets[0]
    if type(h) is not int or type(c) is not int or c <= 0 or c != len(slot_mapping) \
            or not -(1 << 63) <= h <= _U64:
        return None
    try:
        slots = np.frombuffer(array.array("q", slot_mapping), dtype=np.int64)
    except (TypeError, OverflowError):
        return None
    if min(slot_mapping) < 0:
        return None
    slots.setflags(write=False)
    word = h & _U64
    keys = KeyBatch(np.array([[word, 0, 0, 0]], dtype=np.uint64), ONE_INT_TAG,
                    word.to_bytes(8, "little"))  # KeyBatch.from_ints, in fewer steps
    counts = _ONE_COUNT.get(c)
    if counts is None:
        counts = _readonly(np.array([c], dtype=np.int64))
        if len(_ONE_COUNT) < 64:  # a connector uses one or two block sizes
            _ONE_COUNT[c] = counts
    return BatchRequest(keys, slots, counts, None, 1)


# Read-only arrays the one-block requests share (nothing writes a request's arrays): the counts
# of one key by its slot count (the tag of one int key is emsd.pool.keys.ONE_INT_TAG).
_ONE_COUNT: dict[int, np.ndarray] = {}


SHORT_SLOTS = 64  # a one-block call's slots: one block's tokens (vLLM: 16)


def slots_within(slot_mapping: Any, num_slots: int) -> bool:
    """Whether ``slot_mapping``, a non-empty list of at most ``SHORT_SLOTS`` integers
    (``hash_request`` has checked its entries), has its least and greatest entries ints in
    ``[0, num_slots)``: the slot check of the usual one-block call's list in a few scalar
    steps. False for anything else, valid or not: the caller then checks in full
    (``KvLayout.check_slots``), which names what is wrong, and which is the cheaper of the
    two past a few dozen slots (Python's min and max walk the list)."""
    if type(slot_mapping) is not list or not 0 < len(slot_mapping) <= SHORT_SLOTS:
        return False
    try:
        lo, hi = min(slot_mapping), max(slot_mapping)
    except TypeError:
        return False
    return type(lo) is int and type(hi) is int and lo >= 0 and hi < num_slots


def _mask_zeros(mask: np.ndarray) -> int:
    """Number of leading zeros of a 0/1 mask of the form zeros-then-ones."""
    if mask.size == 0:
        return 0
    if int(mask.min()) < 0 or int(mask.max()) > 1:
        raise invalid("mask must hold only 0 and 1 (or bools)")
    if mask.size > 1 and int(np.diff(mask).min()) < 0:
        raise invalid("mask must be zeros followed by ones (0 = cached prefix to skip, "
                      "1 = the rest); a 1 is followed by a 0")
    return int(mask.size - np.count_nonzero(mask))


def token_request(slot_mapping: Any, token_ids: Any, mask: Any, block_size: int,
                  for_save: bool) -> BatchRequest:
    """A token-semantics request (see the module docstring for the chunk rules).

    ``token_ids``, ``mask`` (or ``None`` for all ones) and ``slot_mapping``
    have equal length; ``block_size`` is the registered layout's, ``> 0``.
    ``for_save`` selects how a chunk straddling the mask boundary is treated:
    saved whole, or loaded with ``skip``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) \
            or block_size <= 0:
        raise invalid(f"block_size must be an int > 0, got {block_size!r}")
    bs = int(block_size)
    tokens = as_int_array(token_ids, "token_ids")
    slots = as_int_array(slot_mapping, "slot_mapping")
    n = tokens.shape[0]
    if slots.shape[0] != n:
        raise invalid(f"len(slot_mapping) = {slots.shape[0]} must equal len(token_ids) = {n}")
    if mask is None:
        n0 = 0
    else:
        m = as_int_array(mask, "mask", allow_bool=True)
        if m.shape[0] != n:
            raise invalid(f"len(mask) = {m.shape[0]} must equal len(token_ids) = {n}")
        n0 = _mask_zeros(m)
    first = n0 // bs  # the first chunk that ends after the zero prefix
    n_chunks = -(-n // bs)
    if n0 == n:
        first = n_chunks
    _check_batch(n_chunks - first, "token_ids")
    start = first * bs
    used = slots[start:]
    if used.size and int(used.min()) < 0:
        i = start + int(np.argmax(used < 0))
        raise invalid(f"slot_mapping[{i}] = {int(slots[i])} is negative; slots are >= 0")
    every = chunk_keys(tokens, bs)
    digests = every[first:] if first < n_chunks else []
    prev = _digest_batch([every[first - 1]]) if 0 < first <= len(every) and digests else None
    k = len(digests)
    counts = np.full(k, bs, dtype=np.int64)
    if k and n % bs:
        counts[-1] = n % bs
    skip = None
    if not for_save and k and n0 > start:
        skip = np.zeros(k, dtype=np.int64)
        skip[0] = n0 - start
        skip = _readonly(skip)
    return BatchRequest(_digest_batch(digests), _readonly(np.array(used)), _readonly(counts),
                        skip, k, prev)


def request_part(req: BatchRequest, sizes: np.ndarray, start: int, most: int) -> BatchRequest:
    """The part of ``req`` from key ``start`` on that holds at most ``most`` bytes of blocks
    (``sizes``: each key's bytes; 0: no limit), at least one key: a call of its own for those
    keys, which continues the chain of the key before it (``prev``), as ``req`` does for its
    first. ``req`` itself when that is all of it."""
    n = len(sizes)
    if most <= 0:
        end = n
    else:
        fit = int(np.searchsorted(np.cumsum(sizes[start:], dtype=np.int64), most, side="right"))
        end = start + max(1, fit)
    if start == 0 and end == n:
        return req
    starts = np.concatenate(([0], np.cumsum(req.counts)))
    return BatchRequest(req.keys.take(slice(start, end)), req.slots[starts[start]:starts[end]],
                        req.counts[start:end], None if req.skip is None else req.skip[start:end], req.total,
                        req.prev if start == 0 else req.keys.take(slice(start - 1, start)))
