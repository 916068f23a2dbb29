"""The disk tier against the disk: reads through the SDK beside fio, DRAM hits with the tier on
and off, and what a reboot keeps.

    python -m benchmarks.bench_disk [--dir /var/tmp] [--quick] [--rounds N] [--read-rounds N] [--json FILE]

(from the repository root; needs Debian's ``fio`` and a real file system at
``--dir``, not tmpfs). In one run:

1. **Reads** (2 MiB and 64 KiB blocks): a daemon with a small pool (4 loads'
   worth) and a disk tier saves ``--gib`` of blocks through the SDK; all but
   the pool's worth are evicted and written to disk. A first pass of loads
   (``--batch`` blocks a call, oldest first: blocks only on disk) reads them
   back through the SDK, checked byte for byte, and lets the demotions it
   causes finish. Then ``--read-rounds`` rounds, each: the same pass, timed
   (GB/s over the pass), the same with ``OVERLAP`` loads in flight (as an
   engine loading for several requests at once: the disk is not idle while
   a load's blocks are copied out and the next load is sent), then fio on
   the region of the tier's data file that
   holds those blocks (read only, the same block size and queue depth,
   ``O_DIRECT``): random reads from ``disk.readers`` threads as emsd's
   readers, and from ``libaio`` with as many in flight, and reads in file
   order (``libaio``), the order in which the tier finds the blocks of a
   prefix it demoted in order. The ratios are of the medians, emsd / fio: this
   VM's disk moves by 2x from one minute to the next (its host caches what
   was written lately), so only rounds side by side compare.
2. **DRAM hits, tier on and off**: two daemons, the same pool, one with a disk
   tier; the same blocks saved in each (all fit in DRAM); loads of them
   timed in alternating rounds, each daemon first in every other round; the
   ratio of the medians (on / off).
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
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import daemon_ready

ROOT = Path(__file__).resolve().parents[1]
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
BATCH = 16  # blocks a load or save call
TOKENS = 16  # tokens a block
READERS = 8  # disk.readers, and fio's queue depth
OVERLAP = 2  # loads in flight at once in the overlapped passes


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
        daemon_ready.wait(self.port, self.proc, f"emsd {self.dir.name}")
        return self

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


def kv(block: int, n: int) -> list[list[np.ndarray]]:
    """K and V of one layer, ``n`` blocks of ``TOKENS`` tokens, ``block`` bytes a block."""
    return [[np.zeros((n, TOKENS, block // 2 // TOKENS), dtype=np.uint8) for _ in range(2)]]


def pattern(first: int, count: int) -> np.ndarray:
    """Each block's byte: a function of its index (a column, one row per block)."""
    return ((np.arange(first, first + count) * 7 + 3) % 251).astype(np.uint8)[:, None]


def fill(tensors: list[list[np.ndarray]], first: int, count: int) -> None:
    """The pattern of blocks ``first`` .. ``first + count - 1`` in the tensors' leading blocks."""
    for t in tensors[0]:
        t.reshape(t.shape[0], -1)[:count] = pattern(first, count)


def check(tensors: list[list[np.ndarray]], first: int, count: int) -> int:
    """How many of the ``count`` leading blocks hold their pattern."""
    good = np.ones(count, dtype=bool)
    for t in tensors[0]:
        good &= (t.reshape(t.shape[0], -1)[:count] == pattern(first, count)).all(axis=1)
    return int(good.sum())


def call(cc: Any, op: str, first: int, count: int, lane: int = 0) -> int:
    """``op`` of blocks ``first`` .. ``first + count - 1``, into or from the tensors' blocks
    ``lane * count`` on."""
    slots = list(range(lane * count * TOKENS, (lane + 1) * count * TOKENS))
    hashes = [first + i for i in range(count)]
    return int(getattr(cc, op)(slots, hashes=hashes, offsets=[TOKENS] * count).success)


def save_all(cc: Any, tensors: list[list[np.ndarray]], blocks: int) -> None:
    cc.register_kvcache(tensors)
    for first in range(0, blocks, BATCH):
        fill(tensors, first, BATCH)
        if call(cc, "save", first, BATCH) != BATCH:
            raise RuntimeError(f"saving blocks {first}..: not all saved")


