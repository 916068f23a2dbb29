"""What a large disk tier's bookkeeping costs: the index scans that run while clients wait.

    python benchmarks/bench_disk_index.py [--blocks N] [--dir DIR] [--json]

A real disk tier (``emsd.tier.disk.DiskTier``, O_DIRECT where ``--dir`` allows it,
default /var/tmp) filled with ``--blocks`` real 4 KiB blocks (default 200,000),
three quarters of them tenant b's and the newest quarter tenant a's, with a's quota
at exactly what it holds. Then, each the median of ``--repeat`` runs:

- ``keys_on_disk``: the snapshot of every key on disk that a drain and a handoff
  take. It holds the tier's lock, which the writers and every load's look at the
  tier take too, and runs on the event loop;
- a load's look at the tier: a checkout of 128 random blocks (found, pinned,
  made the newest) and, checked in, their demotion as blocks already on disk
  (made the newest again), which a load that promotes them runs, then the
  evictions it causes, on the event loop under the tier's lock;
- a demotion of one block at tenant a's quota (it must evict a's oldest block)
  against one of tenant c, which has no quota, from demote to written: the ratio
  is what the quota's eviction adds to a write;
- a drop of tenant c's namespace (the ``--repeat`` blocks it demoted), which the
  others' blocks should not slow (``emsctl drop``, the SDK's ``clear()``);
- a handoff's lookup of the keys on disk on a three-node ring
  (``TierStack.away_on_disk``): the whole, and its longest part, the longest the
  event loop goes without serving a client during it;
- a restart: the tier closed and opened again on its files, which re-indexes
  every block before the daemon is ready, against the least any index of those
  keys in a Python dict costs (one dict built from the same keys, in the same
  run); and the bytes a block its index then holds in the daemon's memory
  (``DiskTier.index_nbytes``), and how much the restart grew the process's
  resident memory, a block (the index, the ledger's pages, the free slots).

Prints one line each (``--json``: the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from emsd.handoff import CHUNK  # noqa: E402
from emsd.placement import ClusterView, Member, Ring  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.pool.store import BlockStore  # noqa: E402
from emsd.tier.disk import DiskTier, key_bytes  # noqa: E402
from emsd.tier.engine import aligned  # noqa: E402
from emsd.tier.stack import TierStack  # noqa: E402

BLOCK = 4096
LOOK = 128  # blocks of one load's look at the tier
BATCH = 4096  # blocks demoted at a time while filling (the write queue's bound is 256 MiB)


def _fill(tier: DiskTier, name: str, first: int, count: int, pool: memoryview) -> None:
    """Demote ``count`` blocks of keys ``first..`` into namespace ``name`` and wait for them."""
    for at in range(first, first + count, BATCH):
        n = min(BATCH, first + count - at)
        keys = KeyBatch.from_ints(np.arange(at, at + n, dtype=np.uint64))
        offsets = np.arange(n, dtype=np.uint64) * np.uint64(BLOCK)
        if tier.demote(name, keys, pool, offsets, np.full(n, BLOCK, dtype=np.uint64)) != n:
            raise RuntimeError(f"the tier queued fewer than {n} blocks")
        if not tier.wait_idle(120):
            raise RuntimeError("the tier's writes did not end in 120 s")


def _demote_one(tier: DiskTier, name: str, key: int, pool: memoryview) -> float:
    """Seconds from demoting one block to its write's end."""
    keys = KeyBatch.from_ints(np.array([key], dtype=np.uint64))
    t0 = time.perf_counter()
    tier.demote(name, keys, pool, np.zeros(1, dtype=np.uint64), np.full(1, BLOCK, dtype=np.uint64))
    if not tier.wait_idle(30):
        raise RuntimeError("a demotion did not end in 30 s")
    return time.perf_counter() - t0


def _look(tier: DiskTier, name: str, count: int, pool: memoryview, seed: int) -> tuple[float, float]:
    """Seconds a load's look at the tier takes for ``LOOK`` random blocks of keys ``0..count``
    of ``name``: their checkout (each found, pinned and made the newest) and, once checked in,
    their demotion as blocks already on disk (each made the newest again, nothing written)."""
    picks = np.random.default_rng(seed).choice(count, LOOK, replace=False)
    keys = KeyBatch.from_ints(picks.astype(np.uint64))
    t0 = time.perf_counter()
    entries = tier.checkout(name, keys)
    checkout = time.perf_counter() - t0
    if any(e is None for e in entries):
        raise RuntimeError("a checkout missed a block on disk")
    for e in entries:
        tier.checkin(e)
    t0 = time.perf_counter()
    tier.demote(name, keys, pool, np.zeros(LOOK, dtype=np.uint64), np.full(LOOK, BLOCK, dtype=np.uint64))
    return checkout, time.perf_counter() - t0


