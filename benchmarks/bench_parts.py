"""What a cluster's loads in parts cost: a load that ends at a miss, and a large local load.

    python benchmarks/bench_parts.py [--reps N] [--checksum] [--json]

A ZooKeeper and two clustered daemons on loopback with 1 GiB pools (so HELLO's
``part``, ``Service.load_part``, is 64 MiB), and an SDK client of node B.
Medians over ``--reps`` loads (51 for the small ones) of:

- a local load of 96 blocks of 2 MiB (192 MiB, three times ``part``) that
  node B owns, as the SDK loads it (a PIN brings at most ``part`` bytes from
  elsewhere, ``PinRequest.bring``, and pins what is here however much: one
  PIN), and in parts of at most ``part`` bytes, one PIN each (the
  connection's HELLO ``bring`` removed in this process, as against an emsd
  that does not offer it, and as every load did before 2026-12-02), the two
  loads taken in turn;
- a load of one block node A owns (a copy of it is on B by then), and the same
  followed by one block that is nowhere: a PIN whose answer does not say
  ``more`` (``PinAnswer``: its fetch found room for what the owners had) ends
  the load; and that load again with the connection's HELLO ``more`` removed
  in this process, as against an emsd that does not offer it (and as every
  load did before 2026-12-02): the SDK then pins the rest once more; these two
  also taken in turn;
- a load of one block that is nowhere, alone.

Beside each median, the PINs node B served a load of that case (its /metrics).
``--checksum`` turns on ``pool.checksum`` on both daemons. There is then no
shared index, so the local load goes through the daemon, in parts. Every
load is checked to have loaded what it should. What it is for: telling what
the parts cost, before and after a change to them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import torch  # noqa: E402
import zk  # noqa: E402
from bench_cluster import POOL, cluster_work, keys_owned_by, sdk, start_member  # noqa: E402

from ems import CcConfig, Ems  # noqa: E402
from ems.namespace import namespace_name  # noqa: E402
from emsd.placement import ClusterView, Member, Ring  # noqa: E402

BLOCK = 2 << 20
LOCAL = 96  # blocks of the local load: 192 MiB, three parts of 64 MiB


def pins(port: int) -> float:
    """PINs the daemon with metrics on ``port`` has answered OK since it started."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith('emsd_ops_total{op="pin",result="ok"} '):
                return float(line.split()[-1])
    return 0.0


