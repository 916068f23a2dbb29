"""Memory per entry of the pool's index against a Python dict of tuples.

Inserts ``--entries`` (default 1,000,000) blocks with random 32-byte keys (the
shape of vLLM block hashes) in one namespace, in batches of 1024, into:

  (a) ``emsd.pool.index.BlockIndex``: numpy arrays, an open-addressing table;
  (b) the reference: ``dict[(ns, key bytes)] -> (offset, length, state, pins,
      last_used, class)``, what a straightforward daemon would keep.

Reports the growth of the process's resident set (psutil) divided by the
number of entries, and for (a) also the bytes its arrays allocate (the
entry arrays' capacity is a power of two, the table's home range too; pages
not yet touched cost no RSS). Both run in this one process, (a) first, after
a small warm-up run: its large arrays are anonymous mappings given back when
freed, so (b) starts from a clean baseline.

Run: ``.venv/bin/python benchmarks/bench_index_memory.py [--entries N] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import psutil

from emsd.pool.index import READY, BlockIndex
from emsd.pool.keys import KeyBatch

BATCH = 1024


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def key_batches(n: int, seed: int = 0):
    """(start, (k, 4) uint64 words) batches of random 32-byte keys."""
    rng = np.random.default_rng(seed)
    for start in range(0, n, BATCH):
        k = min(BATCH, n - start)
        yield start, rng.integers(0, 2**63, size=(k, 4), dtype=np.int64).astype(np.uint64)


def fill_index(n: int) -> BlockIndex:
    idx = BlockIndex()
    for start, words in key_batches(n):
        k = words.shape[0]
        keys = KeyBatch(words, np.full(k, 32, dtype=np.uint8))
        offsets = np.arange(start, start + k, dtype=np.uint32)
        idx.insert(0, keys, offsets, np.full(k, 4096, dtype=np.uint32), READY, 1)
    return idx


def measure_index(n: int) -> dict[str, float]:
    fill_index(10_000)  # warm-up: numpy's lazily loaded code and caches are not per entry
    before = rss()
    t0 = time.perf_counter()
    idx = fill_index(n)
    seconds = time.perf_counter() - t0
    grown = rss() - before
    assert len(idx) == n
    out = {"entries": n, "rss_bytes": grown, "rss_per_entry": grown / n,
           "allocated_per_entry": idx.nbytes() / n, "table_slots": idx.table.size,
           "insert_seconds": seconds}
    del idx
    return out


def measure_dict(n: int) -> dict[str, float]:
    before = rss()
    t0 = time.perf_counter()
    ref: dict[tuple[int, bytes], tuple[int, int, int, int, int, int]] = {}
    for start, words in key_batches(n):
        raw = words.tobytes()
        for i in range(words.shape[0]):
            ref[(0, raw[32 * i : 32 * i + 32])] = (64 * (start + i), 4096, READY, 0, 1, 3)
    seconds = time.perf_counter() - t0
    grown = rss() - before
    assert len(ref) == n
    out = {"entries": n, "rss_bytes": grown, "rss_per_entry": grown / n,
           "insert_seconds": seconds}
    del ref
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results = {"index": measure_index(args.entries), "dict": measure_dict(args.entries)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'structure':34s} {'entries':>9s} {'RSS MiB':>8s} {'B/entry':>8s} "
          f"{'alloc B/entry':>13s} {'insert s':>8s}")
    for name, label in (("index", "BlockIndex (numpy arrays)"),
                        ("dict", "dict[(ns, key)] -> tuple")):
        r = results[name]
        alloc = f"{r['allocated_per_entry']:13.1f}" if "allocated_per_entry" in r else " " * 13
        print(f"{label:34s} {r['entries']:9d} {r['rss_bytes'] / 2**20:8.1f} "
              f"{r['rss_per_entry']:8.1f} {alloc} {r['insert_seconds']:8.2f}")


if __name__ == "__main__":
    main()
