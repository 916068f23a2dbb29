"""End-to-end SDK benchmarks against a real emsd, as ratios to references run alongside.

    python benchmarks/bench_sdk.py [--json] [--rounds N]

1. save+load throughput: 64 blocks of 2 MiB (32 layers x K/V x 16 tokens x 8
   heads x 128 x fp16) through the SDK, against (a) the same bytes gathered
   and scattered in-process with one vectorised torch copy per tensor
   (index_select into a buffer, index_copy_ back) and (b) memmove of the same
   bytes. Goal: >= 0.8x of (a).
2. exists of 256 hashes, all present: p50 latency against a raw Unix-socket
   echo of 100 bytes (server in another process). Goal: <= 10x the echo.
3. daemon memory per index entry: RSS growth of the daemon process while
   1,048,576 tiny blocks are committed, divided by the entries.

Every figure comes from this run on this machine; the machine is shared, so
compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import daemon_ready  # benchmarks/, on the path when run from there or imported by its siblings
import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None  # daemons keep their pool files beside the socket
LAYERS, BLOCK_TOKENS, HEADS, DIM = 32, 16, 8, 128
NUM_BLOCKS, BATCH = 160, 64
POOL_ROUNDS = 9  # save+load rounds of BATCH blocks that fill the benchmark's 1 GiB pool
BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * HEADS * DIM * 2  # 2 MiB


TENANT_ID, TENANT_KEY = "bench", "k" * 32


def start_daemon(workdir: Path, pool: str, page: str, node: str = "",
                 tenant: bool = False, command: tuple[str, ...] = ("-m", "emsd")
                 ) -> tuple[subprocess.Popen[bytes], Path]:
    """A standalone emsd in ``workdir``; ``node``: more lines of its ``[node]`` table;
    ``tenant``: with a tenants file of one tenant (``TENANT_ID``), whose blocks then live in
    a memfd of its own (emsd.pool.tenancy); ``command``: what this Python runs, before
    ``--config FILE`` (a benchmark's traced daemon)."""
    sock_dir = workdir / "sock"
    cfg = workdir / "emsd.toml"
    tenants = ""
    if tenant:
        f = workdir / "tenants.toml"
        f.write_text(f'[[tenant]]\naccess_id = "{TENANT_ID}"\naccess_key = "{TENANT_KEY}"\n')
        f.chmod(0o600)
        tenants = f'[tenants]\nfile = "{f}"\n'
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg.write_text(f'[node]\nid = "bench"\nsocket_dir = "{sock_dir}"\n{node}'
                   f'[pool]\nsize = "{pool}"\nhugepages = "auto"\npage_size = "{page}"\n'
                   f'[metrics]\nlisten = "127.0.0.1:{port}"\n[log]\nlevel = "warning"\n{tenants}')
    proc = subprocess.Popen([sys.executable, *command, "--config", str(cfg)], cwd=ROOT)
    daemon_ready.wait(port, proc, "emsd")
    return proc, sock_dir


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def connect(sock_dir: Path, tenant: bool = False):  # noqa: ANN201 - returns the SDK's ContextCaching
    from ems import CcConfig, Ems, EmsConfig

    os.environ["EMS_SOCKET_DIR"] = str(sock_dir)
    Ems._reset()
    who = {"access_id": TENANT_ID, "access_key": TENANT_KEY} if tenant else {}
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="bench"), **who))
    return Ems.get_cc()


def wait_filled(cc: Any, timeout: float = 120.0) -> None:
    """Wait until the SDK connection of ``cc`` has filled its page tables for the pool
    (``DaemonClient.wait_populated``); raises ``RuntimeError`` after ``timeout`` seconds. A
    connection starts that fill in the background when a KV cache is registered, about 0.2 s
    of a core per GiB of a prefaulted pool here (more while the daemon still prefaults it); an
    engine does it once, at start, while a benchmark that connects and then times its first
    calls would time the fill too."""
    if not cc._client().wait_populated(timeout):
        raise RuntimeError(f"the SDK's page-table fill did not end in {timeout:.0f} s")


