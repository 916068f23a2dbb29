"""The disk tier against the disk: reads through the SDK beside fio, DRAM hits with the tier on
and off, and what a reboot keeps.

    python -m benchmarks.bench_disk [--dir /var/tmp] [--quick] [--rounds N] [--json FILE]

(from the repository root; needs Debian's ``fio`` and a real file system at
``--dir``, not tmpfs). In one run:

1. **Reads** (2 MiB and 64 KiB blocks): a daemon with a small pool (128 MiB)
   and a disk tier saves ``--gib`` of blocks through the SDK; all but the
   pool's worth are evicted and written to disk. Then loads of 16 blocks a
   call, oldest first (blocks only on disk), read them back through the SDK:
   GB/s over the whole pass. fio reads a file of the same size in the same
   directory with the same block size and queue depth (``O_DIRECT``,
   ``libaio``, iodepth = ``disk.readers``): the ratio is emsd / fio.
2. **DRAM hits, tier on and off**: two daemons, the same pool, one with a disk
   tier; the same blocks saved in each (all fit in DRAM); loads of them
   timed in alternating rounds; the ratio of the medians (on / off).
3. **Reboot**: the first daemon of step 1 is killed with -9, the page cache
   dropped (``/proc/sys/vm/drop_caches``, root only), the pool's state (its
   shared memory, keeper and ledger) removed, and the daemon started again on
   the same disk directory: the share of the blocks that were on disk that
   load with identical bytes.

Every block's bytes are a pattern of its index, so that a load is checked
byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
BATCH = 16  # blocks a load or save call
TOKENS = 16  # tokens a block
READERS = 8  # disk.readers, and fio's queue depth
POOL = 128 << 20


class Daemon:
    """One emsd process with its own config, state and socket directories under ``work``."""

    def __init__(self, work: Path, name: str, pool: int, disk_dir: Path | None, disk_size: int) -> None:
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state = self.dir / "state"
        self.sock = self.dir / "sock"
        self.port = _free_port()
        disk = "" if disk_dir is None else (
            f'[disk]\ndir = "{disk_dir}"\nsize = {disk_size}\nqueue = "1GiB"\nreaders = {READERS}\n'
            f'extent = "16MiB"\n')
        (self.dir / "emsd.toml").write_text(
            f'[node]\nid = "{name}"\nsocket_dir = "{self.sock}"\n'
            f'[pool]\nsize = {pool}\nhugepages = "off"\npage_size = "16MiB"\nstate_dir = "{self.state}"\n'
            f'[metrics]\nlisten = "127.0.0.1:{self.port}"\n[log]\nlevel = "warning"\n{disk}')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        log = open(self.dir / "emsd.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen([sys.executable, "-m", "emsd", "--config", str(self.dir / "emsd.toml")],
                                     cwd=ROOT, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "emsd.log").read_text()
                raise RuntimeError(f"emsd exited {self.proc.returncode}: {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("emsd not ready after 120 s")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        return 0.0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def forget_memory(self) -> None:
        """Remove the pool's state (shared memory, its keeper, the ledger): as after a reboot."""
        shutil.rmtree(self.state, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def sdk(daemon: Daemon, model: str) -> Iterator[Any]:
    """A ``ContextCaching`` connected to ``daemon``."""
    from ems import CcConfig, Ems, EmsConfig

    os.environ["EMS_SOCKET_DIR"] = str(daemon.sock)
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id=model)))
    try:
        yield Ems.get_cc()
    finally:
        Ems._reset()


