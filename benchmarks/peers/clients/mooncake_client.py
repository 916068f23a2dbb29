"""Mooncake Store's Python client, MooncakeDistributedStore, against a mooncake_master
and a mooncake_client daemon in the same private network namespace.

mode "shm": ``setup_dummy`` (a "dummy client" of the local daemon, over shared
  memory); the buffer comes from ``alloc_from_mem_pool`` and is registered with
  ``register_buffer``, so ``put_from``/``get_into`` and their batch forms are
  zero-copy (with any other buffer the calls return -600).
mode "tcp": ``setup`` with the P2P handshake and the TCP transfer engine, holding
  no segment of its own (global_segment_size 0), so every value crosses TCP to the
  daemon's segment; the buffer is a numpy array registered with ``register_buffer``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore


class MooncakeClient:
    def __init__(self, mode: str, master: str, client: str, volume: int) -> None:
        self.store = MooncakeDistributedStore()
        nbytes = 2 * volume
        if mode == "shm":
            rc = self.store.setup_dummy(nbytes + (64 << 20), 64 << 20, client)
            _check("setup_dummy", rc)
            ptr = self.store.alloc_from_mem_pool(nbytes)
            if not ptr:
                raise RuntimeError(f"alloc_from_mem_pool({nbytes}) returned 0")
            self.buffer = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        elif mode == "tcp":
            rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master)
            _check("setup", rc)
            self.buffer = np.ones(nbytes, dtype=np.uint8)
        else:
            raise ValueError(f"mooncake mode must be 'shm' or 'tcp', got {mode!r}")
        self.buffer[:] = 1
        self.base = int(self.buffer.ctypes.data)
        _check("register_buffer", self.store.register_buffer(self.base, nbytes))
        self.half = volume
        self.size = 0
        self.pending: list[str] = []  # removed later: a key read less than a lease ago cannot be

    def prepare(self, size: int, n: int) -> None:
        self.size = size

    def put(self, keys: list[int], first: int) -> None:
        size = self.size
        if len(keys) == 1:
            _check(f"put_from {keys[0]}", self.store.put_from(str(keys[0]), self.base + first * size, size))
            return
        ptrs = [self.base + (first + j) * size for j in range(len(keys))]
        for k, rc in zip(keys, self.store.batch_put_from([str(k) for k in keys], ptrs, [size] * len(keys)),
                         strict=True):
            _check(f"batch_put_from {k}", rc)

    def get(self, keys: list[int], first: int) -> None:
        size, dst = self.size, self.base + self.half
        if len(keys) == 1:
            got = [self.store.get_into(str(keys[0]), dst + first * size, size)]
        else:
            ptrs = [dst + (first + j) * size for j in range(len(keys))]
            got = self.store.batch_get_into([str(k) for k in keys], ptrs, [size] * len(keys))
        for k, n in zip(keys, got, strict=True):
            if n != size:
                raise RuntimeError(f"mooncake get {k} returned {n}, expected {size} bytes")

    def drop(self, keys: list[int]) -> None:
        """Remove this cell's keys and any earlier ones still leased (-706 OBJECT_HAS_LEASE then).

        A get leases its object (the master's --default_kv_lease_ttl); until the lease ends a
        remove fails, so such keys are retried at the next drop instead of filling the segment.
        """
        self.pending += [str(k) for k in keys]
        codes = self.store.batch_remove(self.pending)
        self.pending = [k for k, rc in zip(self.pending, codes, strict=True) if rc == -706]

    def close(self) -> None:
        self.store.close()


def _check(what: str, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake {what} returned {rc}")


def open_client(options: dict[str, Any]) -> MooncakeClient:
    return MooncakeClient(options["mode"], options["master"], options["client"], int(options["volume"]))
