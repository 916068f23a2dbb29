"""KvBufferWrapper: a raw memory region registered in place of KV tensors.

Published EMS samples import ``KvBufferWrapper`` without documenting it; in
emsd it lets a process without torch register plain memory with
``register_kvcache``. A wrapper stands for one "tensor" of the KV cache: the
region is viewed as a contiguous ``[num_blocks, block_size, row_bytes]`` byte
array, one row of ``row_bytes`` per slot, slot ``s`` at byte
``s * row_bytes``.

Two ways to name the region:

- a writable, C-contiguous buffer-protocol object (``bytearray``, ``mmap``,
  a numpy array, a ``memoryview``...). The wrapper holds a buffer export on it
  for its own lifetime, so the object stays alive and cannot be resized or
  closed underneath (``bytearray`` resize and ``mmap.close()`` raise
  ``BufferError`` while the wrapper lives);
- an integer address plus ``length`` in bytes. The caller guarantees that the
  memory stays mapped and writable while the wrapper is registered.

``length`` must be a multiple of ``num_blocks * block_size``; the quotient is
``row_bytes``. Violations raise ``EmsException(EMS_INVALID_ARGUMENT)`` naming
the field and the rule.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ems.common.exception import invalid


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) <= 0:
        raise invalid(f"KvBufferWrapper: {name} must be a positive int, got {value!r}")
    return int(value)


def _export_buffer(obj: Any, length: int | None) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """Hold a writable export of ``obj``'s buffer; return (ctypes array, byte length)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise invalid(
            "KvBufferWrapper: buffer_or_address must be an int address or a buffer-protocol "
            f"object, got {type(obj).__name__}"
        ) from None
    with view:
        if view.readonly:
            raise invalid("KvBufferWrapper: the buffer must be writable (loads write into it)")
        if not view.c_contiguous:
            raise invalid("KvBufferWrapper: the buffer must be C-contiguous")
        nbytes = view.nbytes
        if length is not None and int(length) != nbytes:
            raise invalid(
                f"KvBufferWrapper: length={length} differs from the buffer's size {nbytes}; "
                "omit length for a buffer object"
            )
        if nbytes == 0:
            raise invalid("KvBufferWrapper: the buffer must not be empty")
        # from_buffer keeps its own export of the object for the array's lifetime.
        return (ctypes.c_char * nbytes).from_buffer(obj), nbytes


class KvBufferWrapper:
    """A raw region seen as ``[num_blocks, block_size, row_bytes]`` bytes; registers like a tensor.

    ``KvBufferWrapper(buffer_or_address, length=None, *, num_blocks, block_size)``.
    Attributes: ``address``, ``length``, ``num_blocks``, ``block_size``, ``row_bytes``.
    """

    __slots__ = ("_export", "_obj", "address", "block_size", "length", "num_blocks", "row_bytes")

    def __init__(
        self,
        buffer_or_address: Any,
        length: int | None = None,
        *,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        self._obj: Any = None
        self._export: ctypes.Array[ctypes.c_char] | None = None
        if isinstance(buffer_or_address, int | np.integer) and not isinstance(buffer_or_address, bool):
            address = int(buffer_or_address)
            if address <= 0:
                raise invalid(f"KvBufferWrapper: address must be positive, got {address}")
            if length is None:
                raise invalid("KvBufferWrapper: length is required with an int address")
            self.length = _positive_int(length, "length")
            self.address = address
        else:
            if length is not None:
                _positive_int(length, "length")
            self._export, self.length = _export_buffer(buffer_or_address, length)
            self._obj = buffer_or_address
            self.address = ctypes.addressof(self._export)
        slots = self.num_blocks * self.block_size
        if self.length % slots != 0:
            raise invalid(
                f"KvBufferWrapper: length ({self.length}) must be a multiple of "
                f"num_blocks * block_size ({self.num_blocks} * {self.block_size} = {slots})"
            )
        self.row_bytes = self.length // slots

    @property
    def obj(self) -> Any:
        """The wrapped buffer object, or None for an address-based wrapper."""
        return self._obj

    def numpy(self) -> np.ndarray:
        """A writable uint8 numpy view ``[num_blocks, block_size, row_bytes]`` of the region."""
        region = self._export
        if region is None:
            region = (ctypes.c_char * self.length).from_address(self.address)
        flat = np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8)
        return flat.reshape(self.num_blocks, self.block_size, self.row_bytes)

    def __repr__(self) -> str:
        return (
            f"KvBufferWrapper(address=0x{self.address:x}, length={self.length}, "
            f"num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"row_bytes={self.row_bytes})"
        )
