"""Remote save and load through two daemons, for several ``cluster.peer_socket_buffer`` values.

    python benchmarks/bench_socket_buffer.py [--sizes 256KiB,4MiB,0] [--rounds 3] [--calls 6] [--json]

For each round and each size, in turn (so that the machine's background load
hits all sizes alike): a ZooKeeper-joined pair of daemons on loopback
(``bench_cluster.start_daemon``) with that socket buffer on both, then
``--calls`` saves through node A of 32 blocks of 2 MiB that node B owns
(write_rcache off: A forwards them and drops its copy), each followed by a
load of the same blocks through A (A fetches them from B). Reports the
median GB/s per size over all rounds, and each size's ratio to the first
one. Size 0 leaves the buffers to the kernel's autotuning. About 20 s a
round for three sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cluster as bc  # noqa: E402

from emsd.config import ConfigError, parse_size  # noqa: E402
from emsd.placement import ClusterView, Member, Ring  # noqa: E402


def parse_sizes(text: str) -> list[int]:
    """Byte counts of a comma-separated list like "256KiB,4MiB,0"; raises ValueError."""
    try:
        sizes = [parse_size("--sizes", part.strip()) for part in text.split(",")]
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if len(set(sizes)) != len(sizes):
        raise ValueError("--sizes names a size twice")
    return sizes


def label(size: int) -> str:
    """"256 KiB", "4 MiB", "autotuning" (0)."""
    if not size:
        return "autotuning"
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def one_pair(work: Path, zk_hosts: str, secret: Path, size: int, calls: int, first_key: int,
             kv: list[list[torch.Tensor]]) -> tuple[list[float], list[float]]:
    """Seconds of each remote save and load of ``calls`` batches through a fresh pair of daemons
    in ``work``, which is removed afterwards (their pool files are there, in tmpfs)."""
    from ems import CcConfig, CcKvOption, Ems
    from ems.namespace import namespace_name

    extra = f"peer_socket_buffer = {size}\n"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a, sock_a = bc.start_daemon(work, "a", zk_hosts, secret, extra)
        procs.append(a)
        b, _ = bc.start_daemon(work, "b", zk_hosts, secret, extra)
        procs.append(b)
        time.sleep(1.0)  # both views settle
        ns = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="bench"), "")
        ring = Ring.build(ClusterView.of([Member("a", bc.POOL), Member("b", bc.POOL)]))
        cc = bc.sdk(sock_a)
        cc.register_kvcache(kv)
        slots, offsets = list(range(bc.BATCH * bc.TOKENS)), [bc.TOKENS] * bc.BATCH
        option = CcKvOption(write_rcache=False)
        saves, loads = [], []
        for call in range(calls + 1):  # call 0 warms up links and pages
            keys = bc.keys_owned_by("b", bc.BATCH, first_key + 1_000_000 * call, ns, ring)
            t0 = time.perf_counter()
            assert cc.save(slots, hashes=keys, offsets=offsets, option=option).success == bc.BATCH
            t1 = time.perf_counter()
            assert cc.load(slots, hashes=keys, offsets=offsets, option=option).success == bc.BATCH
            t2 = time.perf_counter()
            if call:
                saves.append(t1 - t0)
                loads.append(t2 - t1)
        Ems._reset()
        return saves, loads
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256KiB,4MiB,0", help="peer_socket_buffer values; the first is "
                    "the one the others are compared with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=6, help="saves and loads per size and round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        ap.error(str(exc))
    kv = [[torch.randn(2 * bc.BATCH, bc.TOKENS, bc.HEADS, bc.DIM).to(torch.float16) for _ in range(2)]
          for _ in range(bc.LAYERS)]
    nbytes = bc.BATCH * bc.LAYERS * 2 * bc.TOKENS * bc.HEADS * bc.DIM * 2
    saves: dict[int, list[float]] = {s: [] for s in sizes}
    loads: dict[int, list[float]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(dir=bc.SHM) as tmp:
        work = Path(tmp)
        server = bc.zk.ZooKeeperServer(work / "zk").start()
        secret = work / "secret"
        secret.write_text("benchmark-cluster-secret\n")
        secret.chmod(0o600)  # emsd refuses a secret others can read
        try:
            for r in range(args.rounds):
                for i, size in enumerate(sizes):
                    print(f"[socket-buffer] round {r + 1}/{args.rounds}: {label(size)}", file=sys.stderr)
                    s, lo = one_pair(work / f"r{r}-{i}", server.hosts, secret, size, args.calls,
                                     10_000_000 * (1 + r * len(sizes) + i), kv)
                    saves[size] += s
                    loads[size] += lo
        finally:
            server.stop()
    save = {size: nbytes / statistics.median(saves[size]) / 1e9 for size in sizes}
    load = {size: nbytes / statistics.median(loads[size]) / 1e9 for size in sizes}
    rows = [{"size": size, "label": label(size), "save_gbps": save[size], "load_gbps": load[size],
             "save_vs_first": save[size] / save[sizes[0]], "load_vs_first": load[size] / load[sizes[0]]}
            for size in sizes]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"| peer_socket_buffer | remote save, {bc.BATCH} x 2 MiB | remote load | save / {rows[0]['label']} "
          f"| load / {rows[0]['label']} |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['label']} | {row['save_gbps']:.2f} GB/s | {row['load_gbps']:.2f} GB/s "
              f"| {row['save_vs_first']:.2f}x | {row['load_vs_first']:.2f}x |")


if __name__ == "__main__":
    main()
