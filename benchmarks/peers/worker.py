"""One system's client process: runs benchmark cells on command, one JSON line each way.

    python worker.py SYSTEM 'JSON-OPTIONS'

The harness (``benchmarks/peers/__main__.py``) starts one worker per system,
each in the Python that system's client library needs (Mooncake and LMCache
live in venvs of their own), and sends it lines such as

    {"cmd": "cell", "size": 2097152, "batch": 16, "volume": 67108864, "tag": 7}

The worker fills ``volume // size`` blocks of its source buffer, stamps each
with ``tag`` (so a stale value from an earlier cell cannot pass), puts them
(one call per block, or ``batch`` blocks per call), zeroes its destination
buffer, gets them back, checks every byte, and answers

    {"put": [seconds per call...], "get": [seconds per call...]}

or ``{"error": "..."}``. Only the put and get calls are timed; filling,
zeroing, checking and dropping are not. Workers import only the standard
library, numpy and their own system's client, found as
``clients/<SYSTEM>_client.py`` beside this file; that module defines
``open_client(options) -> Client``.

A ``Client`` owns one buffer of ``2 * volume`` bytes (``buffer``: src half,
dst half) and implements ``prepare(size, n)`` (called when the block size
changes, untimed), ``put(keys, first)`` / ``get(keys, first)`` (blocks
``first .. first+len(keys)-1`` of src / into dst; raise on any failure),
optionally ``plan(keys)`` (untimed, once per cell before the puts),
``drop(keys)`` (untimed; free the store's memory) and ``close()``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Client(Protocol):
    buffer: np.ndarray  # uint8, 2 * volume bytes

    def prepare(self, size: int, n: int) -> None: ...
    def put(self, keys: list[int], first: int) -> None: ...
    def get(self, keys: list[int], first: int) -> None: ...
    def drop(self, keys: list[int]) -> None: ...
    def close(self) -> None: ...


def calls(n: int, batch: int) -> list[range]:
    """Block index ranges, one per call: ``batch`` blocks per call, the last maybe fewer."""
    if n < 1 or batch < 1:
        raise ValueError(f"need n >= 1 and batch >= 1, got n={n} batch={batch}")
    return [range(i, min(i + batch, n)) for i in range(0, n, batch)]


def run_cell(client: Client, size: int, batch: int, volume: int, tag: int,
             state: dict[str, int]) -> dict[str, Any]:
    """One cell: put then get ``volume // size`` blocks of ``size`` bytes; per-call seconds."""
    n = volume // size
    if n < 1 or 2 * n * size > client.buffer.size:
        raise ValueError(f"size {size} does not fit volume {volume} in a buffer of {client.buffer.size}")
    if state.get("size") != size:
        client.prepare(size, n)
        state["size"] = size
    src = client.buffer[: n * size].reshape(n, size)
    dst = client.buffer[volume : volume + n * size].reshape(n, size)
    src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)  # block index
    src[:, 8:16] = np.frombuffer(np.uint64(tag).tobytes(), np.uint8)
    keys = [tag * 1_000_000 + i for i in range(n)]
    put, get = [], []
    if hasattr(client, "plan"):
        client.plan(keys)
    for r in calls(n, batch):
        t0 = time.perf_counter()
        client.put(keys[r.start : r.stop], r.start)
        put.append(time.perf_counter() - t0)
    dst[:] = 0
    for r in calls(n, batch):
        t0 = time.perf_counter()
        client.get(keys[r.start : r.stop], r.start)
        get.append(time.perf_counter() - t0)
    if not np.array_equal(src, dst):
        bad = int(np.argmax((src != dst).any(axis=1)))
        raise RuntimeError(f"block {bad} of {n} ({size} bytes) came back different")
    client.drop(keys)
    return {"put": put, "get": get}


def serve(client: Client, inp: Any = sys.stdin, out: Any = sys.stdout) -> None:
    """Answer cell commands until ``{"cmd": "quit"}`` or end of input."""
    state: dict[str, int] = {}
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in inp:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            break
        try:
            reply = run_cell(client, int(msg["size"]), int(msg["batch"]), int(msg["volume"]), int(msg["tag"]),
                             state)
        except Exception as exc:  # noqa: BLE001 - reported to the harness, which names the system
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    client.close()


def main() -> None:
    system, options = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
    module = importlib.import_module(f"{system}_client")
    # Replies go to a private copy of fd 1; fd 1 itself (and sys.stdout) go to stderr, so a
    # client library that prints, from Python or C, cannot corrupt the reply stream.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        client = module.open_client(options)
    except Exception as exc:  # noqa: BLE001
        why = f"{system} did not start: {type(exc).__name__}: {exc}"
        real_stdout.write(json.dumps({"error": why}) + "\n")
        real_stdout.flush()
        raise SystemExit(1) from exc
    serve(client, sys.stdin, real_stdout)


if __name__ == "__main__":
    main()
