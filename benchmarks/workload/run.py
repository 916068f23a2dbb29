"""The workload benchmark: token hit rate and modelled time to first token on generated traffic.

    python -m benchmarks.workload.run [--quick] [--seed N] [--json FILE] [--plots DIR]

(from the repository root). In one run:

1. generates the trace (``generator.py``; ``--quick``: the small mix) and its
   working set (distinct blocks saved) and infinite-cache hit rate;
2. sweeps pool capacities in process (``sim.in_store``: the daemon's own
   ``BlockStore``) for the eviction policies ``lru`` and ``prefix``, and
   ``prefix`` with admission after 2 sightings, and the offline reference
   (``sim.belady``: evicts what is needed furthest in the future); and a
   3-node cluster in process (``sim.in_cluster``) with 160 and 512 ring
   points per node;
3. replays the trace through the SDK against a real standalone daemon at
   25%, 50% and 100% of the working set, per policy, and against a real
   3-node cluster (ZooKeeper, peer transport; ``write_rcache`` off so that
   each block is held once and capacities compare);
4. measures the load cost of Llama-3-8B-sized blocks (``replay.probe``) and
   models TTFT (``ttft.py``) per request and against context length;
5. writes the plots (PNG) and prints a summary; ``--json`` keeps every figure.

Quick mode takes well under a minute; the full run a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workload import daemons, sim
from benchmarks.workload.generator import Mix, generate, quick_mix
from benchmarks.workload.replay import BLOCK, BLOCK_BYTES, probe, replay
from benchmarks.workload.ttft import LoadCost, ModelCost, ttft, ttft_curve

PAGE = 64 << 10
MIN_POOL = 1 << 20
POLICIES = ("lru", "prefix")
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
CONTEXTS = np.array([1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 100_000, 128_000])
NEW_TOKENS = 100  # a user turn (the generator's mean user message is ~99 tokens)
PCIE_BPS = 25e9  # stated, not measured: host -> GPU over PCIe Gen4 x16, pinned memory


def capacity(ws_blocks: int, frac: float, nodes: int = 1) -> int:
    """Pool bytes per node so that ``nodes`` pools hold ``frac`` of the working set."""
    want = ws_blocks * frac * BLOCK_BYTES / nodes
    return max(MIN_POOL, math.ceil(want / PAGE) * PAGE)


def summarise(rep: Any, infinite_hit: int, cap: int, nodes: int) -> dict[str, Any]:
    loads = rep.load_s[~np.isnan(rep.load_s)]
    whole = int(np.sum(rep.prompt // BLOCK * BLOCK))
    return {
        "pool_bytes_per_node": cap, "nodes": nodes,
        "hit_rate": float(rep.hit.sum() / whole), "vs_infinite": float(rep.hit.sum() / infinite_hit),
        "bytes_loaded": int(rep.hit.sum() // BLOCK * BLOCK_BYTES),
        "bytes_saved_sent": int(rep.saved_blocks * BLOCK_BYTES),
        "load_ms_p50": float(np.percentile(loads, 50) * 1e3),
        "load_ms_p99": float(np.percentile(loads, 99) * 1e3),
        "save_ms_p50": float(np.nanpercentile(rep.save_s, 50) * 1e3),
    }


def run_daemons(trace: list[Any], work: Path, ws: int, inf_hits: int, fracs: list[float],
                nodes: int, zookeeper: Any, out: dict[str, Any]) -> Any:
    """Replays per (policy, fraction); returns the prefix-policy 50% replay (for TTFT)."""
    from ems import CcKvOption

    option = CcKvOption(write_rcache=False) if nodes > 1 else None
    keep = None
    for policy in POLICIES:
        for frac in fracs:
            cap = capacity(ws, frac, nodes)
            name = f"{'cluster' if nodes > 1 else 'solo'}-{policy}-{int(frac * 100)}"
            dep = daemons.start(work, nodes, cap, policy, zookeeper, name=name)
            try:
                ccs = daemons.connect(dep, "workload")
                t0 = time.perf_counter()
                rep = replay(trace, ccs, option)
                took = time.perf_counter() - t0
                reserved = sum(n.metric("emsd_op_bytes_total", 'op="reserve"') for n in dep.nodes)
            finally:
                dep.stop()
            row = summarise(rep, inf_hits, cap, nodes)
            row.update(policy=policy, fraction=frac, seconds=took, bytes_saved_new=int(reserved))
            out.setdefault("daemon", []).append(row)
            print(f"  {name:>20}: hit {row['hit_rate']:.3f} ({row['vs_infinite']:.3f} of infinite), "
                  f"load p50 {row['load_ms_p50']:.2f} ms, {took:.1f} s", flush=True)
            if policy == "prefix" and frac == 0.5 and nodes == 1:
                keep = rep
    return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small trace; cluster at 50%% only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--plots", type=Path, help="directory for the PNGs (default: docs/, or a "
                    "temporary directory with --quick, so that docs/ keeps the full run's)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-node cluster")
    args = ap.parse_args()
    if args.plots is None:
        args.plots = Path(tempfile.gettempdir()) / "emsd-workload-quick" if args.quick else Path("docs")
    started = time.perf_counter()
    mix = quick_mix() if args.quick else Mix()
    trace = generate(mix, args.seed)
    chained = sim.chain(trace, BLOCK)
    ws = sim.working_set(chained)
    inf = sim.infinite(chained)
    whole_blocks = sum(c.prompt_blocks for c in chained)
    out: dict[str, Any] = {
        "seed": args.seed, "quick": args.quick, "requests": len(trace),
        "kinds": {k: sum(r.kind == k for r in trace) for k in ("chat", "agent", "oneoff")},
        "working_set_blocks": ws, "block_tokens": BLOCK, "block_bytes": BLOCK_BYTES,
        "prompt_blocks": whole_blocks, "infinite_hit_rate": float(inf.sum() / whole_blocks),
    }
    print(f"trace: {len(trace)} requests {out['kinds']}, working set {ws} blocks, "
          f"infinite-cache hit rate {out['infinite_hit_rate']:.3f}", flush=True)

    fracs = [0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0] if not args.quick else [0.1, 0.25, 0.5, 1.0]
    sweep: dict[str, list[float]] = {}
    for label, policy, admit in (("lru", "lru", 1), ("prefix", "prefix", 1),
                                 ("prefix+admit2", "prefix", 2)):
        sweep[label] = [float(sim.in_store(chained, capacity(ws, f), BLOCK_BYTES, PAGE, policy,
                                           admit).sum() / whole_blocks) for f in fracs]
        print(f"  in-process {label:>14}: " + " ".join(f"{f:.0%}:{h:.3f}" for f, h in
                                                       zip(fracs, sweep[label], strict=True)), flush=True)
    sweep["belady"] = [float(sim.belady(chained, capacity(ws, f) // BLOCK_BYTES).sum() / whole_blocks)
                       for f in fracs]
    print("  offline belady (knows the future): " + " ".join(
        f"{f:.0%}:{h:.3f}" for f, h in zip(fracs, sweep["belady"], strict=True)), flush=True)
    out["sweep"] = {"fractions": fracs, **sweep}
    ring_fracs = [0.25, 0.5]
    out["ring_sweep"] = {"fractions": ring_fracs, "nodes": 3}
    for vnodes in (160, 512):
        out["ring_sweep"][str(vnodes)] = [
            float(sim.in_cluster(chained, 3, capacity(ws, f, 3), BLOCK_BYTES, PAGE, "prefix", vnodes).sum()
                  / whole_blocks) for f in ring_fracs]
        print(f"  in-process 3 nodes, {vnodes:>4} vnodes: " + " ".join(
            f"{f:.0%}:{h:.3f}" for f, h in zip(ring_fracs, out["ring_sweep"][str(vnodes)], strict=True)),
            flush=True)

    inf_hits = int(inf.sum() * BLOCK)
    with tempfile.TemporaryDirectory(dir=SHM, prefix="emsd-workload-") as tmp:
        work = Path(tmp)
        print("standalone daemon:", flush=True)
        solo = run_daemons(trace, work, ws, inf_hits, [0.25, 0.5, 1.0], 1, None, out)
        probe_dep = daemons.start(work, 1, 160 << 20, "prefix", name="probe", page=16 << 20)
        try:
            fixed, bw = probe(daemons.connect(probe_dep, "probe")[0], blocks=16, reps=5)
        finally:
            probe_dep.stop()
        out["load_cost"] = {"fixed_ms": fixed * 1e3, "bandwidth_GBps": bw / 1e9}
        print(f"load cost of Llama-3-8B blocks: {fixed * 1e3:.2f} ms + bytes / {bw / 1e9:.2f} GB/s",
              flush=True)
        if not args.no_cluster:
            print("3-node cluster:", flush=True)
            zookeeper = daemons.start_zookeeper(work / "zk")
            try:
                run_daemons(trace, work, ws, inf_hits, [0.5] if args.quick else [0.25, 0.5, 1.0], 3,
                            zookeeper, out)
            finally:
                zookeeper.stop()

    model, load = ModelCost(), LoadCost(fixed, bw)
    without, with_cache = ttft_curve(model, load, CONTEXTS, NEW_TOKENS)
    _, with_pcie = ttft_curve(model, LoadCost(fixed, PCIE_BPS), CONTEXTS, NEW_TOKENS)
    out["ttft_curve"] = {"contexts": CONTEXTS.tolist(), "new_tokens": NEW_TOKENS,
                         "without_s": without.tolist(), "with_s": with_cache.tolist(),
                         "ratio": (with_cache / without).tolist(),
                         "with_pcie_s": with_pcie.tolist(), "ratio_pcie": (with_pcie / without).tolist()}
    assert solo is not None
    req_with = ttft(model, load, solo.prompt, solo.hit)
    req_without = ttft(model, load, solo.prompt, 0)
    out["ttft_replay"] = {"mean_with_s": float(req_with.mean()), "mean_without_s": float(req_without.mean()),
                          "ratio_of_means": float(req_with.mean() / req_without.mean())}
    out["seconds"] = time.perf_counter() - started
    for c, w, wo, wp in zip(CONTEXTS.tolist(), with_cache.tolist(), without.tolist(), with_pcie.tolist(),
                            strict=True):
        print(f"  TTFT at {c:>7} tokens: {wo * 1e3:9.1f} ms -> {w * 1e3:8.1f} ms (1/{wo / w:.1f}); "
              f"at {PCIE_BPS / 1e9:.0f} GB/s: {wp * 1e3:8.1f} ms (1/{wo / wp:.1f})")
    print(f"replay (standalone, prefix, 50%): mean modelled TTFT {req_without.mean() * 1e3:.1f} ms -> "
          f"{req_with.mean() * 1e3:.1f} ms; run took {out['seconds']:.0f} s")
    plot(out, solo, req_with, req_without, args.plots)
    print(f"plots in {args.plots}/workload_hit_rate.png and workload_ttft.png")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def plot(out: dict[str, Any], solo: Any, req_with: np.ndarray, req_without: np.ndarray,
         directory: Path) -> None:
    """docs/workload_hit_rate.png and docs/workload_ttft.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fr = np.array(out["sweep"]["fractions"]) * 100
    for label, style in (("lru", "o-"), ("prefix", "s-"), ("prefix+admit2", "^--")):
        ax.plot(fr, out["sweep"][label], style, label=f"{label} (in process)")
    for policy, marker in (("lru", "o"), ("prefix", "s")):
        for nodes, face in ((1, "none"), (3, None)):
            rows = [r for r in out.get("daemon", []) if r["policy"] == policy and r["nodes"] == nodes]
            if rows:
                ax.scatter([r["fraction"] * 100 for r in rows], [r["hit_rate"] for r in rows],
                           marker=marker, s=90, facecolors=face or "black", edgecolors="black",
                           label=f"{policy}, {'standalone' if nodes == 1 else '3-node cluster'} daemon")
    ax.plot(fr, out["sweep"]["belady"], "k:", marker="x", label="Belady (offline: knows the future)")
    ax.axhline(out["infinite_hit_rate"], color="grey", ls=":", label="infinite cache")
    ax.set_xlabel("pool capacity, % of the working set")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"Hit rate vs capacity ({out['requests']} requests, seed {out['seed']})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "workload_hit_rate.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    c = out["ttft_curve"]
    ax.loglog(c["contexts"], c["without_s"], "k-", label="without emsd (recompute all)")
    ax.loglog(c["contexts"], c["with_s"], "b-",
              label=f"with emsd (all but {c['new_tokens']} tokens loaded, measured host copy)")
    ax.loglog(c["contexts"], c["with_pcie_s"], "b--",
              label=f"same, load at {PCIE_BPS / 1e9:.0f} GB/s (PCIe Gen4, stated)")
    bins = np.geomspace(64, max(int(solo.prompt.max()), 128), 10)
    idx = np.digitize(solo.prompt, bins)
    mids, w, wo = [], [], []
    for b in np.unique(idx):
        sel = idx == b
        if sel.sum() >= 3:
            mids.append(float(np.median(solo.prompt[sel])))
            w.append(float(req_with[sel].mean()))
            wo.append(float(req_without[sel].mean()))
    ax.loglog(mids, wo, "ko", mfc="none", label="replay, without (mean per bin)")
    ax.loglog(mids, w, "bo", label="replay, with emsd (prefix, 50% pool)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("modelled TTFT, s")
    ax.set_title("Llama-3-8B on A100 (50% MFU) + measured load cost")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(directory / "workload_ttft.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
