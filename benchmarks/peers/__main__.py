"""emsd side by side with Mooncake Store, LMCache's server, Redis and memcached, same machine, same run.

    python -m benchmarks.peers [--quick] [--rounds N] [--systems a,b] [--json FILE] [--markdown]

For block sizes 64 KiB, 512 KiB, 2 MiB and 8 MiB, single (one block a call)
and batched (32 a call), put and get, it measures each system's best client
path on this machine:

- emsd: a real standalone daemon and the ``ems`` SDK over shared memory;
- Mooncake Store: ``setup_dummy`` over shared memory, zero-copy from its
  registered pool ("mooncake-shm"), and ``setup`` over the TCP transfer
  engine to the daemon's segment ("mooncake-tcp");
- LMCache's ``lmcache_server``, Redis (redis-py + hiredis) and memcached
  (pymemcache) over loopback TCP;
- and the reference: memmove of the same blocks in one process.

Each system's client is a process of its own (benchmarks/peers/worker.py),
started once. Rounds are interleaved: round r walks every size and mode and,
for each, runs one cell on every system in an order rotated by r, so the
noise of this shared machine falls on all systems alike. A round 0 warms up
and is not counted. Every get is checked byte for byte. CPU used by processes
outside this benchmark during the measured rounds is reported beside the
results, and so is what each system's own processes used of the CPU while
the others were measured: an idle system that spins keeps the machine's cores
awake, which makes every server that sleeps between requests answer sooner on
a virtual machine, and takes CPU from the one measured. ``--busy-core`` runs
a process that keeps one core busy throughout, as on a host whose engines use
its CPU. A system that cannot be installed or started is reported with the
reason, never with a number. ``--quick`` (8 MiB per cell, 2 rounds) takes
well under a minute.

``--hugepages`` (root) runs emsd and Mooncake on 2 MiB hugepages, as a
production node would: it raises ``/proc/sys/vm/nr_hugepages`` by what their
pools and segments need, gives Mooncake ``MC_STORE_USE_HUGEPAGE=1`` (emsd's
``hugepages = "auto"`` takes them when free), reports how many hugepages each
system took as it started, and puts the old count back at the end. The
memmove reference stays on ordinary pages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks.peers import stats
from benchmarks.peers.systems import SHM_DIR, STARTERS, SYSTEMS, Missing, WorkerSpec, hugepage_bytes
from emsd.pool.region import NR_HUGEPAGES, read_hugepage_info

CELL_TIMEOUT = 300.0


class Worker:
    """A running worker.py: send a cell, read its answer (a JSON line) within a deadline."""

    def __init__(self, spec: WorkerSpec, log: Path) -> None:
        self.spec = spec
        self.log = log
        with log.open("ab") as err:
            self.proc = subprocess.Popen(spec.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env={**os.environ, **spec.env}, text=True)
        first = self._read(120.0)
        if "error" in first:
            self.stop()
            raise Missing(first["error"])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"worker {self.spec.name} gave no answer within {timeout:.0f} s "
                               f"(exit {self.proc.poll()}): {' | '.join(tail)}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def cell(self, size: int, batch: int, volume: int, tag: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "cell", "size": size, "batch": batch, "volume": volume,
                                          "tag": tag}) + "\n")
        self.proc.stdin.flush()
        return self._read(CELL_TIMEOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def own_cpu_seconds() -> float:
    """CPU seconds of this process and every live descendant (servers, workers)."""
    return sum(cpu_of({os.getpid(), *descendants()}).values())


def descendants() -> set[int]:
    """Process ids of every live descendant of this process."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def cpu_of(pids: set[int]) -> dict[int, float]:
    """CPU seconds (user and system) of each of ``pids`` still alive."""
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
    return out


