"""Throughput of KvLayout.save/load against torch index_select/index_copy_ and a plain memmove.

Setup (the shape of a Llama-3-8B-like vLLM KV cache on CPU): 32 layers x [K, V]
fp16 tensors of shape [num_blocks=128, block_size=16, 8 heads, 128]. A request
saves 64 keys of one vLLM block each (16 slots x 64 tensors x 2 KiB = 2 MiB a
key; key j uses block 2*j+1) into a 128 MiB anonymous mmap at scattered
(shuffled) 2 MiB offsets, then loads them back.

Also reported: the save's copy alone through the C extension with 1 or 2
threads and plain memcpy or streaming stores, and through the ctypes fallback.

Compared with:
  (a) reference: per tensor one ``torch.index_select`` of those slots into a
      preallocated buffer (save), then ``index_copy_`` back (load);
  (b) memmove: one ``ctypes.memmove`` of the same 128 MiB (the bus's ceiling).

Run: ``.venv/bin/python benchmarks/bench_copy.py [--repeat 15] [--json]``.
Times are medians over ``--repeat`` runs after one warm-up; GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ems import copy as ems_copy
from ems.layout import KvLayout

LAYERS = 32
NUM_BLOCKS = 128
BLOCK_SIZE = 16
HEADS = 8
HEAD_SIZE = 128
KEYS = 64


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page faults, caches, thread pools
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build() -> dict:
    gen = torch.Generator().manual_seed(0)
    kv = [
        [torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=gen).half() for _ in range(2)]
        for _ in range(LAYERS)
    ]
    layout = KvLayout.from_kvcache(kv)
    key_bytes = BLOCK_SIZE * layout.slot_bytes
    pool_size = KEYS * key_bytes
    pool = mmap.mmap(-1, pool_size)
    pool.write(b"\0" * pool_size)  # prefault, as the daemon does
    pool_addr = ctypes.addressof(ctypes.c_char.from_buffer(pool))
    blocks = 2 * np.arange(KEYS) + 1
    slots = (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)[None, :]).ravel()
    counts = np.full(KEYS, BLOCK_SIZE, dtype=np.int64)
    offsets = np.random.default_rng(0).permutation(KEYS).astype(np.int64) * key_bytes
    return dict(kv=kv, layout=layout, pool=pool, pool_addr=pool_addr, pool_size=pool_size,
                slots=slots, counts=counts, offsets=offsets, nbytes=pool_size)  # fmt: skip


def bench(repeat: int) -> dict:
    s = build()
    kv, layout, pool_addr = s["kv"], s["layout"], s["pool_addr"]
    slots, counts, offsets, nbytes = s["slots"], s["counts"], s["offsets"], s["nbytes"]
    tensors = [t for layer in kv for t in layer]
    results: dict[str, float] = {}

    def save() -> None:
        layout.save(pool_addr, slots, counts, offsets, pool_size=s["pool_size"])

    def load() -> None:
        layout.load(pool_addr, slots, counts, offsets, pool_size=s["pool_size"])

    results["ems_save"] = median_seconds(save, repeat)
    results["ems_load"] = median_seconds(load, repeat)

    segs = layout.segments(pool_addr, slots, counts, offsets)
    results["segments_plan"] = median_seconds(
        lambda: layout.segments(pool_addr, slots, counts, offsets), repeat
    )
    if ems_copy.COPY_IMPL == "c":  # the save's copy alone, per thread count and store kind
        for th in (1, 2):
            for nt, kind in ((0, "memcpy"), (1, "stream")):
                copy = functools.partial(
                    ems_copy.copy_segments_c, segs.pool_addr, segs.tensor_addr, segs.length, th, nt
                )
                results[f"copy_{th}t_{kind}"] = median_seconds(copy, repeat)
    results["copy_ctypes"] = median_seconds(
        lambda: ems_copy.copy_segments_ctypes(segs.pool_addr, segs.tensor_addr, segs.length),
        repeat,
    )

    # (a) reference: index_select into a preallocated buffer, index_copy_ back.
    idx = torch.from_numpy(slots)
    row = HEADS * HEAD_SIZE
    buf = torch.empty(len(tensors), len(slots), row, dtype=torch.float16)
    flats = [t.view(NUM_BLOCKS * BLOCK_SIZE, row) for t in tensors]

    def ref_save() -> None:
        for i, f in enumerate(flats):
            torch.index_select(f, 0, idx, out=buf[i])

    def ref_load() -> None:
        for i, f in enumerate(flats):
            f.index_copy_(0, idx, buf[i])

    results["ref_save"] = median_seconds(ref_save, repeat)
    results["ref_load"] = median_seconds(ref_load, repeat)

    # (b) one plain memmove of the same number of bytes, both directions.
    src = np.ones(nbytes, dtype=np.uint8)
    results["memmove_save"] = median_seconds(
        lambda: ctypes.memmove(pool_addr, src.ctypes.data, nbytes), repeat
    )
    results["memmove_load"] = median_seconds(
        lambda: ctypes.memmove(src.ctypes.data, pool_addr, nbytes), repeat
    )

    # Round trip check: save, clobber the slots, load, compare.
    before = [t.clone() for t in tensors]
    save()
    for t in tensors:
        t.view(-1, row)[idx] = 0
    load()
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True)), "round trip"

    gbps = {k: nbytes / v / 1e9 for k, v in results.items() if k != "segments_plan"}
    return {
        "bytes": nbytes,
        "segments": len(segs.length),
        "copy_impl": ems_copy.COPY_IMPL,
        "torch_threads": torch.get_num_threads(),
        "seconds": results,
        "gbps": gbps,
        "ratio_vs_ref": {
            "save": results["ref_save"] / results["ems_save"],
            "load": results["ref_load"] / results["ems_load"],
        },
        "ratio_vs_memmove": {
            "save": results["memmove_save"] / results["ems_save"],
            "load": results["memmove_load"] / results["ems_load"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    out = bench(args.repeat)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{out['bytes'] / 2**20:.0f} MiB per request, {out['segments']} segments, "
        f"copy impl {out['copy_impl']}, torch threads {out['torch_threads']}"
    )
    for name, rate in out["gbps"].items():
        print(f"  {name:<18} {rate:7.2f} GB/s  ({out['seconds'][name] * 1e3:7.2f} ms)")
    print(f"  {'segments_plan':<18} {out['seconds']['segments_plan'] * 1e6:7.0f} us")
    r, m = out["ratio_vs_ref"], out["ratio_vs_memmove"]
    print(f"ems / reference (a): save {r['save']:.2f}x, load {r['load']:.2f}x (target >= 0.8x)")
    print(f"ems / memmove   (b): save {m['save']:.2f}x, load {m['load']:.2f}x")


if __name__ == "__main__":
    main()
