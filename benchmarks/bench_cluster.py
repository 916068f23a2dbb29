"""Two emsd daemons on loopback: remote load and save throughput, against iperf3 and Redis.

    python benchmarks/bench_cluster.py [--json] [--rounds N]

Starts a ZooKeeper (Debian's package, as the tests do), two daemons joined
into one cluster, and measures:

- remote fetch: node A pulls 32 blocks of 2 MiB owned by node B into its
  pool (a PIN on A's control socket: daemon to daemon, no tensor copy);
- remote load, end to end through the SDK: blocks owned by node B loaded
  by a client of node A (A fetches them from B into its pool, then the SDK
  copies them into tensors);
- remote save: a client of A saves blocks owned by B with write_rcache off
  (A forwards them to B and drops its copy);
- daemon CPU seconds per remote block (both daemons, psutil);

and in the same run, interleaved round by round with emsd's so that the
machine's background load hits both alike, the references: iperf3 over
loopback (one stream, 1 s a round), and Redis GET of the same 2 MiB
values, single and pipelined (redis-py with hiredis), taking the better, and
like for like with emsd's load and save, which end in (start from) the
caller's buffers: each GET's value copied into a destination, and SETs of
values taken from a buffer; each figure is the median over the rounds.
Needs iperf3, redis-server (Debian) and redis[hiredis] (pip); a missing
reference is reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import daemon_ready  # benchmarks/, on the path when run from there or imported by its siblings
import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None  # daemons keep their pool files beside the socket
sys.path.insert(0, str(ROOT / "tests"))
import zk  # noqa: E402
from bench_sdk import wait_filled  # noqa: E402

from emsd.placement import ClusterView, Member, Ring  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402

POOL = 1 << 30
LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128  # 2 MiB blocks in fp16
BATCH = 32
MiB = 1 << 20


def start_daemon(work: Path, name: str, zk_hosts: str, secret: Path,
                 cluster: str = "", node: str = "") -> tuple[subprocess.Popen[bytes], Path]:
    """Daemon ``name`` of cluster "bench", ready; ``cluster``, ``node``: more ``[cluster]`` and
    ``[node]`` lines."""
    proc, sock, _ = start_member(work, name, zk_hosts, secret, cluster, node)
    return proc, sock


def start_member(work: Path, name: str, zk_hosts: str, secret: Path, cluster: str = "", node: str = "",
                 pool: str = "") -> tuple[subprocess.Popen[bytes], Path, int]:
    """``start_daemon``, with ``pool``: more ``[pool]`` lines; also its metrics port."""
    sock = work / name / "sock"
    sock.parent.mkdir(parents=True)
    port, peer = zk.free_port(), zk.free_port()
    cfg = work / name / "emsd.toml"
    cfg.write_text(
        f'[node]\nid = "{name}"\nsocket_dir = "{sock}"\n{node}'
        f'[pool]\nsize = "{POOL >> 20}MiB"\nhugepages = "auto"\npage_size = "64MiB"\n{pool}'
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n[log]\nlevel = "warning"\n'
        f'[cluster]\nname = "bench"\nzookeeper = "{zk_hosts}"\npeer_listen = "127.0.0.1:{peer}"\n'
        f'secret_file = "{secret}"\nsession_timeout = 4\n{cluster}')
    proc = subprocess.Popen([sys.executable, "-m", "emsd", "--config", str(cfg)], cwd=ROOT)
    daemon_ready.wait(port, proc, f"emsd {name}")
    return proc, sock, port


def cluster_work(stack: contextlib.ExitStack, prefix: str) -> tuple[Path, Any, Path]:
    """A work directory (on tmpfs where there is one), a ZooKeeper started in it and a cluster
    secret file, each undone by ``stack``: (directory, server, secret)."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=SHM))
    stack.callback(shutil.rmtree, work, True)
    # the daemons' pool keepers outlive a killed daemon (warm restart): stop them too
    stack.callback(subprocess.run, ["pkill", "-f", f"keeper --detach {work}"], check=False)
    server = zk.ZooKeeperServer(work / "zk").start()
    stack.callback(server.stop)
    secret = work / "secret"
    secret.write_text(f"{prefix}cluster-secret\n")
    secret.chmod(0o600)  # emsd refuses a secret others can read
    return work, server, secret


def sdk(sock: Path) -> Any:
    from ems import CcConfig, Ems, EmsConfig

    os.environ["EMS_SOCKET_DIR"] = str(sock)
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="bench")))
    return Ems.get_cc()


def keys_owned_by(owner: str, n: int, start: int, namespace: str, ring: Ring) -> list[int]:
    cand = np.arange(start, start + 8 * n, dtype=np.uint64)
    owners = np.array(ring.owner_ids(namespace, KeyBatch.from_ints(cand)))[:, 0]
    picked = cand[owners == owner][:n]
    assert picked.size == n
    return [int(k) for k in picked]


