"""Redis over loopback TCP with redis-py and hiredis: SET/GET one block a call, or a
pipeline of SETs and one MGET for a batch. A get copies the returned bytes into the
destination buffer, as a KV-cache consumer has to.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import redis


class RedisClient:
    def __init__(self, port: int, volume: int) -> None:
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.ping()
        self.buffer = np.ones(2 * volume, dtype=np.uint8)
        self.half = volume
        self.size = 0

    def prepare(self, size: int, n: int) -> None:
        self.size = size

    def _src(self, i: int) -> memoryview:
        return memoryview(self.buffer[i * self.size : (i + 1) * self.size])

    def put(self, keys: list[int], first: int) -> None:
        if len(keys) == 1:
            self.r.set(keys[0], self._src(first))
            return
        pipe = self.r.pipeline(transaction=False)
        for j, k in enumerate(keys):
            pipe.set(k, self._src(first + j))
        pipe.execute()

    def get(self, keys: list[int], first: int) -> None:
        values = [self.r.get(keys[0])] if len(keys) == 1 else self.r.mget(keys)
        for j, v in enumerate(values):
            if v is None or len(v) != self.size:
                raise RuntimeError(f"redis GET {keys[j]}: {'missing' if v is None else len(v)}")
            at = self.half + (first + j) * self.size
            self.buffer[at : at + self.size] = np.frombuffer(v, np.uint8)

    def drop(self, keys: list[int]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


def open_client(options: dict[str, Any]) -> RedisClient:
    return RedisClient(int(options["port"]), int(options["volume"]))
