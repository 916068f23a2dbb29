"""The workload benchmark: token hit rate and modelled time to first token on generated traffic.

    python -m benchmarks.workload.run [--quick] [--seed N] [--json FILE] [--plots DIR]
                                      [--no-cluster] [--lengths 1,2,4] [--seeds 2,3]

(from the repository root). Capacities are fractions of the trace's **live
working set** (``sim.live_working_set``: the most blocks that are, at one
request boundary, saved and still to be loaded; the smallest cache that,
knowing the future, hits as often as an infinite one), because that stays
put when the trace runs longer, while the distinct blocks ever saved
(``sim.working_set``, the axis before) grow with it; every figure also says
what share of the distinct blocks it is. In one run:

1. generates the trace (``generator.py``; ``--quick``: the small mix), its
   distinct blocks, live working set and infinite-cache hit rate;
2. sweeps pool capacities of 10% to 300% of the live working set in process
   (``sim.in_store``: the daemon's own ``BlockStore``) for the eviction
   policies ``lru`` and ``prefix``, ``prefix`` with admission after 2
   sightings, and the offline reference (``sim.belady``: evicts what is
   needed furthest in the future); and a 3-node cluster in process
   (``sim.in_cluster``) at 25% and 50% of the live working set, ``lru`` and
   ``prefix`` with 512 ring points per node and ``prefix`` with 160;
3. replays the trace through the SDK, ``lru`` and ``prefix``, against a real
   standalone daemon and a real 3-node cluster (ZooKeeper, peer transport;
   ``write_rcache`` off so that each block is held once and capacities
   compare) at 25%, 50% and 100% of the live working set, and the standalone
   daemon also at 50% of the distinct blocks (the old axis);
4. measures the load cost of Llama-3-8B-sized blocks (``replay.probe``) and
   models TTFT (``ttft.py``) per request of the standalone ``prefix`` replay
   at 50% of the live working set, and against context length;
5. ``--lengths``: in process only, the trace ``m`` times longer at the same
   arrival rate (``Mix.sessions`` and ``Mix.span_s`` times ``m``) per ``m``:
   both sizes, ``lru`` and ``prefix`` at 25% and 50% of the distinct blocks,
   and ``lru``, ``prefix`` and ``belady`` at 50% of the live working set;
   ``--seeds``: in process only, other seeds at 25%, 50% and 100% of the
   live working set and 50% of the distinct blocks;
6. writes the plots (PNG) and prints a summary; ``--json`` keeps every figure.

A pool is never below ``MIN_POOL`` (the daemon's minimum) per node, and is
whole slab pages, so its real share of either size is recorded next to the
fraction asked for. Quick mode takes well under a minute; the full run a few
minutes, ``--lengths 1,2,4`` about 20 s more and ``--seeds 2,3`` about 10 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
# in-process labels -> (eviction, admit after N sightings)
IN_STORE = {"lru": ("lru", 1), "prefix": ("prefix", 1), "prefix+admit2": ("prefix", 2)}
SWEEP_FRACS = [0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]  # of the live working set
QUICK_FRACS = [0.25, 0.5, 1.0, 2.0]
GOAL_FRACS = [0.25, 0.5, 1.0]  # of the live working set: the daemons' points, where the goal is judged
# in-process cluster: (eviction, ring points per node)
RING = (("lru", 512), ("prefix", 512), ("prefix", 160))
RING_FRACS = [0.25, 0.5]
POINT_KEYS = ("blocks", "of_live", "of_distinct", "floored")  # what a sweep records of each pool
Plan = Sequence[tuple[str, Sequence[float], Sequence[str]]]  # (axis, fractions, labels)
LENGTH_PLAN: Plan = (("distinct", [0.25, 0.5], POLICIES), ("live", [0.5], (*POLICIES, "belady")))
SEED_PLAN: Plan = (("live", GOAL_FRACS, (*POLICIES, "belady")), ("distinct", [0.5], POLICIES))
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
CONTEXTS = np.array([1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 100_000, 128_000])
NEW_TOKENS = 100  # a user turn (the generator's mean user message is ~99 tokens)
PCIE_BPS = 25e9  # stated, not measured: host -> GPU over PCIe Gen4 x16, pinned memory


@dataclass(frozen=True)
class Sizes:
    """A trace's two sizes in blocks: ``distinct`` blocks ever saved, and its ``live`` working set."""

    distinct: int
    live: int

    @classmethod
    def of(cls, chained: list[sim.Chained]) -> Sizes:
        return cls(sim.working_set(chained), sim.live_working_set(chained))

    def blocks(self, axis: str) -> int:
        """The size that fractions on ``axis`` ("live" or "distinct") are of."""
        return {"live": self.live, "distinct": self.distinct}[axis]


