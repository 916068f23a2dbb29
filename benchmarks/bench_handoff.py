"""A node joins a cluster that already holds blocks: what the newcomer finds, and what the handoff costs.

    python benchmarks/bench_handoff.py [--blocks N] [--json]

For ``cluster.handoff`` on and then off, on a fresh ZooKeeper and fresh
daemons each time: node A runs alone and an SDK client of A saves ``--blocks``
blocks of 2 MiB (32 layers of K and V, 16 tokens of 8 heads of 128 fp16: all
of them A's); then node B joins. With the handoff on, it waits until A's first
handoff pass has ended (``handoff`` in A's STATS). Then an SDK client of B asks
``exists`` of every key, one key a call (the blocks of B's share are looked up
on B, their owner now, the others on A). Reported per mode: B's share of the
keys, the keys found through B, and with the handoff on the blocks it moved,
the seconds its pass took (its STATS count) and its rate in GB/s. The
reference, measured in the same run: iperf3 over loopback (one stream, three
1-second runs, the median), against which the handoff's rate is a ratio.
Needs ZooKeeper (as the tests do) and iperf3 (Debian; without it the ratio is
left out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import zk  # noqa: E402
from bench_cluster import DIM, HEADS, LAYERS, POOL, TOKENS, Iperf3, cluster_work, sdk, start_daemon  # noqa: E402

from ems.client import DaemonClient  # noqa: E402
from emsd.placement import ClusterView, Member, Ring  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.transport.frames import Op  # noqa: E402

BATCH = 32
BLOCK_BYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 2


def _stats(sock: Path) -> dict[str, Any]:
    client = DaemonClient(sock / "emsd.sock")
    client.connect({})
    try:
        return client.call(Op.STATS, {}, timeout=10)[0]
    finally:
        client.close()


def _wait(cond: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            sys.exit(f"bench_handoff: {what} not reached in {timeout:g} s")
        time.sleep(0.1)


def run(blocks: int, handoff: bool) -> dict[str, Any]:
    """One cluster: A saves ``blocks`` blocks alone, B joins; what B finds (see the module docstring)."""
    mode = f"handoff = {'true' if handoff else 'false'}\n"
    with contextlib.ExitStack() as stack:
        work, server, secret = cluster_work(stack, "emsd-handoff-")
        a, sock_a = start_daemon(work, "a", server.hosts, secret, cluster=mode)
        stack.callback(a.wait, 30)
        stack.callback(a.terminate)
        kv = [[torch.randn(BATCH, TOKENS, HEADS, DIM).to(torch.float16) for _ in range(2)]
              for _ in range(LAYERS)]
        slots = list(range(BATCH * TOKENS))
        cc = sdk(sock_a)
        cc.register_kvcache(kv)
        keys = list(range(1, blocks + 1))
        for at in range(0, blocks, BATCH):
            part = keys[at : at + BATCH]
            saved = cc.save(slots[: len(part) * TOKENS], hashes=part, offsets=[TOKENS] * len(part))
            assert saved.success == len(part), saved
        print(f"[handoff] {'on' if handoff else 'off'}: {blocks} blocks saved on A alone; B joins",
              file=sys.stderr, flush=True)
        b, sock_b = start_daemon(work, "b", server.hosts, secret, cluster=mode)
        stack.callback(b.wait, 30)
        stack.callback(b.terminate)
        _wait(lambda: len(_stats(sock_a)["members"]) == 2, "A seeing B")
        if handoff:
            _wait(lambda: _stats(sock_a)["handoff"]["passes"] >= 1, "A's first handoff pass")
        handed = _stats(sock_a)["handoff"]
        owned_b = _stats(sock_b)["entries"] if handoff else None
        cc = sdk(sock_b)
        found = sum(cc.exists([k]).success for k in keys)
        share = _share(keys)
        out: dict[str, Any] = {"handoff": handoff, "blocks": blocks, "b_share": share,
                               "found_through_b": found}
        if handoff:
            out.update(moved=handed["moved"], kept=handed["kept"], seconds=handed["seconds"],
                       gbps=handed["moved"] * BLOCK_BYTES / max(handed["seconds"], 1e-9) / 1e9,
                       b_entries=owned_b)
        return out


def _share(keys: list[int]) -> int:
    """How many of ``keys`` B owns as primary, by the ring both nodes build (equal pools, the
    default vnodes), in the SDK's namespace for this model."""
    from ems import CcConfig
    from ems.namespace import namespace_name

    ns = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="bench"), "")
    ring = Ring.build(ClusterView.of([Member("a", POOL), Member("b", POOL)]))
    return sum(1 for o in ring.owner_ids(ns, KeyBatch.from_user(keys)) if o[0] == "b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256,
                    help="2 MiB blocks saved before the join (default 256)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    why = zk.available()
    if why:
        sys.exit(f"no ZooKeeper: {why}")
    runs = [run(args.blocks, True), run(args.blocks, False)]
    iperf = None
    if shutil.which("iperf3"):
        with Iperf3() as ip:
            for _ in range(3):
                ip.once()
            iperf = statistics.median(ip.runs)
    if args.json:
        print(json.dumps({"runs": runs, "iperf3_gbps": iperf}, indent=2))
        return
    for r in runs:
        line = (f"handoff {'on ' if r['handoff'] else 'off'}: B owns {r['b_share']} of {r['blocks']} keys; "
                f"found through B {r['found_through_b']} of {r['blocks']}")
        if r["handoff"]:
            ratio = f", {r['gbps'] / iperf:.2f}x iperf3 {iperf:.2f} GB/s" if iperf else ""
            line += (f"; the pass moved {r['moved']} ({r['kept']} kept) in {r['seconds']:.2f} s = "
                     f"{r['gbps']:.2f} GB/s{ratio}")
        print(line)


if __name__ == "__main__":
    main()
