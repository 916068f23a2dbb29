"""Block keys in their canonical, fixed-width form.

A key names one KV block inside a namespace. Users give either an int (a
64-bit hash, signed or unsigned: published connectors use Python's ``hash()``)
or ``bytes`` of at most 32 bytes (vLLM's block hashes are 32-byte digests).

Every key is stored as four little-endian uint64 words plus a one-byte tag:

- tag ``INT_TAG`` (255): an int key, taken modulo 2**64 (two's complement),
  in ``words[0]``; the other words are 0. So ``-1`` and ``2**64 - 1`` name the
  same block.
- tag 0..32: a bytes key of that length, zero-padded to 32 bytes.

The tag keeps ``5`` and ``b"\\x05"`` apart, and ``b"a"`` apart from
``b"a\\x00"``. The form is exact (no digest), so two different keys can never
collide. Batches of keys are numpy arrays so that the index hashes and
compares them with vectorised operations.

Wire forms (see ``emsd.transport.frames``):

- ``KT_INT``: n x 8 bytes, little-endian uint64 (all keys are ints);
- ``KT_TAGGED``: n x 33 bytes, per key one tag byte then 32 key bytes.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

INT_TAG = 255
MAX_KEY_BYTES = 32
ONE_INT_TAG = np.array((INT_TAG,), dtype=np.uint8)  # one int key's tags, shared: no batch writes its tags
ONE_INT_TAG.setflags(write=False)
KT_INT = 0
KT_TAGGED = 1
_U64_MASK = (1 << 64) - 1
_TAGGED = np.dtype([("tag", "u1"), ("key", "V32")])
_LE_U8 = np.dtype("<u8")  # made once: numpy parses a dtype string on every call
TAGGED_ITEMSIZE = _TAGGED.itemsize  # 33


class KeyError_(ValueError):
    """A key that is not an int in the 64-bit range or bytes of <= 32 bytes."""


@dataclass(frozen=True)
class KeyBatch:
    """``n`` keys in canonical form: ``words`` (n, 4) uint64, ``tags`` (n,) uint8."""

    words: np.ndarray
    tags: np.ndarray
    # The KT_INT wire bytes when the batch came from int keys: the SDK's hot
    # path (exists/pin of hundreds of int hashes) then skips re-encoding.
    wire: bytes | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.tags.shape[0])

    def take(self, idx: np.ndarray | slice) -> KeyBatch:
        """The keys at ``idx`` (a slice, an index array or a boolean mask), as a batch.

        A selection of every key in order gives this batch itself (batches are never
        changed in place), ``wire`` bytes included: a slice of all of them, or index 0 of
        a batch of one (the one block a call that a PIN hands to a fetch, whose request
        then encodes no keys anew)."""
        n = len(self)
        if isinstance(idx, slice):
            if idx.indices(n) == (0, n, 1):
                return self
        elif n == 1 and idx.size == 1 and idx.dtype.kind in "iu" and idx[0] == 0:
            return self
        return KeyBatch(np.ascontiguousarray(self.words[idx]), np.ascontiguousarray(self.tags[idx]))

    def key(self, i: int) -> int | bytes:
        """Key ``i`` back in user form (an unsigned int, or bytes)."""
        tag = int(self.tags[i])
        if tag == INT_TAG:
            return int(self.words[i, 0])
        return self.words[i].tobytes()[:tag]

    # -- construction -------------------------------------------------------

    @classmethod
    def from_ints(cls, values: np.ndarray, wire: bytes | None = None) -> KeyBatch:
        """Int keys already reduced to uint64 (``wire``: their KT_INT bytes, if known)."""
        n = values.shape[0]
        words = np.zeros((n, 4), dtype=np.uint64)
        if n == 1:  # one block a call: scalar steps, and the one int key's tag array shared (read-only)
            words[0, 0] = values[0]
            return cls(words, ONE_INT_TAG, wire)
        words[:, 0] = values
        return cls(words, np.full(n, INT_TAG, dtype=np.uint8), wire)

    @classmethod
    def from_user(cls, keys: Sequence[int | bytes]) -> KeyBatch:
        """Canonical form of user keys; raises ``KeyError_`` naming the bad one."""
        ints = _try_int_array(keys)
        if ints is not None:
            return cls.from_ints(ints, ints.astype("<u8", copy=False).tobytes())
        n = len(keys)
        raw = np.zeros(n, dtype=_TAGGED)
        for i, k in enumerate(keys):
            if isinstance(k, int):
                if not -(1 << 63) <= k <= _U64_MASK:
                    raise KeyError_(f"hashes[{i}] = {k} is outside the signed/unsigned 64-bit range")
                raw[i] = (INT_TAG, (k & _U64_MASK).to_bytes(8, "little").ljust(32, b"\0"))
            elif isinstance(k, bytes | bytearray | memoryview):
                b = bytes(k)
                if len(b) > MAX_KEY_BYTES:
                    raise KeyError_(f"hashes[{i}] has {len(b)} bytes; at most {MAX_KEY_BYTES}")
                raw[i] = (len(b), b.ljust(32, b"\0"))
            else:
                raise KeyError_(f"hashes[{i}] is a {type(k).__name__}; a key is an int or bytes")
        return cls.from_tagged(raw.tobytes())

    # -- wire ---------------------------------------------------------------

    def to_wire(self) -> tuple[int, bytes]:
        """(key type, payload bytes) in the most compact wire form."""
        if self.wire is not None:
            return KT_INT, self.wire
        if bool(np.all(self.tags == INT_TAG)):
            return KT_INT, self.words[:, 0].astype("<u8").tobytes()
        raw = np.empty(len(self), dtype=_TAGGED)
        raw["tag"] = self.tags
        raw["key"] = self.words.astype("<u8").view("V32").reshape(-1)
        return KT_TAGGED, raw.tobytes()

    @classmethod
    def from_wire(cls, kt: int, data: bytes | memoryview, n: int) -> KeyBatch:
        """Decode ``n`` keys; raises ``KeyError_`` on a size or tag mismatch."""
        if kt == KT_INT:
            if len(data) != 8 * n:
                raise KeyError_(f"int key payload has {len(data)} bytes, expected {8 * n}")
            # copied into the words; bytes are kept as the batch's wire form (to_wire)
            return cls.from_ints(np.frombuffer(data, dtype=_LE_U8), data if type(data) is bytes else None)
        if kt == KT_TAGGED:
            if len(data) != TAGGED_ITEMSIZE * n:
                raise KeyError_(
                    f"tagged key payload has {len(data)} bytes, expected {TAGGED_ITEMSIZE * n}"
                )
            return cls.from_tagged(data)
        raise KeyError_(f"unknown key type {kt}")

    @classmethod
    def from_tagged(cls, data: bytes | memoryview) -> KeyBatch:
        raw = np.frombuffer(data, dtype=_TAGGED)
        tags = raw["tag"].copy()
        bad = (tags > MAX_KEY_BYTES) & (tags != INT_TAG)
        if bool(bad.any()):
            raise KeyError_(f"key {int(np.argmax(bad))} has invalid tag {int(tags[bad][0])}")
        words = np.frombuffer(raw["key"].tobytes(), dtype="<u8").reshape(-1, 4).astype(np.uint64)
        _check_padding(words, tags)
        return cls(words, tags)


def _check_padding(words: np.ndarray, tags: np.ndarray) -> None:
    """Bytes past a key's length must be zero, so each key has one form."""
    if len(tags) == 0:
        return
    as_bytes = words.view(np.uint8).reshape(-1, 32)
    lengths = np.where(tags == INT_TAG, 8, tags).astype(np.int64)
    beyond = np.arange(32)[None, :] >= lengths[:, None]
    if bool((as_bytes[beyond] != 0).any()):
        raise KeyError_("key bytes past the key's length are not zero")


def _try_int_array(keys: Sequence[int | bytes]) -> np.ndarray | None:
    """uint64 array when every key is an int in range, else None (the slow path decides).

    ``array.array`` converts strictly (no floats, no silent truncation) and far
    faster than a Python loop. Like Python's own ``hash``, ``True`` is the key 1.
    """
    if isinstance(keys, np.ndarray):
        if keys.ndim == 1 and keys.dtype.kind == "i":
            return keys.astype(np.int64).view(np.uint64)
        if keys.ndim == 1 and keys.dtype.kind == "u":
            return keys.astype(np.uint64)
        return None
    for code in ("q", "Q"):
        try:
            return np.frombuffer(array.array(code, keys), dtype=np.uint64).copy()  # type: ignore[type-var]
        except (TypeError, OverflowError):
            continue
    return None
