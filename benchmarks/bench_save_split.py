"""Where a one-block save's time goes, on both sides of the socket.

    python benchmarks/bench_save_split.py [--n N] [--pool SIZE] [--busy-poll US] [--json]

A standalone daemon whose ``ControlProtocol.data_received`` is timed (entry,
and the moment it has written its answers: ``BusyPoll.after_answer``), and
one SDK client of it whose ``DaemonClient._send`` and ``_dispatch`` are timed,
both on ``time.monotonic_ns`` (one clock for both processes). The client saves
``--n`` 64 KiB blocks one a call into a pool of ``--pool`` (a warm-up pass
first, untimed), and each save is split into:

- sdk before: from the call to its PUT going out (arguments, a granted chunk,
  the copy into the pool, the frame);
- to daemon: from ``_send`` to the daemon reading the request (the frame's
  encoding and send, and the daemon noticing it: its poll or a wake-up);
- daemon: from reading the request to having written its answer;
- to client: from the answer written to the SDK reading it;
- sdk after: from the answer read to the call's return.

Reported: p10, p50 and p90 of each part and of the whole call over the saves
whose request the daemon read on its own ("call"; a request read together with
another, such as a GRANT the SDK sent before it, is left out), of every save's
whole call ("every call"), and the share of the slowest tenth of the matched
saves spent in each part; and how many saves waited for the answer of a GRANT
when taking their granted chunks (longer than 20 us). ``--busy-poll US`` sets
the daemon's ``node.busy_poll`` and the SDK's ``EMS_BUSY_POLL_US`` (0: both
sleep while they wait). The parts of one save add up to the whole call; the
p50s of the parts need not. What it is for: telling the SDK's, the socket's
and the daemon's parts of a change apart, in alternating runs of the two
versions on this shared machine.
"""

from __future__ import annotations

import argparse
import array
import atexit
import bisect
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from benchmarks.peers.stats import percentile  # noqa: E402

PARTS = ("sdk before", "to daemon", "daemon", "to client", "sdk after")
GRANT_WAIT = 20_000  # ns: a save's taking of its chunks longer than this waited for a GRANT's answer
SIZE = 64 << 10


ENTRY, WRITTEN, EXIT = 1, 2, 3  # the kinds of a traced daemon's marks


def traced_daemon(marks: Path, argv: list[str]) -> int:
    """Run emsd with ``argv``, recording into ``marks`` at exit (kind, time) pairs: each
    ``data_received``'s entry and exit, and between them when its answers were written
    (``BusyPoll.after_answer``, where the daemon busy-polls)."""
    from emsd.cli import main
    from emsd.transport import unix

    times = array.array("q")
    receive, answered = unix.ControlProtocol.data_received, unix.BusyPoll.after_answer

    def timed_receive(self: Any, data: bytes) -> None:
        times.extend((ENTRY, time.monotonic_ns()))
        receive(self, data)
        times.extend((EXIT, time.monotonic_ns()))

    def timed_answered(self: Any) -> None:
        times.extend((WRITTEN, time.monotonic_ns()))
        answered(self)

    unix.ControlProtocol.data_received = timed_receive  # type: ignore[method-assign]
    unix.BusyPoll.after_answer = timed_answered  # type: ignore[method-assign]
    atexit.register(lambda: marks.write_bytes(times.tobytes()))
    return main(argv)


def daemon_reads(raw: bytes) -> list[tuple[int, int]]:
    """(entry, answers written) of each read, from ``traced_daemon``'s marks: the written mark
    where there is one (reads without one when the daemon busy-polls wrote no answer and are
    left out), else, with busy polling off, the read's exit."""
    marks = array.array("q")
    marks.frombytes(raw)
    polled = WRITTEN in marks[::2]
    reads, start, written = [], 0, 0
    for kind, t in zip(marks[::2], marks[1::2], strict=True):
        if kind == ENTRY:
            start, written = t, 0
        elif kind == WRITTEN:
            written = t
        elif start and (written or not polled):
            reads.append((start, written or t))
    return reads


