"""One block a call to another node: latency and where the CPU goes, node by node.

    python benchmarks/bench_remote_one.py [--n N] [--rounds R] [--busy-poll US] [--json]

A ZooKeeper and two clustered daemons on loopback (bench_cluster's helpers), and
one SDK client of node A (``benchmarks/peers``' emsd-remote client). Each round
saves ``--n`` fresh 64 KiB blocks that node B owns, one a call with
``write_rcache`` off (A forwards each to B and keeps no copy), then loads each
once, one a call (A fetches it from B, the SDK copies it out). Reported per
round: p50 and p90 of each call, and the CPU (user and system) that node A,
node B and the client used per call, read from ``/proc`` around each phase.
The first round warms up; the last one's figures are the result (``--json``:
every round). Every load is checked to have found its block. ``--busy-poll US``
sets both daemons' ``node.busy_poll`` and the client's ``EMS_BUSY_POLL_US``
(0: everyone sleeps while waiting, so the CPU figures are work, not polling).

What it is for: the node the client asks (A) is where a one-block remote call
spends its time (docs/benchmarks.md, "Two nodes"); its CPU per call is steadier
than the latency on this shared machine, so changes to that path are compared
with it, in alternating runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "peers"), str(ROOT / "tests")]
import zk  # noqa: E402
from bench_cluster import POOL, cluster_work, start_daemon  # noqa: E402
from clients.emsd_remote_client import EmsdRemoteClient  # noqa: E402

from ems.client import BUSY_POLL_ENV  # noqa: E402

SIZE = 64 << 10


def _cpu(procs: list[psutil.Process]) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in procs]


def _phase(name: str, calls: list[int], step: Callable[[list[int], int], None],
           procs: list[psutil.Process]) -> dict[str, float]:
    """Run ``step(key, i)`` for each of ``calls``: p50/p90 microseconds a call and CPU
    microseconds a call of A, B and this client."""
    before, took = _cpu(procs), []
    for i, key in enumerate(calls):
        t0 = time.perf_counter()
        step([key], i)
        took.append(time.perf_counter() - t0)
    after = _cpu(procs)
    took.sort()
    per = [(b - a) / len(calls) * 1e6 for a, b in zip(before, after, strict=True)]
    return {f"{name}_p50_us": took[len(took) // 2] * 1e6, f"{name}_p90_us": took[int(len(took) * 0.9)] * 1e6,
            f"{name}_cpu_a_us": per[0], f"{name}_cpu_b_us": per[1], f"{name}_cpu_client_us": per[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="blocks a round (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the first a warm-up (default 3)")
    ap.add_argument("--busy-poll", type=int, default=None, metavar="US",
                    help="node.busy_poll of both daemons and the client's EMS_BUSY_POLL_US (default: theirs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    node = ""
    if args.busy_poll is not None:
        node = f"busy_poll = {args.busy_poll}\n"
        os.environ[BUSY_POLL_ENV] = str(args.busy_poll)  # read when the SDK connects, below
    why = zk.available()
    if why:
        sys.exit(f"no ZooKeeper: {why}")
    rounds = []
    with contextlib.ExitStack() as stack:
        work, server, secret = cluster_work(stack, "emsd-remote-one-")
        nodes = {}
        for name in ("a", "b"):
            proc, sock = start_daemon(work, name, server.hosts, secret, node=node)
            stack.callback(proc.wait, 30)
            stack.callback(proc.terminate)
            nodes[name] = (proc, sock)
        time.sleep(1.0)  # both views settle (membership is event-driven)
        client = EmsdRemoteClient(nodes["a"][1], args.n * SIZE, POOL)
        stack.callback(client.close)
        client.prepare(SIZE, args.n)
        procs = [psutil.Process(nodes["a"][0].pid), psutil.Process(nodes["b"][0].pid), psutil.Process()]
        for r in range(args.rounds):
            keys = list(range(r * 10 * args.n, r * 10 * args.n + args.n))
            client.plan(keys)
            put = _phase("put", keys, client.put, procs)
            rounds.append({**put, **_phase("get", keys, client.get, procs)})
            print(f"[remote-one] round {r} done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rounds, indent=2))
        return
    last = rounds[-1]
    for op in ("put", "get"):
        print(f"{op}: p50 {last[f'{op}_p50_us']:.0f} us, p90 {last[f'{op}_p90_us']:.0f} us; CPU a call: "
              f"node A {last[f'{op}_cpu_a_us']:.0f} us, node B {last[f'{op}_cpu_b_us']:.0f} us, "
              f"client {last[f'{op}_cpu_client_us']:.0f} us")


if __name__ == "__main__":
    main()