def _dict_floor(tier: DiskTier) -> float:
    """Seconds to build a plain dict of every key on disk in the tier's key form (its
    namespace id and 33 key bytes) from the ledger's rows: the least a Python index costs
    (the garbage collector off, whose passes depend on what else the process holds)."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        ids, rows = tier.ledger.committed()
        kbs = key_bytes(KeyBatch(rows["words"], rows["tag"]))
        index = {(ns, kb): row for ns, kb, row in zip(rows["ns"].tolist(), kbs, ids.tolist(), strict=True)}
        took = time.perf_counter() - t0
    finally:
        gc.enable()
    if len(index) != ids.size:
        raise RuntimeError(f"{ids.size - len(index)} keys twice in the ledger")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n, quarter = args.blocks, args.blocks // 4
    work = Path(tempfile.mkdtemp(prefix="emsd-bench-disk-index-", dir=args.dir))
    staging = aligned(BATCH * BLOCK)
    pool = memoryview(staging)

    def open_tier() -> DiskTier:
        return DiskTier(work / "tier", (n + 2 * args.repeat) * BLOCK + (64 << 20),
                        quota=lambda name: quarter * BLOCK if name.startswith("a/") else None,
                        tenant=lambda name: name.split("/")[0])

    tier = open_tier()
    try:
        t0 = time.perf_counter()
        _fill(tier, "b/x", 0, n - quarter, pool)
        _fill(tier, "a/x", n, quarter, pool)
        print(f"[disk-index] {n} blocks written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        scans = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            got = tier.keys_on_disk()
            scans.append(time.perf_counter() - t0)
        if sum(map(len, got.values())) != n:
            raise RuntimeError(f"keys_on_disk named {sum(map(len, got.values()))} of {n} blocks")
        looks = [_look(tier, "b/x", n - quarter, pool, seed) for seed in range(args.repeat)]
        at_quota = [_demote_one(tier, "a/x", 2 * n + i, pool) for i in range(args.repeat)]
        free = [_demote_one(tier, "c/x", 3 * n + i, pool) for i in range(args.repeat)]
        if tier.stats().evicted != args.repeat:
            raise RuntimeError(f"{tier.stats().evicted} blocks evicted for {args.repeat} at the quota")
        t0 = time.perf_counter()
        dropped = tier.drop("c/x")
        drop = time.perf_counter() - t0
        if dropped != args.repeat:
            raise RuntimeError(f"the drop removed {dropped} of {args.repeat} blocks")
        ring = Ring.build(ClusterView.of([Member(m, 1 << 40) for m in ("a", "b", "c")]))
        stack = TierStack(BlockStore(64 << 20, 2 << 20), tier, pool, lambda ns: "")

        def mine(name: str, keys: KeyBatch) -> np.ndarray:
            return ring.owners(name, keys)[:, 0] == 0

        parts, t0 = [], time.perf_counter()
        last, away = t0, 0
        for _, keys in stack.away_on_disk(mine, CHUNK):
            now = time.perf_counter()
            parts.append(now - last)
            last, away = now, away + len(keys)
        whole = time.perf_counter() - t0
        held = tier.stats().blocks
        tier.close()  # kept alive through the reopen: none of its memory is reused by the new one
        rss = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        tier = open_tier()
        restart = time.perf_counter() - t0
        rss = psutil.Process().memory_info().rss - rss
        if tier.restored != held:
            raise RuntimeError(f"the restart re-indexed {tier.restored} of {held} blocks")
        index_bytes = tier.index_nbytes()
        floor = _dict_floor(tier)
    finally:
        tier.close()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "blocks": n,
        "keys_on_disk_ms": statistics.median(scans) * 1e3,
        "checkout_us": statistics.median(c for c, _ in looks) * 1e6,
        "demote_on_disk_us": statistics.median(d for _, d in looks) * 1e6,
        "demote_at_quota_us": statistics.median(at_quota) * 1e6,
        "demote_no_quota_us": statistics.median(free) * 1e6,
        "drop_ms": drop * 1e3,
        "away_whole_ms": whole * 1e3,
        "away_longest_part_ms": max(parts) * 1e3,
        "away_blocks": away,
        "restart_s": restart,
        "restart_us_a_block": restart / held * 1e6,
        "dict_floor_s": floor,
        "index_bytes_a_block": index_bytes / held,
        "restart_rss_bytes_a_block": rss / held,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{n} blocks on disk: keys_on_disk {out['keys_on_disk_ms']:.1f} ms; a checkout of {LOOK} blocks "
          f"{out['checkout_us']:.0f} us, their demotion as blocks on disk {out['demote_on_disk_us']:.0f} us; "
          f"a demotion at the quota "
          f"{out['demote_at_quota_us']:.0f} us against {out['demote_no_quota_us']:.0f} us without one "
          f"({out['demote_at_quota_us'] / out['demote_no_quota_us']:.2f}x); a drop of {args.repeat} blocks "
          f"{out['drop_ms']:.1f} ms; a handoff's lookup "
          f"{out['away_whole_ms']:.0f} ms in all ({away} blocks away), its longest part "
          f"{out['away_longest_part_ms']:.1f} ms; a restart re-indexes {held} blocks in {restart:.2f} s "
          f"({out['restart_us_a_block']:.1f} us a block, {restart / floor:.1f}x a dict of their keys); "
          f"its index holds {out['index_bytes_a_block']:.0f} bytes a block, the restart "
          f"grew the process by {out['restart_rss_bytes_a_block']:.0f} bytes a block")


if __name__ == "__main__":
    main()
