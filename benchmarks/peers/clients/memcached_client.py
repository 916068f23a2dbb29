"""memcached over loopback TCP with pymemcache: set/get one block a call, or
set_many/get_many for a batch. A get copies the returned bytes into the
destination buffer, as a KV-cache consumer has to.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pymemcache.client.base import Client as Memcache


class MemcachedClient:
    def __init__(self, port: int, volume: int) -> None:
        self.mc = Memcache(("127.0.0.1", port), no_delay=True)
        self.mc.version()
        self.buffer = np.ones(2 * volume, dtype=np.uint8)
        self.half = volume
        self.size = 0

    def prepare(self, size: int, n: int) -> None:
        self.size = size

    def _src(self, i: int) -> bytes:
        return self.buffer[i * self.size : (i + 1) * self.size].tobytes()  # pymemcache wants bytes

    def put(self, keys: list[int], first: int) -> None:
        if len(keys) == 1:
            ok = self.mc.set(str(keys[0]), self._src(first), noreply=False)
            failed = [] if ok else keys
        else:
            values = {str(k): self._src(first + j) for j, k in enumerate(keys)}
            failed = self.mc.set_many(values, noreply=False)
        if failed:
            raise RuntimeError(f"memcached refused {len(failed)} values of {self.size} bytes "
                               "(item size limit?)")

    def get(self, keys: list[int], first: int) -> None:
        if len(keys) == 1:
            got = {str(keys[0]): self.mc.get(str(keys[0]))}
        else:
            got = self.mc.get_many([str(k) for k in keys])
        for j, k in enumerate(keys):
            v = got.get(str(k))
            if v is None or len(v) != self.size:
                raise RuntimeError(f"memcached get {k}: {'missing' if v is None else len(v)}")
            at = self.half + (first + j) * self.size
            self.buffer[at : at + self.size] = np.frombuffer(v, np.uint8)

    def drop(self, keys: list[int]) -> None:
        self.mc.delete_many([str(k) for k in keys], noreply=True)

    def close(self) -> None:
        self.mc.close()


def open_client(options: dict[str, Any]) -> MemcachedClient:
    return MemcachedClient(int(options["port"]), int(options["volume"]))