class Background:
    """What each system's processes (its servers and its client worker) use of the CPU while
    another system's cell is being measured: a system whose idle processes spin takes cores
    from the one measured, and keeps the machine's cores from sleeping, which makes the wake-ups
    of the servers that sleep (memcached, Redis, LMCache's server) cheaper on a virtual machine."""

    def __init__(self) -> None:
        self.owned: dict[str, set[int]] = {}  # system -> its process ids
        self.cpu: dict[str, float] = {}  # system -> CPU seconds used during the others' cells
        self.wall: dict[str, float] = {}  # system -> seconds of the others' cells

    @contextlib.contextmanager
    def around(self, measured: str) -> Iterator[None]:
        """Around one cell of system ``measured``: charge the others' CPU meanwhile."""
        others = {n: pids for n, pids in self.owned.items() if n != measured}
        before, t0 = {n: cpu_of(p) for n, p in others.items()}, time.monotonic()
        yield
        wall = time.monotonic() - t0
        for n, pids in others.items():
            after = cpu_of(pids)
            used = sum(after[pid] - before[n][pid] for pid in after if pid in before[n])
            self.cpu[n] = self.cpu.get(n, 0.0) + used
            self.wall[n] = self.wall.get(n, 0.0) + wall

    def cores(self) -> dict[str, float]:
        """Per system, the cores its processes used on average while the others were measured."""
        return {n: self.cpu[n] / self.wall[n] for n in self.cpu if self.wall.get(n)}


def machine_cpu_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def free_hugepages() -> int:
    """Free hugepages of the default size not yet promised to a mapping (0 where the kernel
    has none): a system takes its share when it maps it, however much it has touched."""
    info = read_hugepage_info()
    return info.available if info is not None else 0


