"""StagedValues: fixed-size byte values through a staging buffer this package owns.

For engines that hand over values in memory the SDK cannot register (a new
tensor per call): ``put`` copies each value into a slot of a staging buffer
and saves the slots; ``get`` loads slots and hands each value to a callback
while the slot is valid. Every stored value is exactly ``value_bytes`` long
(shorter values are zero-padded: the caller records real lengths inside the
value when it needs them), so a load knows the size to ask for, and a value
of another size (another model, another chunk size) is a miss.

One staging buffer of ``batch_values`` slots per instance, used under a
lock: calls from several threads take turns; a batch larger than the buffer
runs as several SDK calls. Fails open like ``RegionStore``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ems.config import EmsConfig
from ems.integrations.region_store import RegionStore


class StagedValues:
    """``value_bytes``-sized values in emsd via a ``batch_values``-slot staging buffer.

    Raises ``ValueError`` when ``value_bytes`` or ``batch_values`` is not positive.
    """

    def __init__(self, config: EmsConfig, value_bytes: int, batch_values: int = 8,
                 **store_options: Any) -> None:
        if value_bytes <= 0 or batch_values <= 0:
            raise ValueError(f"value_bytes ({value_bytes}) and batch_values ({batch_values}) "
                             "must be positive")
        self.value_bytes = int(value_bytes)
        self.batch_values = int(batch_values)
        self._buf = bytearray(self.value_bytes * self.batch_values)
        self._view = np.frombuffer(self._buf, dtype=np.uint8)
        self.store = RegionStore(config, self._buf, len(self._buf), self.value_bytes, **store_options)
        self._lock = threading.Lock()

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> int:
        """Store ``values[i]`` under ``keys[i]``; returns how many leading keys are stored.

        A value is bytes-like, or a list/tuple of bytes-like parts stored
        concatenated (a header and a payload, without joining them first).
        A value longer than ``value_bytes`` stops the batch there (it is not
        stored).
        """
        done = 0
        with self._lock:
            for start in range(0, len(keys), self.batch_values):
                chunk = keys[start:start + self.batch_values]
                filled = self._fill(values[start:start + len(chunk)])
                if filled:
                    done += self.store.save(chunk[:filled], self._segments(filled))
                if done < start + len(chunk):
                    break
        return done

    def get(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], bool]) -> int:
        """Load the leading stored keys; ``consume(i, value)`` for each, in order.

        ``value`` is a read-only view of ``value_bytes`` bytes, valid only
        during the callback. ``consume`` returning False stops there. Returns
        how many keys were loaded and consumed.
        """
        done = 0
        with self._lock:
            for start in range(0, len(keys), self.batch_values):
                chunk = keys[start:start + self.batch_values]
                hits = self.store.load(chunk, self._segments(len(chunk)))
                for i in range(hits):
                    lo = i * self.value_bytes
                    value = memoryview(self._buf)[lo:lo + self.value_bytes].toreadonly()
                    try:
                        if not consume(start + i, value):
                            return done
                    finally:
                        value.release()
                    done += 1
                if hits < len(chunk):
                    break
        return done

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading keys emsd holds."""
        return self.store.exists(keys)

    def clear(self) -> bool:
        """Drop every stored value (``RegionStore.clear``); True once emsd confirmed it."""
        return self.store.clear()

    def close(self) -> None:
        self.store.close()

    def _fill(self, values: Sequence[Any]) -> int:
        """Copy the leading values that fit into the staging slots; how many were copied."""
        for i, value in enumerate(values):
            parts = value if isinstance(value, list | tuple) else (value,)
            srcs = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts]
            if sum(src.size for src in srcs) > self.value_bytes:
                return i
            at = lo = i * self.value_bytes
            for src in srcs:
                self._view[at:at + src.size] = src
                at += src.size
            self._view[at:lo + self.value_bytes] = 0
        return len(values)

    def _segments(self, n: int) -> list[list[tuple[int, int]]]:
        base, size = self.store.base, self.value_bytes
        return [[(base + i * size, size)] for i in range(n)]