def median_ms(load: Callable[[], Any], want: int, reps: int) -> float:
    """Median milliseconds of ``load()``; each must load ``want`` blocks."""
    took: list[float] = []
    for _ in range(reps):
        t = time.perf_counter()
        res = load()
        took.append(time.perf_counter() - t)
        if res.success != want:
            raise RuntimeError(f"a load loaded {res.success} blocks, not {want}")
    took.sort()
    return took[len(took) // 2] * 1e3


def run(reps: int, checksum: bool) -> dict[str, float]:
    """One run (see the module docstring): per case its median in ms, and under the case's
    name with ``_pins`` the PINs node B served a load of it; ``part_mib``, ``shared_index``."""
    with contextlib.ExitStack() as stack:
        work, server, secret = cluster_work(stack, "emsd-parts-")
        socks: list[Path] = []
        port, out = 0, {}
        for name in ("a", "b"):
            proc, sock, port = start_member(work, name, server.hosts, secret,
                                            pool=f"checksum = {str(checksum).lower()}\n")
            stack.callback(proc.wait, 30)
            stack.callback(proc.terminate)
            socks.append(sock)

        def case(name: str, load: Callable[[], Any], want: int, n: int) -> None:
            """``out[name]``: the median ms of ``load``; ``out[name + "_pins"]``: B's PINs a load."""
            before = pins(port)  # node B's, the last started
            out[name] = median_ms(load, want, n)
            out[name + "_pins"] = (pins(port) - before) / n

        def alternating(cases: list[tuple[str, Callable[[], Any]]], want: int, n: int) -> None:
            """``case`` for each of ``cases``, their loads taken in turn (the order reversed every
            round), so that neither meets the host's slow spells or the run's warm-up alone."""
            took: dict[str, list[float]] = {name: [] for name, _ in cases}
            pinned = dict.fromkeys(took, 0.0)
            for r in range(n):
                for name, load in cases if r % 2 == 0 else cases[::-1]:
                    before = pins(port)
                    took[name].append(median_ms(load, want, 1))
                    pinned[name] += pins(port) - before
            for name, ms in took.items():
                out[name] = sorted(ms)[len(ms) // 2]
                out[name + "_pins"] = pinned[name] / n

        time.sleep(1.0)  # both views settle (membership is event-driven)
        ns = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="bench"), "")
        ring = Ring.build(ClusterView.of([Member("a", POOL), Member("b", POOL)]))
        cc = sdk(socks[1])
        stack.callback(Ems._reset)  # the connection closes before the daemons stop
        kv = torch.randint(0, 255, (2 * LOCAL, BLOCK), dtype=torch.uint8)
        cc.register_kvcache([[kv.view(2 * LOCAL, 1, BLOCK)]])
        client = cc._connected()
        part = int(client.info["part"])
        out["part_mib"], out["shared_index"] = part / (1 << 20), float(client.index is not None)
        mine = keys_owned_by("b", LOCAL, 1_000_000, ns, ring)
        if cc.save(list(range(LOCAL)), hashes=mine, offsets=[1] * LOCAL).success != LOCAL:
            raise RuntimeError("the local blocks were not all saved")
        slots = list(range(LOCAL, 2 * LOCAL))

        def local() -> Any:
            return cc.load(slots, hashes=mine, offsets=[1] * LOCAL)

        def in_parts() -> Any:  # as against an emsd whose HELLO offers no bring
            bring = client.info.pop("bring")
            try:
                return local()
            finally:
                client.info["bring"] = bring

        alternating([("local_ms", local), ("local_parts_ms", in_parts)], LOCAL, reps)
        there = keys_owned_by("a", 1, 5_000_000, ns, ring)
        nowhere = keys_owned_by("a", 2, 7_000_000, ns, ring)
        if cc.save([0], hashes=there, offsets=[1]).success != 1:
            raise RuntimeError("the remote block was not saved")
        small = max(reps, 51)
        case("one_remote_ms", lambda: cc.load([LOCAL], hashes=there, offsets=[1]), 1, small)

        def then_miss() -> Any:
            return cc.load([LOCAL, LOCAL + 1], hashes=there + nowhere[:1], offsets=[1, 1])

        def pinned_again() -> Any:  # as against an emsd whose HELLO offers no ``more``
            more = client.info.pop("more")
            try:
                return then_miss()
            finally:
                client.info["more"] = more

        alternating([("one_then_miss_ms", then_miss), ("one_then_miss_pinned_again_ms", pinned_again)],
                    1, small)
        case("miss_ms", lambda: cc.load([LOCAL], hashes=nowhere[1:], offsets=[1]), 0, small)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7,
                    help="loads a case, medians (default 7; at least 51 for one block)")
    ap.add_argument("--checksum", action="store_true", help="pool.checksum on both daemons (no shared index)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    if why := zk.available():
        sys.exit(f"no ZooKeeper: {why}")
    r = run(args.reps, args.checksum)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"part {r['part_mib']:.0f} MiB, shared index {'on' if r['shared_index'] else 'off'}")
    for name, what in (("local_ms", f"local load of {LOCAL} x 2 MiB"),
                       ("local_parts_ms", f"local load of {LOCAL} x 2 MiB, in parts (HELLO's bring removed)"),
                       ("one_remote_ms", "one block of the other node's (a copy here by then)"),
                       ("one_then_miss_ms", "the same, then one block that is nowhere"),
                       ("one_then_miss_pinned_again_ms", "the same, pinned again (HELLO's more removed)"),
                       ("miss_ms", "that block alone")):
        print(f"{what}: {r[name]:.2f} ms p50, {r[name + '_pins']:.0f} PIN(s) a load")


if __name__ == "__main__":
    main()