def daemon_fetch(sock: Path, ns_name: str, keys: list[int]) -> float:
    """Seconds for node A to fetch ``keys`` from their owner into its pool (a PIN, no tensor copy)."""
    from ems.client import DaemonClient
    from emsd.protocol.local import NamespaceAnswer, NamespaceRequest, PinAnswer, PinRequest, ReleaseRequest
    from emsd.transport.frames import Op

    client = DaemonClient(sock / "emsd.sock")
    client.connect({})
    try:
        opened = client.call(Op.NAMESPACE, *NamespaceRequest(ns_name).encode(), timeout=10)
        ns = NamespaceAnswer.decode(*opened).ns
        fields, parts = PinRequest(ns, KeyBatch.from_ints(np.array(keys, dtype=np.uint64))).encode()
        t0 = time.perf_counter()
        header, payload = client.call(Op.PIN, fields, parts, timeout=30)
        took = time.perf_counter() - t0
        pinned = PinAnswer.decode(header, payload, len(keys))
        assert len(pinned.handles) == len(keys), header
        client.send_noreply(Op.RELEASE, *ReleaseRequest(pinned.handles).encode())
        return took
    finally:
        client.close()


def bench_emsd(rounds: int, between: Callable[[], None]) -> dict[str, float]:
    from ems import CcConfig, CcKvOption, Ems
    from ems.namespace import namespace_name

    kv = [[torch.randn(2 * BATCH, TOKENS, HEADS, DIM).to(torch.float16) for _ in range(2)]
          for _ in range(LAYERS)]
    slots = list(range(BATCH * TOKENS))
    nbytes = BATCH * LAYERS * 2 * TOKENS * HEADS * DIM * 2
    ns = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="bench"), "")
    ring = Ring.build(ClusterView.of([Member("a", POOL), Member("b", POOL)]))
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        work = Path(tmp)
        server = zk.ZooKeeperServer(work / "zk").start()
        secret = work / "secret"
        secret.write_text("benchmark-cluster-secret\n")
        secret.chmod(0o600)  # emsd refuses a secret others can read
        procs: list[subprocess.Popen[bytes]] = []
        try:
            a, sock_a = start_daemon(work, "a", server.hosts, secret)
            b, sock_b = start_daemon(work, "b", server.hosts, secret)
            procs = [a, b]
            time.sleep(1.0)  # both views settle (membership is event-driven; this only avoids a race)
            cpu = [psutil.Process(p.pid) for p in procs]
            loads, saves, fetches, cpu_used, blocks = [], [], [], 0.0, 0
            for r in range(rounds + 1):
                keys = keys_owned_by("b", BATCH, 10_000_000 * (r + 1), ns, ring)
                raw = keys_owned_by("b", BATCH, 10_000_000 * (r + 1) + 2_500_000, ns, ring)
                cc = sdk(sock_b)
                cc.register_kvcache(kv)
                for batch in (keys, raw):
                    assert cc.save(slots, hashes=batch, offsets=[TOKENS] * BATCH).success == BATCH
                t_fetch = daemon_fetch(sock_a, ns, raw)
                cc = sdk(sock_a)
                cc.register_kvcache(kv)
                wait_filled(cc, 60)  # this benchmark reconnects every round: not timed
                before = sum(sum(p.cpu_times()[:2]) for p in cpu)
                t0 = time.perf_counter()
                res = cc.load(slots, hashes=keys, offsets=[TOKENS] * BATCH)
                t_load = time.perf_counter() - t0
                assert res.success == BATCH, res
                fresh = keys_owned_by("b", BATCH, 10_000_000 * (r + 1) + 5_000_000, ns, ring)
                t0 = time.perf_counter()
                res = cc.save(slots, hashes=fresh, offsets=[TOKENS] * BATCH,
                              option=CcKvOption(write_rcache=False))
                t_save = time.perf_counter() - t0
                assert res.success == BATCH, res
                after = sum(sum(p.cpu_times()[:2]) for p in cpu)
                if r:  # round 0 warms up connections and pages
                    between()  # the references, measured in the same breath
                    loads.append(t_load)
                    fetches.append(t_fetch)
                    saves.append(t_save)
                    cpu_used += after - before
                    blocks += 2 * BATCH
            Ems._reset()
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)
            server.stop()
    return {"remote_fetch_gbps": nbytes / statistics.median(fetches) / 1e9,
            "remote_load_gbps": nbytes / statistics.median(loads) / 1e9,
            "remote_save_gbps": nbytes / statistics.median(saves) / 1e9,
            "daemon_cpu_ms_per_block": 1000 * cpu_used / max(blocks, 1)}


