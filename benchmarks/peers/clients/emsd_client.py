"""emsd through its SDK over shared memory: the SDK maps the daemon's pool and copies
between the registered buffer and the pool in its own process; the daemon only hands
out places (one control round trip per call, whatever the batch).

The buffer is registered as one uint8 tensor of ``2n`` one-slot blocks of ``size``
bytes: blocks ``0..n-1`` are the source, ``n..2n-1`` the destination. So a value is
one contiguous run of ``size`` bytes, as for every other system here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: bench_sdk's helpers
from bench_sdk import connect, wait_filled  # noqa: E402


class EmsdClient:
    def __init__(self, sock_dir: Path, volume: int) -> None:
        self.cc = connect(sock_dir)
        self.buffer = np.ones(2 * volume, dtype=np.uint8)
        self.n = 0

    def prepare(self, size: int, n: int) -> None:
        self.n = n
        self.cc.register_kvcache([[self.buffer[: 2 * n * size].reshape(2 * n, 1, size)]])
        wait_filled(self.cc)  # untimed, as an engine's start is

    def put(self, keys: list[int], first: int) -> None:
        res = self.cc.save(list(range(first, first + len(keys))), hashes=keys, offsets=[1] * len(keys))
        if res.success != len(keys):
            raise RuntimeError(f"emsd save stored {res.success} of {len(keys)}: {res}")

    def get(self, keys: list[int], first: int) -> None:
        start = self.n + first
        res = self.cc.load(list(range(start, start + len(keys))), hashes=keys, offsets=[1] * len(keys))
        if res.success != len(keys):
            raise RuntimeError(f"emsd load found {res.success} of {len(keys)}: {res}")

    def drop(self, keys: list[int]) -> None:
        pass  # the SDK has no delete; the daemon's LRU evicts old cells as new ones arrive

    def close(self) -> None:
        from ems import Ems

        Ems._reset()


def open_client(options: dict[str, Any]) -> EmsdClient:
    return EmsdClient(Path(options["sock_dir"]), int(options["volume"]))
