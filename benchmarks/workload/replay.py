"""Replay a trace through the SDK's token semantics against running daemons.

Per request, as a connector would (``ems`` SDK, ``cc.load`` / ``cc.save``
with ``token_ids`` and ``mask``):

1. load the prompt's whole blocks (mask all ones): ``success`` = leading hits;
2. save the whole blocks of prompt + answer with a mask over the blocks just
   loaded, so only what the engine computed is sent (the SDK names the last
   loaded block as the predecessor of the first saved one).

A trailing partial block is neither loaded nor saved (an engine recomputes
it). Sessions are routed to nodes by session id (sticky, like a router with
session affinity); in a cluster a node fetches what other nodes own. The KV
layout is small (``BLOCK`` tokens x ``TOKEN_BYTES`` bytes a block): hit rates
depend on block counts, not bytes, and the pool capacities are set in blocks.
Load time at the size of a real model is measured apart (``probe``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.workload.generator import Request

BLOCK = 64  # tokens per block
TOKEN_BYTES = 64  # per token: K and V of one layer, 32 bytes each
BLOCK_BYTES = BLOCK * TOKEN_BYTES
MAX_BLOCKS = 640  # slots of the registered tensors: contexts up to 40,960 tokens


@dataclass
class Replayed:
    """Per request: prompt tokens, hit tokens, load and save seconds (NaN: no call)."""

    prompt: np.ndarray
    hit: np.ndarray
    load_s: np.ndarray
    save_s: np.ndarray
    saved_blocks: int  # blocks the saves sent (new to the pool or not)


def kv_tensors() -> list[list[np.ndarray]]:
    """One layer, K and V, ``MAX_BLOCKS`` blocks of ``BLOCK`` tokens, 32 bytes per token each."""
    return [[np.zeros((MAX_BLOCKS, BLOCK, TOKEN_BYTES // 2), dtype=np.uint8) for _ in range(2)]]


def replay(trace: list[Request], ccs: list[Any], option: Any = None) -> Replayed:
    """Run ``trace`` against ``ccs`` (one ``ContextCaching`` per node), in order."""
    kv = kv_tensors()
    for cc in ccs:
        cc.register_kvcache(kv)
    n = len(trace)
    prompt = np.zeros(n, dtype=np.int64)
    hit = np.zeros(n, dtype=np.int64)
    load_s = np.full(n, np.nan)
    save_s = np.full(n, np.nan)
    saved = 0
    slots = np.arange(MAX_BLOCKS * BLOCK, dtype=np.int64)
    for i, r in enumerate(trace):
        cc = ccs[r.session % len(ccs)]
        prompt[i] = r.prompt.size
        whole = r.prompt[: r.prompt.size // BLOCK * BLOCK][: MAX_BLOCKS * BLOCK]
        h = 0
        if whole.size:
            t0 = time.perf_counter()
            res = cc.load(slots[: whole.size], token_ids=whole, mask=np.ones(whole.size, np.int8),
                          option=option)
            load_s[i] = time.perf_counter() - t0
            h = res.success
        hit[i] = h * BLOCK
        seq = r.sequence
        seq = seq[: seq.size // BLOCK * BLOCK][: MAX_BLOCKS * BLOCK]
        if seq.size > h * BLOCK:
            mask = np.ones(seq.size, dtype=np.int8)
            mask[: h * BLOCK] = 0
            t0 = time.perf_counter()
            cc.save(slots[: seq.size], token_ids=seq, mask=mask, option=option)
            save_s[i] = time.perf_counter() - t0
            saved += seq.size // BLOCK - h
    return Replayed(prompt, hit, load_s, save_s, saved)


def probe(cc: Any, blocks: int, reps: int) -> tuple[float, float]:
    """(fixed seconds per load, bytes per second) loading Llama-3-8B-sized blocks.

    Registers 32 layers of K and V, ``BLOCK`` tokens x 8 heads x 128 of fp16
    (128 KiB per token, 8 MiB per block), saves ``blocks`` blocks, then times
    loads of 1, 2, 4, 8 and ``blocks`` blocks (median of ``reps`` each) and
    fits a line: the intercept is the fixed cost, the slope the cost per block.
    """
    kv = [[np.zeros((blocks, BLOCK, 8, 128), dtype=np.float16) for _ in range(2)] for _ in range(32)]
    cc.register_kvcache(kv)
    tokens = np.arange(blocks * BLOCK, dtype=np.int64) + 7
    slots = np.arange(blocks * BLOCK, dtype=np.int64)
    ones = np.ones(tokens.size, dtype=np.int8)
    res = cc.save(slots, token_ids=tokens, mask=ones)
    if res.success != blocks:
        raise RuntimeError(f"probe: saved {res.success} of {blocks} blocks (pool too small?)")

    def timed(k: int) -> float:
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = cc.load(slots[: k * BLOCK], token_ids=tokens[: k * BLOCK], mask=ones[: k * BLOCK])
            runs.append(time.perf_counter() - t0)
            if got.success != k:
                raise RuntimeError(f"probe: loaded {got.success} of {k} blocks")
        return float(np.median(runs))

    ks = sorted({1, 2, 4, 8, blocks})
    seconds = [timed(k) for k in ks]
    per_block, fixed = np.polyfit(ks, seconds, 1)  # least squares: fixed + k * per_block
    nbytes = BLOCK * 2 * 32 * 8 * 128 * 2
    return max(float(fixed), 0.0), nbytes / float(per_block)