@contextlib.contextmanager
def hugepages_for(nbytes: int) -> Iterator[int]:
    """Raise nr_hugepages so that ``nbytes`` more are free; yields how many are free then.
    Puts the old count back on exit (pages still mapped then are freed as their owners exit)."""
    info = read_hugepage_info()
    if info is None or os.geteuid() != 0:
        raise SystemExit("--hugepages needs root and a kernel with hugetlb (/proc/meminfo: Hugepagesize)")
    want = info.total + -(-nbytes // info.page_size)
    Path(NR_HUGEPAGES).write_text(f"{want}\n")
    try:
        yield free_hugepages()
    finally:
        Path(NR_HUGEPAGES).write_text(f"{info.total}\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    volume = args.volume
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    if not args.hugepages:
        return _run(args, names, None)
    os.environ["MC_STORE_USE_HUGEPAGE"] = "1"  # Mooncake's processes inherit it
    with hugepages_for(hugepage_bytes(names, volume)) as free:
        print(f"[peers] hugepages: {free} free", file=sys.stderr)
        info = read_hugepage_info()
        page_kib = info.page_size >> 10 if info is not None else 0
        return _run(args, names, {"page_kib": page_kib, "free_at_start": free, "taken": {}})


def _run(args: argparse.Namespace, names: list[str], huge: dict[str, Any] | None) -> dict[str, Any]:
    volume = args.volume
    missing: dict[str, str] = {}
    workers: list[Worker] = []
    results: dict[str, dict[str, list[list[float]]]] = {}
    failed: dict[str, str] = {}
    background, system_of = Background(), {}  # worker name -> the system that started it
    with tempfile.TemporaryDirectory(dir=SHM_DIR) as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        for name in names:
            t0 = time.monotonic()
            free0 = free_hugepages()
            had = descendants()
            try:
                specs = STARTERS[name](stack, work, volume)
                for spec in specs:
                    w = Worker(spec, work / f"{spec.name}.worker.log")
                    stack.callback(w.stop)
                    workers.append(w)
                    system_of[spec.name] = name
                background.owned[name] = descendants() - had
            except Missing as exc:
                missing[name] = str(exc)
                print(f"[peers] {name}: not run: {exc}", file=sys.stderr)
                continue
            print(f"[peers] {name}: up in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            if huge is not None:
                huge["taken"][name] = free0 - free_hugepages()
        if args.busy_core:  # a process that keeps one core busy throughout, started by us
            spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            stack.callback(spin.wait)
            stack.callback(spin.kill)
            background.owned["busy core"] = {spin.pid}
        cpu0, own0, wall0 = machine_cpu_seconds(), own_cpu_seconds(), time.monotonic()
        tag = 1
        for r in range(args.rounds + 1):  # round 0 warms up
            if r == 1:
                cpu0, own0, wall0 = machine_cpu_seconds(), own_cpu_seconds(), time.monotonic()
            for size in args.sizes:
                for mode in stats.MODES:
                    for name in stats.rotated([w.spec.name for w in workers], r):
                        if name in failed:
                            continue
                        w = next(w for w in workers if w.spec.name == name)
                        tag += 1
                        with background.around(system_of[name]) if r else contextlib.nullcontext():
                            reply = w.cell(size, stats.batch_for(mode), volume, tag)
                        if "error" in reply:
                            failed[name] = f"{stats.size_label(size)} {mode}: {reply['error']}"
                            print(f"[peers] {name} failed: {failed[name]}", file=sys.stderr)
                            continue
                        if r:
                            mine = results.setdefault(name, {})
                            for op in stats.OPS:
                                mine.setdefault(f"{size}/{mode}/{op}", []).append(reply[op])
            print(f"[peers] round {r} done", file=sys.stderr)
        wall = time.monotonic() - wall0
        machine, own = machine_cpu_seconds() - cpu0, own_cpu_seconds() - own0
        other = max(0.0, machine - own)
        for w in workers:
            w.stop()
    table: dict[str, dict[str, Any]] = {}
    for name, cells in results.items():
        if name in failed:
            continue
        for key, rounds in cells.items():
            size = int(key.split("/")[0])
            table.setdefault(name, {})[key] = stats.summarize(rounds, (volume // size) * size)
    return {"volume_per_cell": volume, "rounds": args.rounds, "sizes": list(args.sizes), "batch": stats.BATCH,
            "hugepages": huge, "busy_core": bool(args.busy_core), "background_cores": background.cores(),
            "systems": [w.spec.name for w in workers], "missing": missing, "failed": failed, "results": table,
            "cpu": {"wall_s": wall, "machine_cpu_s": machine, "own_cpu_s": own,
                    "other_processes_cpu_s": other, "other_processes_cores": other / wall,
                    "cores": psutil.cpu_count(), "loadavg": list(os.getloadavg())}}


GOALS = (  # (emsd path, other, issue 21's goal on 2 MiB batched values: at least this many times)
    ("emsd", "mooncake-shm", 1.3),
    ("emsd-remote", "mooncake-tcp", 1.5),
)
LATENCY_GOALS = (  # (emsd path, op, other, issue 21's goal on one 64 KiB block a call: p50 at most
    ("emsd", "get", "memcached", 1.0),  # this many times the other's)
    ("emsd", "put", "memcached", 1.5),
    ("emsd-remote", "get", "mooncake-tcp", 1.0),
)


def ratios(out: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """For emsd and emsd-remote: their GB/s over each other system's, per cell."""
    res = out["results"]
    return {mine: {name: {key: stats.ratio(res[mine].get(key, {}).get("gbps"), cell["gbps"])
                          for key, cell in cells.items()}
                   for name, cells in res.items() if not name.startswith("emsd")}
            for mine in ("emsd", "emsd-remote") if mine in res}


def goals(out: dict[str, Any]) -> list[str]:
    """One line per goal of the issue: the 2 MiB batched put and get ratios, or why there are none."""
    lines = []
    for mine, other, goal in GOALS:
        got = out["ratios"].get(mine, {}).get(other)
        if got is None:
            lines.append(f"goal {mine} >= {goal}x {other}: not measured ({mine} or {other} did not run)")
            continue
        pair = [got.get(f"{2 * stats.MiB}/batched/{op}") for op in stats.OPS]
        txt = ", ".join(f"{op} {r:.2f}x" if r is not None else f"{op} -" for op, r in zip(stats.OPS, pair,
                                                                                          strict=True))
        met = all(r is not None and r >= goal for r in pair)
        lines.append(f"goal {mine} >= {goal}x {other} (2 MiB batched): {txt}: {'met' if met else 'NOT met'}")
    res, key = out["results"], f"{64 << 10}/single/"
    for mine, op, other, bound in LATENCY_GOALS:
        a, b = res.get(mine, {}).get(key + op), res.get(other, {}).get(key + op)
        if a is None or b is None:
            lines.append(f"goal {mine} {op} p50 <= {bound}x {other}: not measured ({mine} or {other} did "
                         "not run)")
            continue
        r, met, rounds = stats.latency_goal(a, b, bound)
        lines.append(f"goal {mine} {op} p50 <= {bound}x {other} (64 KiB single): {r:.2f}x "
                     f"({a['p50_us']:.0f} / {b['p50_us']:.0f} us): {'met' if r <= bound else 'NOT met'}; "
                     f"met in {met} of {rounds} rounds")
    return lines


def render(out: dict[str, Any], markdown: bool) -> str:
    res, rat = out["results"], out["ratios"].get("emsd", {})
    names = [n for n in out["systems"] if n in res]
    lines = []
    if markdown:
        lines.append("| size | mode | op | " + " | ".join(names) + " |")
        lines.append("|---" * (3 + len(names)) + "|")
    for size in out["sizes"]:
        for mode in stats.MODES:
            for op in stats.OPS:
                key = f"{size}/{mode}/{op}"
                cells = []
                for n in names:
                    c = res[n].get(key)
                    if c is None:
                        cells.append("-")
                        continue
                    txt = f"{c['gbps']:.2f} GB/s {c['p50_us']:.0f}/{c['p99_us']:.0f} us"
                    r = rat.get(n, {}).get(key)
                    cells.append(txt + (f" (emsd {r:.2f}x)" if r is not None else ""))
                head = [stats.size_label(size), mode, op]
                if markdown:
                    lines.append("| " + " | ".join(head + cells) + " |")
                else:
                    lines.append(f"{head[0]:>7} {mode:7} {op:3}  " + "  ".join(f"{n}: {c}" for n, c in
                                                                          zip(names, cells, strict=True)))
    for name, why in out["missing"].items():
        lines.append(f"not run: {name}: {why}")
    for name, why in out["failed"].items():
        lines.append(f"failed: {name}: {why}")
    lines += goals(out)
    if out.get("hugepages") is not None:
        taken = ", ".join(f"{n} {k}" for n, k in out["hugepages"]["taken"].items())
        lines.append(f"hugepages of {out['hugepages']['page_kib']} KiB taken by each system as it "
                     f"started: {taken}")
    idle = ", ".join(f"{n} {c:.2f}" for n, c in sorted(out["background_cores"].items(), key=lambda x: -x[1]))
    if idle:
        lines.append(f"cores each system's processes used while the others were measured: {idle}"
                     + (" (busy core: --busy-core)" if out["busy_core"] else ""))
    c = out["cpu"]
    lines.append(f"other processes used {c['other_processes_cpu_s']:.1f} CPU s over {c['wall_s']:.1f} s "
                 f"({c['other_processes_cores']:.2f} of {c['cores']} cores); load average {c['loadavg']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 MiB per cell, 2 rounds (< 1 minute)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 5, quick 2)")
    ap.add_argument("--volume-mib", type=int, default=None,
                    help="MiB moved per cell and direction (default 64, quick 8)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {','.join(SYSTEMS)}")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--hugepages", action="store_true",
                    help="emsd and Mooncake on hugepages (root; nr_hugepages is restored at the end)")
    ap.add_argument("--busy-core", action="store_true",
                    help="run a process that keeps one core busy throughout, as a host whose engines "
                         "use its CPU")
    args = ap.parse_args()
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    args.volume = (args.volume_mib if args.volume_mib is not None else (8 if args.quick else 64)) << 20
    args.sizes = stats.SIZES
    if args.rounds < 1 or args.volume < max(args.sizes):
        raise SystemExit(f"need --rounds >= 1 and a volume of at least {max(args.sizes) >> 20} MiB")
    out = run(args)
    out["ratios"] = ratios(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(render(out, args.markdown))


if __name__ == "__main__":
    main()