class Iperf3:
    """An iperf3 server on loopback; ``once()`` is one 1-second single-stream run, in GB/s."""

    def __enter__(self) -> Iperf3:
        self.port = zk.free_port()
        self.srv = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(self.port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        self.runs: list[float] = []
        return self

    def once(self) -> None:
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(self.port), "-t", "1", "-J"],
                             capture_output=True, text=True, timeout=30)
        self.runs.append(float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]) / 8 / 1e9)

    def __exit__(self, *exc: object) -> None:
        self.srv.kill()
        self.srv.wait()


class Redis:
    """A redis-server on loopback holding BATCH values of 2 MiB; ``once()`` GETs them all."""

    def __enter__(self) -> Redis:
        import redis

        self.port = zk.free_port()
        self.srv = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        value = os.urandom(2 * MiB)
        self.keys = [f"k{i}" for i in range(BATCH)]
        for k in self.keys:
            self.client.set(k, value)
        self.source = np.frombuffer(os.urandom(BATCH * 2 * MiB), dtype=np.uint8)
        self.dest = np.zeros(BATCH * 2 * MiB, dtype=np.uint8)
        self.single: list[float] = []
        self.piped: list[float] = []
        self.copied: list[float] = []
        self.sets: list[float] = []
        return self

    def once(self) -> None:
        total = BATCH * 2 * MiB
        t0 = time.perf_counter()
        for k in self.keys:
            self.client.get(k)
        self.single.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys:
            pipe.get(k)
        pipe.execute()
        self.piped.append(total / (time.perf_counter() - t0) / 1e9)
        # Like for like with emsd's load and save, which end in (start from) the caller's
        # buffers: each value copied into a destination, and SETs of values taken from one.
        t0 = time.perf_counter()
        for i, k in enumerate(self.keys):
            self.dest[i * 2 * MiB : (i + 1) * 2 * MiB] = np.frombuffer(self.client.get(k), dtype=np.uint8)
        self.copied.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        for i, k in enumerate(self.keys):
            self.client.set(k, self.source[i * 2 * MiB : (i + 1) * 2 * MiB].tobytes())
        self.sets.append(total / (time.perf_counter() - t0) / 1e9)

    def __exit__(self, *exc: object) -> None:
        self.srv.terminate()
        self.srv.wait(10)


def have_redis() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return shutil.which("redis-server") is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        ip = stack.enter_context(Iperf3()) if shutil.which("iperf3") else None
        rd = stack.enter_context(Redis()) if have_redis() else None

        def between() -> None:
            for ref in (ip, rd):
                if ref is not None:
                    ref.once()

        emsd = bench_emsd(args.rounds, between)
    iperf = statistics.median(ip.runs) if ip else None
    rds = None
    if rd:
        rds = {"single_gbps": statistics.median(rd.single), "pipelined_gbps": statistics.median(rd.piped),
               "get_copy_gbps": statistics.median(rd.copied), "set_gbps": statistics.median(rd.sets)}
    out: dict[str, Any] = {"emsd": emsd, "iperf3_gbps": iperf, "redis": rds}
    if iperf:
        out["fetch_vs_iperf3"] = emsd["remote_fetch_gbps"] / iperf
        out["load_vs_iperf3"] = emsd["remote_load_gbps"] / iperf
        out["save_vs_iperf3"] = emsd["remote_save_gbps"] / iperf
    if rds:
        best = max(rds["single_gbps"], rds["pipelined_gbps"])
        out["load_vs_redis"] = emsd["remote_load_gbps"] / best
        out["save_vs_redis"] = emsd["remote_save_gbps"] / best
        out["load_vs_redis_get_copy"] = emsd["remote_load_gbps"] / rds["get_copy_gbps"]
        out["save_vs_redis_set"] = emsd["remote_save_gbps"] / rds["set_gbps"]
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"remote fetch, daemon to daemon    : {emsd['remote_fetch_gbps']:.2f} GB/s")
    print(f"remote load, {BATCH} x 2 MiB via SDK : {emsd['remote_load_gbps']:.2f} GB/s")
    print(f"remote save (write_rcache off)    : {emsd['remote_save_gbps']:.2f} GB/s")
    print(f"daemon CPU per remote block       : {emsd['daemon_cpu_ms_per_block']:.2f} ms")
    print(f"iperf3 loopback, 1 stream         : {iperf if iperf is None else f'{iperf:.2f} GB/s'}")
    if rds:
        print(f"redis GET 2 MiB single/pipelined  : {rds['single_gbps']:.2f} / "
              f"{rds['pipelined_gbps']:.2f} GB/s")
        print(f"redis GET + copy out / SET        : {rds['get_copy_gbps']:.2f} / {rds['set_gbps']:.2f} GB/s")
    for key in ("fetch_vs_iperf3", "load_vs_iperf3", "save_vs_iperf3", "load_vs_redis", "save_vs_redis",
                "load_vs_redis_get_copy", "save_vs_redis_set"):
        if key in out:
            print(f"{key:34s}: {out[key]:.2f}x")


if __name__ == "__main__":
    main()