def split(calls: list[tuple[int, int]], puts: list[tuple[int, int]], answers: dict[int, int],
          reads: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Per call, the five parts and the whole (ns), from its PUT (``puts``: send time and
    request id, in order), that PUT's answer (``answers``: request id to the time it was
    read) and the first daemon read after the send. Calls whose read does not lie between
    the two (their request was read with another, whose handling came first) are left out."""
    sent = [t for t, _ in puts]
    starts = [r[0] for r in reads]
    rows = []
    for t0, t1 in calls:
        i = bisect.bisect_left(sent, t0)
        if i == len(puts) or sent[i] > t1:
            continue
        s, rid = puts[i]
        a = answers.get(rid)
        k = bisect.bisect_left(starts, s)
        if a is None or k == len(reads):
            continue
        r_in, r_out = reads[k]
        if not s <= r_in <= r_out <= a <= t1:
            continue
        rows.append((s - t0, r_in - s, r_out - r_in, a - r_out, t1 - a, t1 - t0))
    return rows


def quantile(values: list[int], q: float) -> float:
    """The ``q``-th quantile (0..1) of ``values`` in nanoseconds, in microseconds."""
    return percentile(values, 100 * q) / 1000.0


def run(n: int, pool: str, busy_poll: int | None = None) -> dict[str, Any]:
    import numpy as np
    from bench_sdk import SHM, connect, start_daemon, stop, wait_filled

    from ems import Ems
    from ems.client import BUSY_POLL_ENV, DaemonClient
    from ems.grants import Grants
    from emsd.transport.frames import Op

    buf = np.ones(2 * n * SIZE, dtype=np.uint8)
    puts: list[tuple[int, int]] = []  # (sent at, request id) of each PUT
    answers: dict[int, int] = {}  # request id -> when its answer was read
    takes: list[int] = []  # ns each save spent taking its granted chunks (a GRANT's answer included)
    send, dispatch, take = DaemonClient._send, DaemonClient._dispatch, Grants.take

    def timed_send(self: DaemonClient, rid: int, op: Op, *args: Any) -> None:
        if op == Op.PUT:
            puts.append((time.monotonic_ns(), rid))
        send(self, rid, op, *args)

    def timed_dispatch(self: DaemonClient, header: dict[str, Any], payload: bytes) -> None:
        answers[header.get("id", 0)] = time.monotonic_ns()
        dispatch(self, header, payload)

    def timed_take(self: Grants, *args: Any) -> Any:
        t = time.monotonic_ns()
        got = take(self, *args)
        takes.append(time.monotonic_ns() - t)
        return got

    with tempfile.TemporaryDirectory(dir=SHM) as tmp:
        marks = Path(tmp) / "marks"
        node = "" if busy_poll is None else f"busy_poll = {busy_poll}\n"
        if busy_poll is not None:
            os.environ[BUSY_POLL_ENV] = str(busy_poll)  # read when the SDK connects, below
        proc, sock_dir = start_daemon(Path(tmp), pool, "64MiB", node=node,
                                      command=(str(Path(__file__).resolve()), "--daemon", str(marks)))
        calls: list[tuple[int, int]] = []
        try:
            cc = connect(sock_dir)
            cc.register_kvcache([[buf.reshape(2 * n, 1, SIZE)]])
            wait_filled(cc)
            for i in range(n):  # warm-up: the same path, other keys
                cc.save([i], hashes=[1_000_000 + i], offsets=[1])
            DaemonClient._send, DaemonClient._dispatch = timed_send, timed_dispatch  # type: ignore[method-assign]
            Grants.take = timed_take  # type: ignore[method-assign]
            for i in range(n):
                t0 = time.monotonic_ns()
                res = cc.save([i], hashes=[2_000_000 + i], offsets=[1])
                calls.append((t0, time.monotonic_ns()))
                if res.success != 1:
                    raise RuntimeError(f"save {i} did not store its block: {res}")
        finally:
            DaemonClient._send, DaemonClient._dispatch = send, dispatch  # type: ignore[method-assign]
            Grants.take = take  # type: ignore[method-assign]
            Ems._reset()
            stop(proc)
        rows = split(calls, puts, answers, daemon_reads(marks.read_bytes()))
    if not rows:
        raise RuntimeError("no save could be matched with the daemon's read of it")
    out: dict[str, Any] = {"saves": n, "matched": len(rows)}
    for k, name in enumerate((*PARTS, "call")):
        col = [r[k] for r in rows]
        out[name] = {"p10": quantile(col, 0.1), "p50": quantile(col, 0.5), "p90": quantile(col, 0.9)}
    every = [t1 - t0 for t0, t1 in calls]
    out["every call"] = {f"p{q}": quantile(every, q / 100) for q in (10, 50, 90)}
    waits = [t for t in takes if t > GRANT_WAIT]
    out["grant waits"] = {"saves": len(waits), "p99": quantile(takes, 0.99), "max": max(takes) / 1000.0}
    slow = sorted(rows, key=lambda r: r[5])[-max(1, len(rows) // 10):]
    whole = sum(r[5] for r in slow)
    out["slowest tenth"] = {name: sum(r[k] for r in slow) / whole for k, name in enumerate(PARTS)}
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--daemon":  # the traced daemon this benchmark starts
        sys.exit(traced_daemon(Path(sys.argv[2]), sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="saves timed (default 3000)")
    ap.add_argument("--pool", default="1024MiB", help="the daemon's pool.size (default 1024MiB)")
    ap.add_argument("--busy-poll", type=int, default=None, metavar="US",
                    help="the daemon's node.busy_poll and the SDK's EMS_BUSY_POLL_US (default: theirs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 10 <= args.n <= 20_000:
        ap.error("--n must be 10..20000")
    out = run(args.n, args.pool, args.busy_poll)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"one 64 KiB save a call, {out['matched']} of {out['saves']} saves matched; us")
    print("| part | p10 | p50 | p90 | share of the slowest tenth |")
    print("|---|---|---|---|---|")
    for name in (*PARTS, "call", "every call"):
        q = out[name]
        share = f"{out['slowest tenth'][name]:.0%}" if name in PARTS else ""
        print(f"| {name} | {q['p10']:.1f} | {q['p50']:.1f} | {q['p90']:.1f} | {share} |")
    g = out["grant waits"]
    print(f"saves whose granted chunks took over {GRANT_WAIT // 1000} us to take (a GRANT's answer awaited): "
          f"{g['saves']}; p99 of the taking {g['p99']:.1f} us, longest {g['max']:.1f}")


if __name__ == "__main__":
    main()
