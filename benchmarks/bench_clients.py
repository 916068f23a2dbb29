"""Several clients on one daemon at once (the TP ranks of one engine share a node's emsd).

    python benchmarks/bench_clients.py [--clients 1,2,4] [--sizes 65536,2097152] [--seconds 8]

For each block size and client count it runs, one after the other:

- the reference: that many processes, each memmoving batches of ``--batch``
  blocks from one private buffer to another and back (no daemon);
- emsd: that many processes against one standalone daemon, each saving
  batches of ``--batch`` blocks of its own keys through the SDK and loading
  them back into another part of its buffer.

All processes of a run start together (a barrier) and stop after
``--seconds``. A process's rate is its bytes over the time spent inside its
calls; the aggregate is the sum over processes, so it counts what the
clients moved side by side. Every load is checked: it must find every block,
and each block's first 16 bytes (its key, written before the save) must come
back. Prints one line per run and the ratio of emsd's aggregate to the
reference's at the same client count.

One block a call (``--batch 1 --sizes 65536``) is the single-block mode: the
calls a second in all, half saves and half loads, are what the request-path
issue asks 10,000 of from 4 clients. Each emsd line also gives the CPU time
(user and system) per save-and-load of the daemon and of the client processes
together, from their start to their exit (connecting and registering
included): on 2 cores their sum bounds the rate. And how many times the clients slept
per save-and-load (voluntary context switches of every thread of theirs, from
``getrusage``): a call that waits for the daemon sleeps once unless its poll
sees the answer first; any more are threads of the SDK woken in the calls' path.

The machine is shared and has 2 cores here: with more processes than cores
the reference and emsd both share them, and the daemon's own thread is one
more. Compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_sdk import connect, start_daemon, stop, wait_filled  # noqa: E402

OPS = ("put", "get")
_FILL, _ZERO = b"\x5a" * 8, bytes(16)


def _stamp(view: memoryview, size: int, n: int, keys: list[int]) -> None:
    """Write each block's key into its first 16 bytes and zero the first 16 bytes of its
    destination, so that a load that moves nothing fails ``_check`` (untimed). Scalar steps
    on a memoryview: for one block a call numpy's per-call cost here was about a tenth of a
    save-and-load pair's CPU, which clients and daemon share on two cores."""
    for i, key in enumerate(keys):
        view[i * size : i * size + 16] = key.to_bytes(8, "little") + _FILL
        view[(n + i) * size : (n + i) * size + 16] = _ZERO


def _check(view: memoryview, size: int, n: int) -> None:
    """Each loaded block's first 16 bytes are its source's."""
    for i in range(n):
        if view[i * size : i * size + 16] != view[(n + i) * size : (n + i) * size + 16]:
            raise RuntimeError(f"block {i} came back different")


def client(mode: str, sock: str | None, rank: int, size: int, n: int, seconds: float,
           start: Any, results: Any) -> None:
    """One client process: batches of ``n`` blocks of ``size`` bytes, put then get, until time is up."""
    buf = np.ones(2 * n * size, dtype=np.uint8)
    view = memoryview(buf)
    moved = dict.fromkeys(OPS, 0)
    spent = dict.fromkeys(OPS, 0.0)
    if mode == "emsd":
        assert sock is not None
        cc = connect(Path(sock))
        cc.register_kvcache([[buf.reshape(2 * n, 1, size)]])
        wait_filled(cc)
    else:
        store = np.ones(n * size, dtype=np.uint8)
    start.wait()
    end, r = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        keys = [rank << 48 | (r * n + i) for i in range(n)]
        r += 1
        _stamp(view, size, n, keys)
        t = time.perf_counter()
        if mode == "emsd":
            res = cc.save(list(range(n)), hashes=keys, offsets=[1] * n)
            if res.success != n:
                raise RuntimeError(f"save stored {res.success} of {n}")
        else:
            for i in range(n):
                ctypes.memmove(store.ctypes.data + i * size, buf.ctypes.data + i * size, size)
        spent["put"] += time.perf_counter() - t
        t = time.perf_counter()
        if mode == "emsd":
            res = cc.load(list(range(n, 2 * n)), hashes=keys, offsets=[1] * n)
            if res.success != n:
                raise RuntimeError(f"load found {res.success} of {n}")
        else:
            for i in range(n):
                ctypes.memmove(buf.ctypes.data + (n + i) * size, store.ctypes.data + i * size, size)
        spent["get"] += time.perf_counter() - t
        _check(view, size, n)
        moved["put"] += n * size
        moved["get"] += n * size
    results.put({"batches": r, **{op: moved[op] / spent[op] for op in OPS}})