def bench_throughput(rounds: int, tenant: bool = False) -> dict[str, float]:
    """Save+load of 64 x 2 MiB blocks through the SDK against a torch gather/scatter and a
    memmove of the same bytes; ``tenant``: as a tenant of a daemon with a tenants file."""
    kv = [[torch.randn(NUM_BLOCKS, BLOCK_TOKENS, HEADS, DIM).to(torch.float16) for _ in range(2)]
          for _ in range(LAYERS)]
    block_ids = torch.arange(1, 2 * BATCH, 2)  # every other block: scattered slots
    slots = (block_ids[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(-1)
    nbytes = BATCH * BLOCK_BYTES

    def reference() -> float:
        bufs = [torch.empty(BATCH * BLOCK_TOKENS, HEADS, DIM, dtype=torch.float16)
                for _ in range(2 * LAYERS)]
        flat = [t.view(-1, HEADS, DIM) for layer in kv for t in layer]
        t0 = time.perf_counter()
        for src, buf in zip(flat, bufs, strict=True):
            torch.index_select(src, 0, slots, out=buf)
        for dst, buf in zip(flat, bufs, strict=True):
            dst.index_copy_(0, slots, buf)
        return time.perf_counter() - t0

    def memmove() -> float:
        a = np.empty(nbytes, dtype=np.uint8)
        b = np.ones(nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        ctypes.memmove(a.ctypes.data, b.ctypes.data, nbytes)
        ctypes.memmove(b.ctypes.data, a.ctypes.data, nbytes)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        proc, sock_dir = start_daemon(Path(tmp), "1GiB", "64MiB", tenant=tenant)
        try:
            cc = connect(sock_dir, tenant)
            cc.register_kvcache(kv)
            slot_list = slots.tolist()

            def sdk(r: int) -> float:
                hashes = [r * 1_000_003 + i for i in range(BATCH)]
                t0 = time.perf_counter()
                s = cc.save(slot_list, hashes=hashes, offsets=[BLOCK_TOKENS] * BATCH)
                l_ = cc.load(slot_list, hashes=hashes, offsets=[BLOCK_TOKENS] * BATCH)
                dt = time.perf_counter() - t0
                assert s.success == BATCH and l_.success == BATCH, (s, l_)
                return dt

            for r in range(-POOL_ROUNDS, 0):  # warm up: blocks through the whole pool once, so
                sdk(r)  # that every page is faulted in and, as a tenant, its own
            reference(), memmove()
            t_sdk, t_ref, t_mm = [], [], []
            for r in range(rounds):
                t_ref.append(reference())
                t_sdk.append(sdk(r))
                t_mm.append(memmove())
        finally:
            from ems import Ems

            Ems._reset()
            stop(proc)
    gbps = lambda ts: 2 * nbytes / statistics.median(ts) / 1e9  # noqa: E731
    return {"sdk_gbps": gbps(t_sdk), "reference_gbps": gbps(t_ref), "memmove_gbps": gbps(t_mm),
            "ratio_vs_reference": gbps(t_sdk) / gbps(t_ref), "ratio_vs_memmove": gbps(t_sdk) / gbps(t_mm)}


def echo_p50_process(n: int, poll_us: tuple[int, int] = (0, 0)) -> float:
    """Raw echo with the server in another process (no shared GIL). ``poll_us``: (server,
    client) microseconds each side polls its socket before it sleeps in ``recv``, as emsd's
    loop and the SDK do (``node.busy_poll``, ``EMS_BUSY_POLL_US``); (0, 0): both sleep."""
    code = (
        "import socket,sys,select,time\n"
        "s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen(1);print('up',flush=True)\n"
        "c,_=s.accept();p=select.poll();p.register(c,select.POLLIN);budget=int(sys.argv[2])/1e6\n"
        "while True:\n"
        "    end=time.perf_counter()+budget\n"
        "    while budget and not p.poll(0) and time.perf_counter()<end: pass\n"
        "    d=c.recv(4096)\n"
        "    if not d: break\n"
        "    c.sendall(d)\n"
    )
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        path = str(Path(tmp) / "echo.sock")
        proc = subprocess.Popen([sys.executable, "-c", code, path, str(poll_us[0])], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        poller = select.poll()
        poller.register(c, select.POLLIN)
        msg = b"x" * 100
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.sendall(msg)
            end = t0 + poll_us[1] / 1e6
            while poll_us[1] and not poller.poll(0) and time.perf_counter() < end:
                pass
            got = 0
            while got < 100:
                got += len(c.recv(4096))
            times.append(time.perf_counter() - t0)
        c.close()
        proc.wait(5)
        return statistics.median(times)


def bench_exists(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        proc, sock_dir = start_daemon(Path(tmp), "64MiB", "8MiB")
        try:
            cc = connect(sock_dir)
            hashes = [hash((i, "prefix")) for i in range(256)]
            # All 256 present: the lookup walks every key (a miss would stop at once).
            cc.register_kvcache([[torch.zeros(256, 1, 64, dtype=torch.float16)]])
            assert cc.save(list(range(256)), hashes=hashes, offsets=[1] * 256).success == 256
            assert cc.exists(hashes).success == 256
            for _ in range(200):
                cc.exists(hashes)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                cc.exists(hashes)
                times.append(time.perf_counter() - t0)
        finally:
            from ems import Ems

            Ems._reset()
            stop(proc)
    echo = echo_p50_process(n)
    p50 = statistics.median(times)
    return {"exists256_p50_us": p50 * 1e6, "echo100_p50_us": echo * 1e6, "ratio_vs_echo": p50 / echo}


def bench_index_memory(entries: int) -> dict[str, float]:
    """RSS growth of the daemon while ``entries`` 64-byte blocks are committed."""
    from emsd.pool.keys import KeyBatch
    from emsd.protocol.local import (
        CommitRequest,
        NamespaceAnswer,
        NamespaceRequest,
        ReserveAnswer,
        ReserveRequest,
    )
    from emsd.transport.frames import Op

    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        pool = max(64 << 20, entries * 64 * 2)
        proc, sock_dir = start_daemon(Path(tmp), f"{pool >> 20}MiB", "8MiB")
        try:
            from ems.client import DaemonClient

            client = DaemonClient(sock_dir / "emsd.sock")
            client.connect({})
            opened = client.call(Op.NAMESPACE, *NamespaceRequest("mem").encode(), timeout=10)
            ns = NamespaceAnswer.decode(*opened).ns
            daemon = psutil.Process(proc.pid)
            before = daemon.memory_info().rss
            batch = 65536
            for start in range(0, entries, batch):
                n = min(batch, entries - start)
                keys = KeyBatch.from_ints(np.arange(start, start + n, dtype=np.uint64))
                reserve = ReserveRequest(ns, keys, np.full(n, 64, dtype=np.uint64))
                reserved = ReserveAnswer.decode(*client.call(Op.RESERVE, *reserve.encode(), timeout=60), n)
                assert (reserved.status == 0).all(), "pool too small for the index benchmark"
                client.call(Op.COMMIT, *CommitRequest(reserved.handles).encode(), timeout=60)
            stats = client.call(Op.STATS, {}, timeout=10)[0]
            after = daemon.memory_info().rss
            client.close()
        finally:
            stop(proc)
    assert stats["entries"] == entries
    return {"entries": entries, "rss_bytes_per_entry": (after - before) / entries}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--exists-n", type=int, default=3000)
    ap.add_argument("--entries", type=int, default=1 << 20)
    ap.add_argument("--tenant", action="store_true",
                    help="also measure the throughput as a tenant (its own memfd) in the same run")
    args = ap.parse_args()
    results = {"throughput": bench_throughput(args.rounds), "exists": bench_exists(args.exists_n),
               "index_memory": bench_index_memory(args.entries)}
    if args.tenant:
        results["throughput_tenant"] = bench_throughput(args.rounds, tenant=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    t, e, m = results["throughput"], results["exists"], results["index_memory"]
    print(f"save+load 64 x 2 MiB via SDK : {t['sdk_gbps']:.2f} GB/s")
    print(f"  torch gather/scatter ref    : {t['reference_gbps']:.2f} GB/s"
          f"  -> ratio {t['ratio_vs_reference']:.2f} (goal >= 0.8)")
    print(f"  memmove of the same bytes   : {t['memmove_gbps']:.2f} GB/s"
          f"  -> ratio {t['ratio_vs_memmove']:.2f}")
    if "throughput_tenant" in results:
        tt = results["throughput_tenant"]
        print(f"  the same as a tenant        : {tt['sdk_gbps']:.2f} GB/s (memmove {tt['memmove_gbps']:.2f})"
              f"  -> ratio to memmove {tt['ratio_vs_memmove']:.2f}")
    print(f"exists(256) p50              : {e['exists256_p50_us']:.1f} us")
    print(f"  Unix echo 100 B p50         : {e['echo100_p50_us']:.1f} us"
          f"  -> ratio {e['ratio_vs_echo']:.1f} (goal <= 10)")
    print(f"daemon RSS per index entry    : {m['rss_bytes_per_entry']:.1f} B at {m['entries']} entries")


if __name__ == "__main__":
    main()
