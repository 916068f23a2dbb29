"""Saves in one round trip (``pool.grants``) against the same saves in two, same run.

    python benchmarks/bench_grants.py [--rounds N] [--pool 4GiB] [--json]

Two standalone daemons run side by side, one with ``pool.grants`` on (the
default: after its first save of a block size a connection holds chunks for
the next one and saves with one PUT) and one with it off (RESERVE, copy,
COMMIT). For each cell (64 KiB and 2 MiB blocks, one block a call and 32 a
call) the SDK saves fresh keys through a connection of its own to each
daemon, the two alternating call by call so that the machine's noise falls on
both. Reported per cell: p50 of the time per call on each, and on / off (the
reference is the daemon without grants, measured in the same run). The pool
(4 GiB by default) is large enough that a 64 MiB batch is within the 1/64 of
it a connection may hold. Both pools are filled first, so every save evicts,
as in a cache that has been running for a while.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_sdk import wait_filled  # noqa: E402

from benchmarks.workload import daemons  # noqa: E402
from emsd.config import parse_size  # noqa: E402

SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
CELLS = [(64 << 10, 1, 200), (64 << 10, 32, 40), (2 << 20, 1, 100), (2 << 20, 32, 30)]  # size, batch,
# calls a round


class Saver:
    """One connection saving fresh keys of one block size, ``batch`` blocks a call."""

    def __init__(self, cc: Any, size: int, batch: int) -> None:
        self.cc, self.batch, self.next = cc, batch, 0
        self.buffer = np.random.default_rng(size + batch).integers(0, 255, batch * size, dtype=np.uint8)
        cc.register_kvcache([[self.buffer.reshape(batch, 1, size)]])
        wait_filled(cc)

    def save(self) -> float:
        keys = list(range(self.next, self.next + self.batch))
        self.next += self.batch
        t0 = time.perf_counter()
        res = self.cc.save(list(range(self.batch)), hashes=keys, offsets=[1] * self.batch)
        took = time.perf_counter() - t0
        if res.success != self.batch:
            raise RuntimeError(f"a save stored {res.success} of {self.batch}")
        return took


def puts(dep: Any) -> float:
    """Saves the daemon has taken by PUT into granted chunks."""
    return dep.nodes[0].metric("emsd_ops_total", 'op="put",result="ok"')


def run(rounds: int, pool: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(dir=SHM, prefix="emsd-grants-") as tmp:
        deps = {g: daemons.start(Path(tmp), 1, pool, "prefix", name=f"grants-{g}", page=64 << 20, grants=g)
                for g in (True, False)}
        try:
            for dep in deps.values():  # full pools: every cell runs in the steady state, evicting
                filler = Saver(daemons.connect(dep, "fill")[0], 2 << 20, 32)
                for _ in range(pool // (64 << 20) + 4):
                    filler.save()
            for size, batch, calls in CELLS:
                savers = {g: Saver(daemons.connect(dep, f"g{size}-{batch}")[0], size, batch)
                          for g, dep in deps.items()}
                before = puts(deps[True])
                times: dict[bool, list[float]] = {True: [], False: []}
                for g in (True, False):
                    savers[g].save()  # warm-up; on: the first save, after which chunks are granted
                for r in range(rounds):
                    for i in range(calls):
                        for g in ((True, False) if (r + i) % 2 else (False, True)):
                            times[g].append(savers[g].save())
                on, off = statistics.median(times[True]), statistics.median(times[False])
                by_put = puts(deps[True]) - before
                if by_put < rounds * calls:  # else this would compare two-step saves with themselves
                    raise RuntimeError(f"only {by_put} of {rounds * calls} saves went by PUT")
                rows.append({"size": size, "batch": batch, "calls": rounds * calls, "on_us": on * 1e6,
                             "off_us": off * 1e6, "ratio": on / off})
                print(f"{size >> 10:5d} KiB x {batch:2d}: grants on {on * 1e6:8.1f} us, "
                      f"off {off * 1e6:8.1f} us per save (p50 of {rounds * calls}): on/off {on / off:.2f}",
                      flush=True)
        finally:
            for dep in deps.values():
                dep.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", default="4GiB", help="each daemon's pool (at least 64x the largest batch)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON at the end")
    args = ap.parse_args()
    rows = run(args.rounds, parse_size("--pool", args.pool))
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