def run(mode: str, clients: int, size: int, n: int, seconds: float, sock: str | None,
        daemon: psutil.Process | None = None) -> dict[str, float]:
    """Aggregate GB/s of ``clients`` processes side by side, and batches a second; with
    ``daemon``, also the CPU microseconds per batch of the daemon and of the clients
    (user and system, the clients' from their start to their exit) and the clients'
    voluntary context switches per batch."""
    ctx = mp.get_context("fork")
    mine0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    daemon0 = daemon.cpu_times() if daemon is not None else None
    start, results = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=client, args=(mode, sock, i, size, n, seconds, start, results))
             for i in range(clients)]
    for p in procs:
        p.start()
    got = []
    for _ in procs:
        got.append(results.get(timeout=seconds + 120))
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"a {mode} client failed (exit {p.exitcode})")
    out = {op: sum(g[op] for g in got) / 1e9 for op in OPS}
    out["batches_per_s"] = sum(g["batches"] for g in got) / seconds
    if daemon is not None and daemon0 is not None:
        batches = max(1, sum(g["batches"] for g in got))
        mine1, daemon1 = resource.getrusage(resource.RUSAGE_CHILDREN), daemon.cpu_times()
        clients_s = (mine1.ru_utime - mine0.ru_utime) + (mine1.ru_stime - mine0.ru_stime)
        daemon_s = (daemon1.user - daemon0.user) + (daemon1.system - daemon0.system)
        out["daemon_us_per_batch"] = daemon_s / batches * 1e6
        out["clients_us_per_batch"] = clients_s / batches * 1e6
        out["clients_sleeps_per_batch"] = (mine1.ru_nvcsw - mine0.ru_nvcsw) / batches
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4", help="client counts, comma list")
    ap.add_argument("--sizes", default="65536,2097152", help="block sizes in bytes, comma list")
    ap.add_argument("--batch", type=int, default=32, help="blocks a call")
    ap.add_argument("--seconds", type=float, default=8.0, help="per run")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if min(counts) < 1 or min(sizes) < 16 or args.batch < 1 or args.seconds <= 0:
        raise SystemExit("need clients >= 1, sizes >= 16 bytes, batch >= 1 and seconds > 0")
    pool = max(1 << 30, 4 * max(counts) * args.batch * max(sizes))
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        proc, sock = start_daemon(Path(tmp), f"{pool >> 20}MiB", "64MiB")
        try:
            for size in sizes:
                for k in counts:
                    ref = run("memmove", k, size, args.batch, args.seconds, None)
                    mine = run("emsd", k, size, args.batch, args.seconds, str(sock), psutil.Process(proc.pid))
                    row = {"size": size, "clients": k, "memmove": ref, "emsd": mine,
                           "ratio": {op: mine[op] / ref[op] for op in OPS}}
                    rows.append(row)
                    print(f"{size >> 10:>6} KiB x {args.batch}, {k} client(s): "
                          + ", ".join(f"{op} emsd {mine[op]:.2f} GB/s / memmove {ref[op]:.2f} = "
                                      f"{row['ratio'][op]:.2f}x" for op in OPS)
                          + f"; emsd {mine['batches_per_s']:.0f} batches/s "
                          f"({2 * mine['batches_per_s']:.0f} calls/s, half saves, half loads); CPU per "
                          f"save and load: daemon {mine['daemon_us_per_batch']:.0f} us, clients "
                          f"{mine['clients_us_per_batch']:.0f} us; the clients slept "
                          f"{mine['clients_sleeps_per_batch']:.1f} times", flush=True)
        finally:
            stop(proc)
    print(f"load average {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