def wait_written(d: Daemon) -> None:
    """Until the write-behind queue is empty."""
    deadline = time.monotonic() + 300
    while d.metric("emsd_disk_queue_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)


def read_pass(cc: Any, tensors: list[list[np.ndarray]], first: int, last: int,
              batch: int = BATCH) -> tuple[float, int, int]:
    """(seconds, blocks loaded, blocks with the right bytes) loading blocks first..last-1,
    ``batch`` a call."""
    cc.register_kvcache(tensors)
    took, loaded, right = 0.0, 0, 0
    for b in range(first, last - batch + 1, batch):
        t0 = time.perf_counter()
        got = call(cc, "load", b, batch)
        took += time.perf_counter() - t0
        loaded += got
        right += check(tensors, b, got)
    return took, loaded, right


def overlapped_pass(cc: Any, first: int, last: int, batch: int, depth: int) -> tuple[float, int]:
    """(seconds, blocks loaded) loading blocks first..last-1, ``batch`` a call, ``depth`` calls in
    flight (a thread each, the calls dealt out in turn, each into its own tensor blocks). The
    bytes are not checked here (the first pass checks them)."""
    starts = list(range(first, last - batch + 1, batch))
    loaded = [0] * depth

    def lane(i: int) -> None:
        loaded[i] = sum(call(cc, "load", b, batch, i) for b in starts[i::depth])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(loaded)


FIO_REFS = ("psync", "libaio", "sequential")


def fio(data: Path, block: int, size: int, engine: str) -> float:
    """fio's read bandwidth (bytes/s) on the tier's own data file (read only, its first ``size``
    bytes: the slots of the blocks the timed loads read, which the tier fills lowest first):
    ``size`` bytes of reads of ``block`` bytes, ``O_DIRECT``, queue depth ``READERS``, as
    ``engine`` (``FIO_REFS``): ``psync`` (random, ``READERS`` jobs: threads, as emsd's readers),
    ``libaio`` (random, one job, ``READERS`` in flight) or ``sequential`` (libaio, in file order,
    ``READERS`` in flight: the order in which the tier reads a prefix demoted in order)."""
    jobs = {"psync": ["--ioengine=psync", f"--numjobs={READERS}", "--rw=randread"],
            "libaio": ["--ioengine=libaio", f"--iodepth={READERS}", "--numjobs=1", "--rw=randread"],
            "sequential": ["--ioengine=libaio", f"--iodepth={READERS}", "--numjobs=1", "--rw=read"]}[engine]
    out = subprocess.run(
        ["fio", "--name=disk", f"--filename={data}", "--readonly", f"--size={size}",
         f"--bs={block}", "--direct=1", *jobs, f"--io_size={size // (READERS if engine == 'psync' else 1)}",
         "--group_reporting", "--output-format=json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"])


def reads_side_by_side(cc: Any, tensors: list[list[np.ndarray]], data: Path, block: int, cold: int,
                       batch: int, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of timed passes of loads over blocks 0..``cold``-1 (on disk only), one
    call at a time and ``OVERLAP`` in flight, each round followed by fio on their region of
    ``data``: the medians (bytes/s) and every round's."""
    passes: dict[str, list[float]] = {"emsd": [], "emsd_overlap": []}
    refs: dict[str, list[float]] = {e: [] for e in FIO_REFS}
    want = cold // batch * batch
    for _ in range(rounds):
        took, loaded, right = read_pass(cc, tensors, 0, cold, batch)
        if right != want:
            raise RuntimeError(f"{block >> 10} KiB blocks: {right} of {want} loaded right")
        passes["emsd"].append(loaded * block / took)
        took, loaded = overlapped_pass(cc, 0, cold, batch, OVERLAP)
        if loaded != want:
            raise RuntimeError(f"{block >> 10} KiB blocks, {OVERLAP} loads in flight: {loaded} of {want}")
        passes["emsd_overlap"].append(loaded * block / took)
        for engine, got in refs.items():
            got.append(fio(data, block, want * block, engine))
    every = {**passes, **refs}
    return {"median": {k: statistics.median(v) for k, v in every.items()}, "rounds": every}


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def reads_and_reboot(work: Path, disk_root: Path, block: int, total: int, batch: int,
                     rounds: int) -> dict[str, Any]:
    """Steps 1 and 3 for one block size, loads of ``batch`` blocks a call."""
    blocks = total // block // BATCH * BATCH
    pool = 4 * batch * block  # room for the loads' promotions and what they evict
    cold = blocks - pool // block - 2 * batch  # certainly not in DRAM: older than a pool's worth
    if cold < batch:
        raise SystemExit(f"bench_disk: {total >> 20} MiB of {block >> 10} KiB blocks is too little for "
                         f"loads of {batch} (a pool of {pool >> 20} MiB): raise --gib")
    disk_dir = Path(tempfile.mkdtemp(prefix="emsd-bench-disk-", dir=disk_root))
    d = Daemon(work, f"disk-{block}", pool, disk_dir, total + (256 << 20)).start()
    try:
        tensors = kv(block, max(batch, BATCH) * OVERLAP)
        with sdk(d, f"m{block}") as cc:
            save_all(cc, tensors, blocks)
            wait_written(d)
            on_disk = int(d.metric("emsd_disk_blocks"))
            dropped = int(sum(d.metric(f'emsd_disk_dropped_demotions_total{{reason="{r}"}}')
                              for r in ("queue", "room", "quota", "failed", "corrupt")))
            _, loaded, right = read_pass(cc, tensors, 0, cold, batch)  # and its demotions
            wait_written(d)
            data = next(disk_dir.glob("*.data"))
            side = reads_side_by_side(cc, tensors, data, block, cold, batch, rounds)
            wait_written(d)
            kept = int(d.metric("emsd_disk_blocks"))  # what the reboot may find
        d.stop(signal.SIGKILL)
        med = side["median"]
        print(f"  {block >> 10:>5} KiB blocks: {blocks} saved, {on_disk} on disk "
              f"({dropped} demotions dropped); first pass {right} of {loaded} loaded right; "
              f"median of {rounds} rounds, GB/s: fio on their region, random {READERS} threads "
              f"{med['psync'] / 1e9:.2f}, random libaio {med['libaio'] / 1e9:.2f}, sequential libaio "
              f"{med['sequential'] / 1e9:.2f}", flush=True)
        for name, what in (("emsd", "one at a time"), ("emsd_overlap", f"{OVERLAP} in flight")):
            ratios = " / ".join(f"{med[name] / med[e]:.2f}x" for e in FIO_REFS)
            print(f"        loads of {batch} from disk, {what}: {med[name] / 1e9:.2f} GB/s, "
                  f"{ratios} those", flush=True)
        dropped_cache = drop_page_cache()
        d.forget_memory()
        d.start()
        with sdk(d, f"m{block}") as cc:
            _, back, back_right = read_pass(cc, tensors, 0, blocks, batch)
        print(f"  {block >> 10:>5} KiB blocks after kill -9, page cache "
              f"{'dropped' if dropped_cache else 'NOT dropped (not root)'}, pool state removed: "
              f"{back_right} of the {kept} blocks on disk load identical ({back_right / max(kept, 1):.3f})",
              flush=True)
        return {"block": block, "batch": batch, "saved": blocks, "on_disk": on_disk, "dropped": dropped,
                "median_gbps": {k: v / 1e9 for k, v in med.items()},
                "ratio": {e: med["emsd"] / med[e] for e in FIO_REFS}, "overlap": OVERLAP,
                "overlap_ratio": {e: med["emsd_overlap"] / med[e] for e in FIO_REFS},
                "rounds_gbps": {k: [b / 1e9 for b in v] for k, v in side["rounds"].items()},
                "loaded": loaded, "right": right, "page_cache_dropped": dropped_cache,
                "on_disk_at_kill": kept,
                "after_reboot_loaded": back, "after_reboot_right": back_right,
                "after_reboot_share": back_right / max(kept, 1)}
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
        tensors = kv(block, BATCH)
        for d in (on, off):
            with sdk(d, "hits") as cc:
                save_all(cc, tensors, blocks)
        pair = (("on", on), ("off", off))
        for r in range(rounds):
            for name, d in pair if r % 2 == 0 else pair[::-1]:  # either first in turn
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
    p.add_argument("--batch", type=int, default=32,
                   help="2 MiB blocks a load call (64 KiB blocks: 4x as many)")
    p.add_argument("--read-rounds", type=int, default=5, help="rounds of reads beside fio")
    p.add_argument("--quick", action="store_true", help="3 rounds of DRAM hits, 2 of reads")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if shutil.which("fio") is None:
        sys.exit("bench_disk: needs fio (apt-get install fio)")
    total = int(args.gib * (1 << 30))
    rounds = 3 if args.quick else args.rounds
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "dir": str(args.dir), "readers": READERS}
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:
        work = Path(tmp)
        print(f"disk tier in {args.dir}, {total >> 20} MiB per block size, queue depth {READERS}:",
              flush=True)
        read_rounds = 2 if args.quick else args.read_rounds
        out["reads"] = [reads_and_reboot(work, args.dir, b, total, batch, read_rounds)
                        for b, batch in ((2 << 20, args.batch), (64 << 10, args.batch * 4))]
        out["dram_hits"] = [dram_hits(work, args.dir, b, rounds) for b in (2 << 20, 64 << 10)]
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
