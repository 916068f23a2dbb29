"""The disk tier on the workload: DRAM at 25% of the live working set plus a disk tier of 400%,
beside DRAM alone at 25% and 100%.

    python -m benchmarks.workload.disk_tier [--quick] [--seed N] [--dir /var/tmp] [--disk-gbps G]
                                            [--json FILE]

(from the repository root). Generates the trace (``generator``; ``--quick``:
the small mix) and replays it through the SDK (``replay``) against a real
standalone daemon per configuration, ``prefix`` eviction, the disk tier in a
directory of ``--dir`` (a real file system). Reports the token hit rate, its
share of an infinite cache's (the goal: >= 0.95 with the tier), the tier's
writes, reads and dropped demotions, and the modelled mean time to first
token (``ttft.py``: Llama-3-8B on an A100, a model of hardware this machine
lacks). The load cost in the model is measured here from DRAM (``replay.probe``);
hits served from disk load at ``--disk-gbps`` instead (default 1.4 GB/s, this
machine's disk at queue depth 8 as ``benchmarks/bench_disk.py`` measures it),
weighted by the share of hits the tier served.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workload import daemons, sim
from benchmarks.workload.generator import Mix, generate, quick_mix
from benchmarks.workload.replay import BLOCK, BLOCK_BYTES, probe, replay
from benchmarks.workload.run import SHM, Sizes, point, summarise
from benchmarks.workload.ttft import LoadCost, ModelCost, ttft

CONFIGS = (("DRAM 25%", 0.25, 0.0), ("DRAM 100%", 1.0, 0.0), ("DRAM 25% + disk 400%", 0.25, 4.0))


def run_config(trace: list[Any], chained: list[sim.Chained], sizes: Sizes, work: Path, disk_root: Path,
               label: str, dram: float, disk: float) -> dict[str, Any]:
    """One replay against a daemon with ``dram`` and ``disk`` times the live working set."""
    where = point(sizes, "live", dram)
    table = None
    if disk:
        disk_dir = Path(tempfile.mkdtemp(prefix="emsd-workload-disk-", dir=disk_root))
        size = max(int(sizes.live * disk * BLOCK_BYTES), 64 << 20)
        table = {"dir": str(disk_dir), "size": str(size), "extent": "1MiB", "queue": "64MiB"}
    dep = daemons.start(work, 1, where["pool_bytes_per_node"], "prefix", name=label.replace(" ", "").replace(
        "%", "").replace("+", "-"), disk=table)
    try:
        rep = replay(trace, daemons.connect(dep, "workload"))
        node = dep.nodes[0]
        tier = {k: node.metric(f"emsd_disk_{k}_total") for k in ("writes", "reads")}
        tier["dropped"] = sum(node.metric("emsd_disk_dropped_demotions_total", f'reason="{r}"')
                              for r in ("queue", "room", "quota", "failed", "corrupt"))
    finally:
        dep.stop()
        if table is not None:
            import shutil

            shutil.rmtree(table["dir"], ignore_errors=True)
    inf_hits = int(sim.infinite(chained).sum() * BLOCK)
    row = {"label": label, "dram_of_live": dram, "disk_of_live": disk, **summarise(rep, inf_hits),
           **({"disk": tier} if disk else {})}
    row["rep"] = rep
    return row


def modelled_ttft(row: dict[str, Any], load: LoadCost, disk_bps: float) -> float:
    """Mean modelled TTFT of the replay's requests; hits the tier served load at ``disk_bps``."""
    rep = row.pop("rep")
    hit_blocks = max(int(rep.hit.sum() // BLOCK), 1)
    share = min(row.get("disk", {}).get("reads", 0.0) / hit_blocks, 1.0)
    per_byte = (1 - share) / load.bandwidth + share / disk_bps
    blended = LoadCost(load.fixed_s, 1 / per_byte)
    return float(ttft(ModelCost(), blended, rep.prompt, rep.hit).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--disk-gbps", type=float, default=1.4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trace = generate(quick_mix() if args.quick else Mix(), args.seed)
    chained = sim.chain(trace, BLOCK)
    sizes = Sizes.of(chained)
    whole = sum(c.prompt_blocks for c in chained)
    infinite = float(sim.infinite(chained).sum() / whole)
    print(f"trace: {len(trace)} requests, live working set {sizes.live} blocks, "
          f"infinite-cache hit rate {infinite:.4f}", flush=True)
    out: dict[str, Any] = {"seed": args.seed, "quick": args.quick, "live_blocks": sizes.live,
                           "infinite_hit_rate": infinite, "rows": []}
    with tempfile.TemporaryDirectory(dir=SHM, prefix="emsd-workload-disk-") as tmp:
        work = Path(tmp)
        probe_dep = daemons.start(work, 1, 320 << 20, "prefix", name="probe", page=16 << 20)
        try:
            fixed, bw = probe(daemons.connect(probe_dep, "probe")[0], blocks=16, reps=5)
        finally:
            probe_dep.stop()
        load = LoadCost(fixed, bw)
        for label, dram, disk in CONFIGS:
            row = run_config(trace, chained, sizes, work, args.dir, label, dram, disk)
            row["ttft_mean_s"] = modelled_ttft(row, load, args.disk_gbps * 1e9)
            out["rows"].append(row)
            extra = "" if not disk else (f"; disk writes {row['disk']['writes']:.0f}, reads "
                                         f"{row['disk']['reads']:.0f}, dropped {row['disk']['dropped']:.0f}")
            print(f"  {label:>22}: hit {row['hit_rate']:.4f} ({row['vs_infinite']:.3f} of infinite), "
                  f"modelled mean TTFT {row['ttft_mean_s'] * 1e3:.0f} ms{extra}", flush=True)
    no_cache = float(ttft(ModelCost(), load, np.array([r.prompt.size for r in trace]), 0).mean())
    out["ttft_no_cache_mean_s"] = no_cache
    print(f"  {'no cache':>22}: modelled mean TTFT {no_cache * 1e3:.0f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
