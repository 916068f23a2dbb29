"""Start-up at any pool size: time to the first save and the first hit, cold and warm, and the
background prefault's rate against one thread of ``MADV_POPULATE_WRITE``.

    python -m benchmarks.bench_startup [--sizes 1,4,12] [--json FILE]

(from the repository root; sizes in GiB, the host needs that much free
memory twice over). For each size, in one run:

1. **cold**: a daemon on a fresh state directory (``pool.prefault`` on, the
   default; hugepages off): seconds from its start to ``/readyz``, to the
   first save and to the first hit through the SDK, then until the
   background prefault has faulted the whole pool in, and its rate;
2. **warm**: the daemon stopped (SIGTERM) and started again on the same
   state (its keeper holds the pool): the same times;
3. **reference**: a fresh memfd of the same size, faulted in by one
   ``MADV_POPULATE_WRITE`` in this process, one thread: its rate. The ratio
   is the daemon's prefault rate over this one.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
MADV_POPULATE_WRITE = 23


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def first_save_and_hit(sock: Path) -> tuple[float, float]:
    """Seconds to the first save and then to the first hit (a fresh SDK, one 64 KiB block)."""
    from ems import CcConfig, Ems, EmsConfig

    os.environ["EMS_SOCKET_DIR"] = str(sock)
    Ems._reset()
    t0 = time.perf_counter()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="startup")))
    cc = Ems.get_cc()
    kv = [[np.full((1, 16, 2048), 7, dtype=np.uint8) for _ in range(2)]]
    cc.register_kvcache(kv)
    key = int(time.time_ns())
    if cc.save(list(range(16)), hashes=[key], offsets=[16]).success != 1:
        raise RuntimeError("the first save failed")
    saved = time.perf_counter() - t0
    if cc.load(list(range(16)), hashes=[key], offsets=[16]).success != 1:
        raise RuntimeError("the first load missed")
    hit = time.perf_counter() - t0
    Ems._reset()
    return saved, hit


def one_start(config: Path, port: int, sock: Path, size: int) -> dict[str, float]:
    """Start the daemon, time its readiness, first save and hit, and its prefault; leave it running."""
    t0 = time.perf_counter()
    log = open(config.parent / "emsd.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, "-m", "emsd", "--config", str(config)], cwd=ROOT, stdout=log,
                            stderr=log)
    log.close()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"emsd exited {proc.returncode}: {(config.parent / 'emsd.log').read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.01)
    ready = time.perf_counter() - t0
    saved, hit = first_save_and_hit(sock)
    while metric(port, 'emsd_pool_prefault_bytes{state="done"}') < size:
        time.sleep(0.05)
    faulted = time.perf_counter() - t0
    return {"pid": proc.pid, "ready_s": ready, "first_save_s": ready + saved, "first_hit_s": ready + hit,
            "prefaulted_s": faulted, "prefault_GBps": size / max(faulted - ready, 1e-9) / 1e9}


def reference(size: int) -> float:
    """One thread of ``MADV_POPULATE_WRITE`` over a fresh memfd of ``size`` bytes: bytes/s."""
    fd = os.memfd_create("emsd-bench-startup")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mm:
            t0 = time.perf_counter()
            mm.madvise(MADV_POPULATE_WRITE, 0, size)
            return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def run(gib: float) -> dict[str, Any]:
    size = int(gib * (1 << 30))
    with tempfile.TemporaryDirectory(dir=SHM, prefix="emsd-startup-") as tmp:
        work = Path(tmp)
        port, sock = free_port(), work / "sock"
        config = work / "emsd.toml"
        config.write_text(f'[node]\nid = "startup"\nsocket_dir = "{sock}"\n'
                          f'[pool]\nsize = {size}\nhugepages = "off"\nstate_dir = "{work / "state"}"\n'
                          f'[metrics]\nlisten = "127.0.0.1:{port}"\n[log]\nlevel = "info"\n')
        out: dict[str, Any] = {"gib": gib}
        for phase in ("cold", "warm"):
            row = one_start(config, port, sock, size)
            os.kill(row.pop("pid"), signal.SIGTERM)
            time.sleep(1.0)  # the daemon exits; its keeper keeps the pool for the warm start
            out[phase] = row
    time.sleep(1.5)  # the state directory is gone: the keeper exits and the pool is freed
    out["reference_GBps"] = reference(size) / 1e9
    out["ratio"] = out["cold"]["prefault_GBps"] / out["reference_GBps"]
    for phase in ("cold", "warm"):
        r = out[phase]
        print(f"  {gib:g} GiB {phase}: ready {r['ready_s']:.2f} s, first save {r['first_save_s']:.2f} s, "
              f"first hit {r['first_hit_s']:.2f} s, prefaulted {r['prefaulted_s']:.1f} s "
              f"({r['prefault_GBps']:.2f} GB/s)", flush=True)
    print(f"  {gib:g} GiB: one thread of MADV_POPULATE_WRITE {out['reference_GBps']:.2f} GB/s; "
          f"the daemon's cold prefault {out['ratio']:.2f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,12", help="GiB, comma-separated")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [run(float(g)) for g in args.sizes.split(",")]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