def kv(block: int) -> list[list[np.ndarray]]:
    """K and V of one layer, ``BATCH`` blocks of ``TOKENS`` tokens, ``block`` bytes a block."""
    return [[np.zeros((BATCH * TOKENS, block // 2 // TOKENS), dtype=np.uint8) for _ in range(2)]]


def fill(tensors: list[list[np.ndarray]], first: int) -> None:
    """The pattern of blocks ``first`` .. ``first + BATCH - 1``: each token row its block's index."""
    for t in tensors[0]:
        t.reshape(BATCH, -1)[:] = ((np.arange(first, first + BATCH) * 7 + 3) % 251)[:, None]


def check(tensors: list[list[np.ndarray]], first: int, count: int) -> int:
    """How many of the ``count`` leading blocks hold their pattern."""
    want = ((np.arange(first, first + count) * 7 + 3) % 251)[:, None]
    good = np.ones(count, dtype=bool)
    for t in tensors[0]:
        good &= (t.reshape(BATCH, -1)[:count] == want).all(axis=1)
    return int(good.sum())


def call(cc: Any, op: str, first: int) -> int:
    slots = list(range(BATCH * TOKENS))
    hashes = [first + i for i in range(BATCH)]
    return int(getattr(cc, op)(slots, hashes=hashes, offsets=[TOKENS] * BATCH).success)


def save_all(cc: Any, tensors: list[list[np.ndarray]], blocks: int) -> None:
    cc.register_kvcache(tensors)
    for first in range(0, blocks, BATCH):
        fill(tensors, first)
        if call(cc, "save", first) != BATCH:
            raise RuntimeError(f"saving blocks {first}..: not all saved")


def wait_written(d: Daemon) -> None:
    """Until the write-behind queue is empty."""
    deadline = time.monotonic() + 300
    while d.metric("emsd_disk_queue_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)


def read_pass(cc: Any, tensors: list[list[np.ndarray]], first: int, last: int) -> tuple[float, int, int]:
    """(seconds, blocks loaded, blocks with the right bytes) loading blocks first..last-1."""
    cc.register_kvcache(tensors)
    took, loaded, right = 0.0, 0, 0
    for b in range(first, last - BATCH + 1, BATCH):
        t0 = time.perf_counter()
        got = call(cc, "load", b)
        took += time.perf_counter() - t0
        loaded += got
        right += check(tensors, b, got)
    return took, loaded, right


def fio(directory: Path, block: int, total: int) -> float:
    """fio's read bandwidth (bytes/s): random reads of ``block`` bytes, queue depth ``READERS``."""
    path = directory / "fio.data"
    out = subprocess.run(
        ["fio", "--name=disk", f"--filename={path}", f"--size={total}", "--rw=randread", f"--bs={block}",
         "--direct=1", "--ioengine=libaio", f"--iodepth={READERS}", "--numjobs=1", f"--io_size={total}",
         "--output-format=json"], capture_output=True, text=True, check=True)
    path.unlink()
    return float(json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"])


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def reads_and_reboot(work: Path, disk_root: Path, block: int, total: int) -> dict[str, Any]:
    """Steps 1 and 3 for one block size."""
    blocks = total // block // BATCH * BATCH
    disk_dir = Path(tempfile.mkdtemp(prefix="emsd-bench-disk-", dir=disk_root))
    d = Daemon(work, f"disk-{block}", POOL, disk_dir, total + (256 << 20)).start()
    try:
        tensors = kv(block)
        with sdk(d, f"m{block}") as cc:
            save_all(cc, tensors, blocks)
            wait_written(d)
            on_disk = int(d.metric("emsd_disk_blocks"))
            dropped = int(sum(d.metric(f'emsd_disk_dropped_demotions_total{{reason="{r}"}}')
                              for r in ("queue", "room", "quota", "failed", "corrupt")))
            cold = blocks - 2 * POOL // block  # certainly not in DRAM: older than two pools' worth
            took, loaded, right = read_pass(cc, tensors, 0, cold)
        fio_bps = fio(disk_dir, block, total)
        emsd_bps = loaded * block / took
        print(f"  {block >> 10:>5} KiB blocks: {blocks} saved, {on_disk} on disk "
              f"({dropped} demotions dropped); "
              f"loads of {BATCH} from disk {emsd_bps / 1e9:.2f} GB/s ({loaded} blocks, {right} right), "
              f"fio {fio_bps / 1e9:.2f} GB/s: {emsd_bps / fio_bps:.2f}x", flush=True)
        d.stop(signal.SIGKILL)
        dropped_cache = drop_page_cache()
        d.forget_memory()
        d.start()
        with sdk(d, f"m{block}") as cc:
            _, back, back_right = read_pass(cc, tensors, 0, blocks)
        print(f"  {block >> 10:>5} KiB blocks after kill -9, page cache "
              f"{'dropped' if dropped_cache else 'NOT dropped (not root)'}, pool state removed: "
              f"{back_right} of {on_disk} blocks that were on disk load identical "
              f"({back_right / max(on_disk, 1):.3f})", flush=True)
        return {"block": block, "saved": blocks, "on_disk": on_disk, "dropped": dropped,
                "emsd_gbps": emsd_bps / 1e9, "fio_gbps": fio_bps / 1e9, "ratio": emsd_bps / fio_bps,
                "loaded": loaded, "right": right, "page_cache_dropped": dropped_cache,
                "after_reboot_right": back_right, "after_reboot_share": back_right / max(on_disk, 1)}
    finally:
        d.stop(signal.SIGKILL)
        d.forget_memory()
        shutil.rmtree(disk_dir, ignore_errors=True)


def dram_hits(work: Path, disk_root: Path, block: int, rounds: int) -> dict[str, Any]:
    """Step 2 for one block size: median load time of DRAM hits, tier on / off."""
    blocks = 8 * BATCH
    disk_dir = Path(tempfile.mkdtemp(prefix="emsd-bench-disk-", dir=disk_root))
    on = Daemon(work, f"on-{block}", 256 << 20, disk_dir, 1 << 30).start()
    off = Daemon(work, f"off-{block}", 256 << 20, None, 0).start()
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        tensors = kv(block)
        for d in (on, off):
            with sdk(d, "hits") as cc:
                save_all(cc, tensors, blocks)
        for _ in range(rounds):
            for name, d in (("on", on), ("off", off)):
                with sdk(d, "hits") as cc:
                    took, loaded, _ = read_pass(cc, tensors, 0, blocks)
                    if loaded != blocks:
                        raise RuntimeError(f"tier {name}: {loaded} of {blocks} hits")
                    times[name].append(took / (blocks // BATCH))
    finally:
        for d in (on, off):
            d.stop(signal.SIGKILL)
            d.forget_memory()
        shutil.rmtree(disk_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  {block >> 10:>5} KiB blocks, DRAM hits, {BATCH} a call: tier on {med['on'] * 1e6:.0f} us, "
          f"off {med['off'] * 1e6:.0f} us a call (median of {rounds} alternating rounds): "
          f"{med['on'] / med['off']:.3f}x", flush=True)
    return {"block": block, "on_us": med["on"] * 1e6, "off_us": med["off"] * 1e6,
            "ratio": med["on"] / med["off"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="a directory on the disk to test")
    p.add_argument("--gib", type=float, default=1.0, help="GiB of blocks saved per block size")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="256 MiB and 3 rounds")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if shutil.which("fio") is None:
        sys.exit("bench_disk: needs fio (apt-get install fio)")
    total = (256 << 20) if args.quick else int(args.gib * (1 << 30))
    rounds = 3 if args.quick else args.rounds
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "dir": str(args.dir), "readers": READERS}
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:
        work = Path(tmp)
        print(f"disk tier in {args.dir}, {total >> 20} MiB per block size, queue depth {READERS}:",
              flush=True)
        out["reads"] = [reads_and_reboot(work, args.dir, b, total) for b in (2 << 20, 64 << 10)]
        out["dram_hits"] = [dram_hits(work, args.dir, b, rounds) for b in (2 << 20, 64 << 10)]
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