def _pages(blocks: float, nodes: int) -> int:
    """Bytes per node of whole slab pages for ``blocks`` blocks over ``nodes`` nodes, rounded up."""
    return math.ceil(blocks * BLOCK_BYTES / nodes / PAGE) * PAGE


def capacity(blocks: int, frac: float, nodes: int = 1) -> int:
    """Pool bytes per node so that ``nodes`` pools hold ``frac`` of ``blocks`` blocks: whole
    slab pages, rounded up, and never below ``MIN_POOL`` (the daemon's smallest pool)."""
    return max(MIN_POOL, _pages(blocks * frac, nodes))


def point(sizes: Sizes, axis: str, frac: float, nodes: int = 1) -> dict[str, Any]:
    """The pool for ``frac`` of the ``axis`` size on ``nodes`` nodes: bytes per node, the blocks
    all nodes hold, their real share of each size, and whether ``MIN_POOL`` raised it."""
    cap = capacity(sizes.blocks(axis), frac, nodes)
    held = cap * nodes // BLOCK_BYTES
    return {"axis": axis, "fraction": frac, "nodes": nodes, "pool_bytes_per_node": cap, "blocks": held,
            "of_live": held / sizes.live, "of_distinct": held / sizes.distinct,
            "floored": _pages(sizes.blocks(axis) * frac, nodes) < MIN_POOL}


def columns(points: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """What a sweep records of its pools (``point``s): one list per key of ``POINT_KEYS``."""
    return {k: [p[k] for p in points] for k in POINT_KEYS}


def prompt_blocks(chained: list[sim.Chained]) -> int:
    """Whole prompt blocks of the trace: the denominator of every token hit rate."""
    return sum(c.prompt_blocks for c in chained)


def hit_rate(chained: list[sim.Chained], cap: int, label: str) -> float:
    """Token hit rate of ``chained`` against one pool of ``cap`` bytes, in process: a
    ``BlockStore`` (``label`` a key of ``IN_STORE``) or the offline ``"belady"``."""
    if label == "belady":
        hits = sim.belady(chained, cap // BLOCK_BYTES)
    else:
        eviction, admit = IN_STORE[label]
        hits = sim.in_store(chained, cap, BLOCK_BYTES, PAGE, eviction, admit)
    return float(hits.sum() / prompt_blocks(chained))


def axis_sweep(chained: list[sim.Chained], sizes: Sizes, axis: str, fracs: Sequence[float],
               labels: Sequence[str]) -> dict[str, Any]:
    """In-process hit rates per label at ``fracs`` of the ``axis`` size, with what each pool holds."""
    points = [point(sizes, axis, f) for f in fracs]
    out: dict[str, Any] = {"axis": axis, "fractions": list(fracs), **columns(points)}
    for label in labels:
        out[label] = [hit_rate(chained, p["pool_bytes_per_node"], label) for p in points]
    return out


def ring_sweep(chained: list[sim.Chained], sizes: Sizes, nodes: int = 3) -> dict[str, Any]:
    """In-process ``nodes``-node cluster (``sim.in_cluster``) at ``RING_FRACS`` of the live
    working set, per (eviction, ring points per node) of ``RING``."""
    points = [point(sizes, "live", f, nodes) for f in RING_FRACS]
    out: dict[str, Any] = {"fractions": RING_FRACS, "nodes": nodes, **columns(points)}
    for eviction, vnodes in RING:
        out[f"{eviction}-{vnodes}"] = [
            float(sim.in_cluster(chained, nodes, p["pool_bytes_per_node"], BLOCK_BYTES, PAGE, eviction,
                                 vnodes).sum() / prompt_blocks(chained)) for p in points]
    return out


def describe(chained: list[sim.Chained], sizes: Sizes) -> dict[str, Any]:
    """The trace's sizes and its infinite-cache hit rate."""
    whole = prompt_blocks(chained)
    return {"requests": len(chained), "distinct_blocks": sizes.distinct,
            "live_working_set_blocks": sizes.live, "prompt_blocks": whole,
            "infinite_hit_rate": float(sim.infinite(chained).sum() / whole)}


def in_process(mix: Mix, seed: int, plan: Plan) -> dict[str, Any]:
    """Another trace (``mix``, ``seed``) in process only: ``describe`` and one ``axis_sweep``
    per (axis, fractions, labels) of ``plan``, under ``of_<axis>``."""
    chained = sim.chain(generate(mix, seed), BLOCK)
    sizes = Sizes.of(chained)
    return {"seed": seed, **describe(chained, sizes),
            **{f"of_{axis}": axis_sweep(chained, sizes, axis, fracs, labels) for axis, fracs, labels in plan}}


def longer(mix: Mix, m: int) -> Mix:
    """``mix`` ``m`` times longer at the same arrival rate: ``m`` times the sessions, ``m`` times the span."""
    return dataclasses.replace(mix, sessions=mix.sessions * m, span_s=mix.span_s * m)


def share_text(of_live: float, of_distinct: float, floored: bool) -> str:
    """``25% of live, 11% of distinct``: what a pool holds (``, MIN_POOL``: raised to the floor)."""
    return f"{of_live:.0%} of live, {of_distinct:.0%} of distinct" + (", MIN_POOL" if floored else "")


def sweep_text(sweep: dict[str, Any], labels: Sequence[str]) -> str:
    """``shares: label rate ...`` per pool of an ``axis_sweep`` (or ``ring_sweep``)."""
    return "; ".join(f"{share_text(*shares)}: " + " ".join(f"{la} {sweep[la][i]:.4f}" for la in labels)
                     for i, shares in enumerate(zip(sweep["of_live"], sweep["of_distinct"], sweep["floored"],
                                                    strict=True)))


def trace_text(row: dict[str, Any]) -> str:
    """One line of ``describe``: requests, both sizes, the infinite cache."""
    live, distinct = row["live_working_set_blocks"], row["distinct_blocks"]
    return (f"{row['requests']} requests, {distinct} distinct blocks ever saved, live working set {live} "
            f"blocks ({live / distinct:.0%} of them), infinite-cache hit rate {row['infinite_hit_rate']:.4f}")


def print_in_process(title: str, rows: list[dict[str, Any]], plan: Plan) -> None:
    """The ``--lengths`` or ``--seeds`` rows, one block each."""
    for row in rows:
        print(f"  {title} {row[title]}: {trace_text(row)}", flush=True)
        for axis, _, labels in plan:
            print(f"    of {axis}: {sweep_text(row['of_' + axis], labels)}", flush=True)


def summarise(rep: Any, infinite_hit: int) -> dict[str, Any]:
    """A replay's hit rate (of whole-block prompt tokens, and of the infinite cache's), traffic, latency."""
    loads = rep.load_s[~np.isnan(rep.load_s)]
    whole = int(np.sum(rep.prompt // BLOCK * BLOCK))
    return {
        "hit_rate": float(rep.hit.sum() / whole), "vs_infinite": float(rep.hit.sum() / infinite_hit),
        "bytes_loaded": int(rep.hit.sum() // BLOCK * BLOCK_BYTES),
        "bytes_saved_sent": int(rep.saved_blocks * BLOCK_BYTES),
        "load_ms_p50": float(np.percentile(loads, 50) * 1e3),
        "load_ms_p99": float(np.percentile(loads, 99) * 1e3),
        "save_ms_p50": float(np.nanpercentile(rep.save_s, 50) * 1e3),
    }


def run_daemons(trace: list[Any], chained: list[sim.Chained], work: Path, sizes: Sizes,
                points: Sequence[tuple[str, float]], nodes: int, zookeeper: Any, out: dict[str, Any]) -> Any:
    """Replays per policy and (axis, fraction) of ``points`` against ``nodes`` real daemons,
    appended to ``out["daemon"]``; returns the standalone ``prefix`` replay at 50% of the live
    working set (for TTFT), or None. A standalone row also has the in-process hit rate of the
    same pool (``in_process``), which the daemon should equal."""
    from ems import CcKvOption

    option = CcKvOption(write_rcache=False) if nodes > 1 else None
    inf_hits = int(sim.infinite(chained).sum() * BLOCK)
    keep = None
    for policy in POLICIES:
        for axis, frac in points:
            where = point(sizes, axis, frac, nodes)
            name = f"{'cluster' if nodes > 1 else 'solo'}-{policy}-{axis}-{int(frac * 100)}"
            dep = daemons.start(work, nodes, where["pool_bytes_per_node"], policy, zookeeper, name=name)
            try:
                ccs = daemons.connect(dep, "workload")
                t0 = time.perf_counter()
                rep = replay(trace, ccs, option)
                took = time.perf_counter() - t0
                reserved = sum(n.metric("emsd_op_bytes_total", f'op="{op}"')  # new blocks saved:
                               for n in dep.nodes for op in ("reserve", "put"))  # two-step or by PUT
            finally:
                dep.stop()
            row = {**where, "policy": policy, **summarise(rep, inf_hits), "seconds": took,
                   "bytes_saved_new": int(reserved)}
            if nodes == 1:
                row["in_process"] = hit_rate(chained, where["pool_bytes_per_node"], policy)
            out.setdefault("daemon", []).append(row)
            print(f"  {name:>26}: {where['blocks']} blocks "
                  f"({share_text(where['of_live'], where['of_distinct'], where['floored'])}): "
                  f"hit {row['hit_rate']:.4f} ({row['vs_infinite']:.3f} of infinite"
                  + (f"; in process {row['in_process']:.4f}" if nodes == 1 else "")
                  + f"), load p50 {row['load_ms_p50']:.2f} ms, {took:.1f} s", flush=True)
            if policy == "prefix" and (axis, frac, nodes) == ("live", 0.5, 1):
                keep = rep
    return keep


def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small trace; cluster at 50%% only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--plots", type=Path, help="directory for the PNGs (default: docs/, or a "
                    "temporary directory with --quick, so that docs/ keeps the full run's)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the 3-node cluster")
    ap.add_argument("--lengths", type=ints, default=[], metavar="M,...",
                    help="in process: the trace M times longer at the same arrival rate (e.g. 1,2,4)")
    ap.add_argument("--seeds", type=ints, default=[], metavar="S,...",
                    help="in process: other seeds at 25/50/100%% of live and 50%% of distinct (e.g. 2,3)")
    args = ap.parse_args()
    if args.plots is None:
        args.plots = Path(tempfile.gettempdir()) / "emsd-workload-quick" if args.quick else Path("docs")
    started = time.perf_counter()
    mix = quick_mix() if args.quick else Mix()
    trace = generate(mix, args.seed)
    chained = sim.chain(trace, BLOCK)
    sizes = Sizes.of(chained)
    out: dict[str, Any] = {
        "seed": args.seed, "quick": args.quick,
        "kinds": {k: sum(r.kind == k for r in trace) for k in ("chat", "agent", "oneoff")},
        **describe(chained, sizes), "block_tokens": BLOCK, "block_bytes": BLOCK_BYTES,
    }
    print(f"trace: {trace_text(out)}; {out['kinds']}", flush=True)

    labels = (*IN_STORE, "belady")
    out["sweep"] = axis_sweep(chained, sizes, "live", QUICK_FRACS if args.quick else SWEEP_FRACS, labels)
    print("in process: " + sweep_text(out["sweep"], labels), flush=True)
    out["ring_sweep"] = ring_sweep(chained, sizes)
    print("in process, 3 nodes (eviction-ring points): "
          + sweep_text(out["ring_sweep"], [f"{e}-{v}" for e, v in RING]), flush=True)
    out["lengths"] = [{"multiple": m, **in_process(longer(mix, m), args.seed, LENGTH_PLAN)}
                      for m in args.lengths]
    print_in_process("multiple", out["lengths"], LENGTH_PLAN)
    out["seeds"] = [in_process(mix, s, SEED_PLAN) for s in args.seeds]
    print_in_process("seed", out["seeds"], SEED_PLAN)

    with tempfile.TemporaryDirectory(dir=SHM, prefix="emsd-workload-") as tmp:
        work = Path(tmp)
        print("standalone daemon:", flush=True)
        solo = run_daemons(trace, chained, work, sizes,
                           [("live", f) for f in GOAL_FRACS] + [("distinct", 0.5)], 1, None, out)
        probe_dep = daemons.start(work, 1, 320 << 20, "prefix", name="probe", page=16 << 20)
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
                run_daemons(trace, chained, work, sizes,
                            [("live", f) for f in ([0.5] if args.quick else GOAL_FRACS)], 3, zookeeper, out)
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
    out["ttft_replay"] = {"policy": "prefix", "axis": "live", "fraction": 0.5,
                          "mean_with_s": float(req_with.mean()), "mean_without_s": float(req_without.mean()),
                          "ratio_of_means": float(req_with.mean() / req_without.mean())}
    out["seconds"] = time.perf_counter() - started
    for c, w, wo, wp in zip(CONTEXTS.tolist(), with_cache.tolist(), without.tolist(), with_pcie.tolist(),
                            strict=True):
        print(f"  TTFT at {c:>7} tokens: {wo * 1e3:9.1f} ms -> {w * 1e3:8.1f} ms (1/{wo / w:.1f}); "
              f"at {PCIE_BPS / 1e9:.0f} GB/s: {wp * 1e3:8.1f} ms (1/{wo / wp:.1f})")
    print(f"replay (standalone, prefix, 50% of the live working set): mean modelled TTFT "
          f"{req_without.mean() * 1e3:.1f} ms -> {req_with.mean() * 1e3:.1f} ms; "
          f"run took {out['seconds']:.0f} s")
    if args.json:  # before the plots: a run's figures are kept whatever happens to them
        args.json.write_text(json.dumps(out, indent=1))
    if importlib.util.find_spec("matplotlib") is None:
        print("plots not written: matplotlib is not installed (pip install -e '.[bench]')")
        return
    plot_hit_rate(out, args.plots)
    plot_ttft(out, solo, req_with, req_without, args.plots)
    print(f"plots in {args.plots}/workload_hit_rate.png and workload_ttft.png")


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def daemon_rows(out: dict[str, Any], policy: str, nodes: int, axis: str) -> list[dict[str, Any]]:
    """The real-daemon rows of one policy, deployment size and capacity axis, in run order."""
    return [r for r in out.get("daemon", []) if (r["policy"], r["nodes"], r["axis"]) == (policy, nodes, axis)]


def plot_hit_rate(out: dict[str, Any], directory: Path) -> None:
    """``workload_hit_rate.png``: token hit rate against pool capacity as % of the live working
    set (log scale; top axis: % of the distinct blocks ever saved), in process and on real
    daemons; below it ``prefix``'s lead over ``lru`` in points."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.ticker import NullLocator

    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7.0, 6.8), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1.3]})
    sw = out["sweep"]
    x = np.array(sw["of_live"]) * 100
    for label, style in (("lru", "o-"), ("prefix", "s-"), ("prefix+admit2", "^--")):
        ax.plot(x, sw[label], style, ms=4, label=f"{label} (in process)")
    ax.plot(x, sw["belady"], "k:", marker="x", label="Belady (offline: knows the future)")
    ax.axhline(out["infinite_hit_rate"], color="grey", ls=":", label="infinite cache")
    dx.plot(x, (np.array(sw["prefix"]) - np.array(sw["lru"])) * 100, "s-", ms=4, color="tab:orange",
            label="in process")
    handles, names = ax.get_legend_handles_labels()
    for nodes, axis, face, edge, name in ((1, "live", "none", "black", "standalone daemon"),
                                          (3, "live", "black", "black", "3-node cluster daemons"),
                                          (1, "distinct", "none", "tab:red", "standalone, 50% of distinct")):
        pair = [daemon_rows(out, policy, nodes, axis) for policy in POLICIES]
        if not pair[0]:
            continue
        marks = tuple(ax.scatter([r["of_live"] * 100 for r in rows], [r["hit_rate"] for r in rows], marker=m,
                                 s=70, facecolors=face, edgecolors=edge, zorder=3)
                      for rows, m in zip(pair, "os", strict=True))
        handles.append(marks)
        names.append(f"{name} (lru, prefix)")
        dx.scatter([r["of_live"] * 100 for r in pair[1]],
                   [(p["hit_rate"] - q["hit_rate"]) * 100 for p, q in zip(pair[1], pair[0], strict=True)],
                   marker="D", s=40, facecolors=face, edgecolors=edge, zorder=3, label=name)
    ax.axvline(100, color="tab:purple", ls="--", lw=1)
    ax.text(104, 0.66, f"live working set\n= {out['live_working_set_blocks']:,} blocks", fontsize=7,
            color="tab:purple", transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ticks = [f * 100 for f in sw["fractions"]]
    dx.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    dx.xaxis.set_minor_locator(NullLocator())
    scale = out["live_working_set_blocks"] / out["distinct_blocks"]
    top = ax.secondary_xaxis("top", functions=(lambda v: v * scale, lambda v: v / scale))
    top.set_xticks([t for t in (2, 5, 10, 25, 50, 100) if ticks[0] * scale <= t <= ticks[-1] * scale * 1.05])
    top.xaxis.set_minor_locator(NullLocator())
    top.set_xticklabels([f"{t:g}%" for t in top.get_xticks()])
    top.set_xlabel(f"% of the distinct blocks ever saved ({out['distinct_blocks']:,})", fontsize=8)
    ax.set_ylabel("token hit rate")
    ax.set_title(f"Hit rate vs capacity ({out['requests']} requests, seed {out['seed']})", fontsize=10)
    ax.legend(handles, names, fontsize=7, handler_map={tuple: HandlerTuple(ndivide=None)}, loc="lower right")
    ax.grid(alpha=0.3)
    dx.axhline(0, color="grey", lw=0.8)
    dx.set_xlabel("pool capacity, % of the live working set")
    dx.set_ylabel("prefix − lru, points")
    dx.legend(fontsize=7, loc="upper right")
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "workload_hit_rate.png", dpi=110)
    plt.close(fig)


def plot_ttft(out: dict[str, Any], solo: Any, req_with: np.ndarray, req_without: np.ndarray,
              directory: Path) -> None:
    """``workload_ttft.png``: modelled TTFT against context length, and per bin of the
    standalone ``prefix`` replay at 50% of the live working set."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
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
    ax.loglog(mids, w, "bo", label="replay, with emsd (prefix, 50% of the live working set)")
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
