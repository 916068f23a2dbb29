"""Where a single-block call's time goes: the SDK against a real emsd, split by side.

    python benchmarks/bench_latency.py [--size BYTES] [--n N] [--json]

One block a call (64 KiB unless ``--size``), through the SDK against a
standalone daemon (bench_sdk's), p50 over ``--n`` calls of each of save, load
and exists:

- the whole call;
- before send: from the call to its first request on the socket (checks,
  planning, and for a save the copy into the pool);
- round trip: from that request to its answer (the daemon's handling and
  two wake-ups);
- after: from that answer to the return (a load's copy out and its
  RELEASE; a save's request for more granted chunks).

The whole call is also measured with busy polling off on both sides
(``node.busy_poll = 0``, ``EMS_BUSY_POLL_US=0``): both then sleep while they
wait, as before 2026-11-25.

And in the same run, the references:

- a raw Unix-socket echo of 100 bytes with the server in another process,
  both sides sleeping in ``recv`` (what memcached or Redis clients pay), and
  the same echo with both sides polling first for as long as emsd and the
  SDK do (``node.busy_poll``, ``EMS_BUSY_POLL_US``): the floor of any round
  trip here;
- the daemon's handling of the same requests without sockets
  (``Service.handle`` in this process, on a store of the daemon's default
  eviction policy; only its calls are timed, not the building of the
  requests): back to back ("hot"), and each after an 8 MiB copy
  that evicts the caches, as the client's work does between two requests
  on a real daemon ("cold").

And the daemon's handling of one batch save's two requests (RESERVE, then COMMIT of
``--batch`` blocks of ``--batch-size`` bytes, default 32 x 2 MiB, what a step of an
engine saves), in this process on a store with the daemon's shared index: in a
pool that the warm-up fills, so that every measured RESERVE evicts a batch's
worth first (the steady state), and in a pool too large to fill (no eviction);
hot, and each request after a copy of the batch's bytes, as the client's copy
of the batch does between the two on a real daemon ("cold").

The split is read off the SDK's own socket calls (``DaemonClient._send`` and
``_dispatch`` are wrapped in this process only). The machine is shared: read
the columns of one run against each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sdk import SHM, connect, echo_p50_process, start_daemon, stop, wait_filled  # noqa: E402

from ems.client import BUSY_POLL_ENV, busy_poll_budget  # noqa: E402
from emsd.config import NodeConfig  # noqa: E402

DAEMON_POLL_US = NodeConfig().busy_poll  # the daemon bench_sdk starts keeps the default


def busy_poll_budget_us() -> int:
    """The SDK's busy poll as this process was started (``EMS_BUSY_POLL_US``), in microseconds."""
    return _SDK_POLL_US


_SDK_POLL_US = round(busy_poll_budget() * 1e6)

OPS = ("save", "load", "exists")
PAGE = 64 << 20


def pool_bytes(size: int, n: int) -> int:
    """A pool that holds one pass of ``n`` blocks with room to spare: at least 1 GiB, whole pages."""
    return max(1 << 30, -(-3 * n * size // 2 // PAGE) * PAGE)
_marks: list[tuple[str, float]] = []  # ("send" | "answer", perf_counter) of the current call


@contextlib.contextmanager
def _marking() -> Iterator[None]:
    """Record when the SDK sends a request and when an answer arrives."""
    from ems.client import DaemonClient

    send, dispatch = DaemonClient._send, DaemonClient._dispatch

    def marked_send(self: DaemonClient, *args: Any) -> None:
        _marks.append(("send", time.perf_counter()))
        send(self, *args)

    def marked_dispatch(self: DaemonClient, *args: Any) -> None:
        _marks.append(("answer", time.perf_counter()))
        dispatch(self, *args)

    DaemonClient._send, DaemonClient._dispatch = marked_send, marked_dispatch  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DaemonClient._send, DaemonClient._dispatch = send, dispatch  # type: ignore[method-assign,assignment]


def split(t0: float, t1: float, marks: list[tuple[str, float]]) -> tuple[float, float, float, float]:
    """(whole, before send, round trip, after) of one call from ``t0`` to ``t1``, in seconds; the
    three parts add up to the whole. Round trip: the first send to the first answer after it;
    after: from that answer to ``t1``. A call that sent nothing (or got no answer) is all before
    (or all before and round trip)."""
    sends = [t for kind, t in marks if kind == "send"]
    if not sends:
        return t1 - t0, t1 - t0, 0.0, 0.0
    answers = [t for kind, t in marks if kind == "answer" and t >= sends[0]]
    answered = answers[0] if answers else t1
    return t1 - t0, sends[0] - t0, answered - sends[0], t1 - answered


def bench_sdk_calls(size: int, n: int, poll: bool = True) -> dict[str, dict[str, float]]:
    """p50 microseconds of each op's whole call and its three parts, after a warm-up pass;
    ``poll`` false: with busy polling off on both sides (``node.busy_poll = 0``,
    ``EMS_BUSY_POLL_US=0``)."""
    from ems import Ems

    buf = np.ones(2 * n * size, dtype=np.uint8)
    out: dict[str, dict[str, float]] = {}
    os.environ[BUSY_POLL_ENV] = str(busy_poll_budget_us()) if poll else "0"
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:  # tmpfs: the pool file lives here
        proc, sock_dir = start_daemon(Path(tmp), f"{pool_bytes(size, n) >> 20}MiB", f"{PAGE >> 20}MiB",
                                      node="" if poll else "busy_poll = 0\n")
        try:
            cc = connect(sock_dir)
            cc.register_kvcache([[buf.reshape(2 * n, 1, size)]])
            wait_filled(cc)
            calls: dict[str, Callable[[int, int], Any]] = {
                "save": lambda i, base: cc.save([i], hashes=[base + i], offsets=[1]),
                "load": lambda i, base: cc.load([n + i], hashes=[base + i], offsets=[1]),
                "exists": lambda i, base: cc.exists([base + i]),
            }
            with _marking():
                for base in (1_000_000, 2_000_000):  # the first pass warms up
                    rows: dict[str, list[tuple[float, float, float, float]]] = {op: [] for op in OPS}
                    for op in OPS:
                        for i in range(n):
                            _marks.clear()
                            t0 = time.perf_counter()
                            res = calls[op](i, base)
                            t1 = time.perf_counter()
                            if res.success != 1:  # every op finds or stores its one block
                                raise RuntimeError(f"{op} of block {i} did not succeed: {res}")
                            rows[op].append(split(t0, t1, list(_marks)))
            for op in OPS:
                parts = list(zip(*rows[op], strict=True))
                out[op] = {name: statistics.median(col) * 1e6
                           for name, col in zip(("call", "before", "trip", "after"), parts, strict=True)}
        finally:
            Ems._reset()
            stop(proc)
    return out


def _service(store: Any) -> tuple[Any, Any]:
    """A ``Service`` over ``store`` as a standalone daemon has it, and an authenticated session."""
    from emsd.metrics import Metrics
    from emsd.service import Service, Session

    session = Session()
    session.authenticated = True
    return Service(store, "bench", "shm", Metrics()), session


def _timed_handle(svc: Any, session: Any, op: Any, message: Any, rid: int,
                  **extra: Any) -> tuple[dict[str, Any], bytes, float]:
    """``message`` (an ``emsd.protocol.local`` request, encoded as the SDK encodes it) answered
    by ``svc`` for ``session`` as a request of ``op``: the answer, its payload, and the seconds
    in ``Service.handle`` alone."""
    fields, parts = message.encode()
    header, payload = {"op": int(op), "id": rid, **fields, **extra}, b"".join(parts)
    t0 = time.perf_counter()
    resp, out = svc.handle(session, header, payload)
    return resp, b"".join(out), time.perf_counter() - t0


def bench_handler(size: int, n: int) -> dict[str, dict[str, float]]:
    """p50 microseconds of ``Service.handle`` for the requests of each op, hot and cold
    (the time in its calls only: the requests are built as the SDK builds them,
    ``emsd.protocol.local`` messages, outside it)."""
    from emsd.config import PoolConfig
    from emsd.pool.keys import KeyBatch
    from emsd.pool.store import BlockStore
    from emsd.protocol.local import (
        CountAnswer,
        ExistsRequest,
        GrantAnswer,
        GrantRequest,
        NamespaceAnswer,
        NamespaceRequest,
        PinAnswer,
        PinRequest,
        PutRequest,
        ReleaseRequest,
    )
    from emsd.transport.frames import Op

    svc, s = _service(BlockStore(pool_bytes(size, n), PAGE, eviction=PoolConfig().eviction))
    spent = [0.0]  # seconds in Service.handle since the call began

    def handle(op: Op, message: Any, rid: int, **extra: Any) -> tuple[dict[str, Any], bytes]:
        """``message`` answered by ``svc`` as a request of ``op``; only the handling is timed."""
        resp, out, seconds = _timed_handle(svc, s, op, message, rid, **extra)
        spent[0] += seconds
        return resp, out

    ns = NamespaceAnswer.decode(*handle(Op.NAMESPACE, NamespaceRequest("bench"), 1)).ns
    sizes = np.array([size], np.uint64)
    chunks: list[int] = []

    def key(i: int) -> KeyBatch:
        return KeyBatch.from_ints(np.array([i], np.uint64))

    def save(i: int) -> None:  # what the SDK sends: PUT into a granted chunk (GRANT now and then)
        if not chunks:
            granted = GrantAnswer.decode(*handle(Op.GRANT, GrantRequest(size, 64), 2), 64)
            chunks.extend(granted.offsets.tolist())
        put = PutRequest(ns, key(i), np.array([chunks.pop()], np.uint64), sizes)
        resp, _ = handle(Op.PUT, put, 3)
        assert resp["st"] == 0, resp

    def load(i: int) -> None:  # PIN, then RELEASE of what it pinned
        resp, payload = handle(Op.PIN, PinRequest(ns, key(i)), 4)
        assert resp["st"] == 0, resp
        handles = PinAnswer.decode(resp, payload, 1).handles
        assert len(handles) == 1, resp
        resp, _ = handle(Op.RELEASE, ReleaseRequest(handles), 0, nr=True)
        assert resp["st"] == 0, resp

    def exists(i: int) -> None:
        resp, payload = handle(Op.EXISTS, ExistsRequest(ns, key(i)), 5)
        assert resp["st"] == 0 and CountAnswer.decode(resp, payload, 1).held == 1, resp

    junk, sink = np.ones(8 << 20, np.uint8), np.empty(8 << 20, np.uint8)
    out: dict[str, dict[str, float]] = {op: {} for op in OPS}
    for mode, base in (("hot", 10_000_000), ("cold", 20_000_000)):
        for op, fn in (("save", save), ("load", load), ("exists", exists)):
            times = []
            for i in range(n):
                if mode == "cold":
                    np.copyto(sink, junk)
                spent[0] = 0.0
                fn(base + i)
                times.append(spent[0])
            out[op][mode] = statistics.median(times) * 1e6
    return out


def batch_pool(size: int, k: int, rounds: int, evict: bool) -> int:
    """The batch handler's pool, in whole pages: when it should ``evict``, the warm-up's
    batches (a tenth of the rounds, at least two), so that the measured RESERVEs evict;
    else room for every round's batch."""
    batches = max(2, rounds // 10) if evict else rounds + 1
    return -(-batches * size * k // PAGE) * PAGE


def bench_batch_handler(size: int, k: int, rounds: int = 200) -> dict[str, dict[str, float]]:
    """p50 microseconds of ``Service.handle`` for a batch save's RESERVE and COMMIT of ``k``
    blocks of ``size`` bytes (over the rounds after a tenth of warm-up), in a pool that
    evicts and in one that does not, hot and cold: ``{op: {"<pool> <mode>": us}}``."""
    out: dict[str, dict[str, float]] = {"reserve": {}, "commit": {}}
    for pool, evict in (("evicting", True), ("no eviction", False)):
        for mode in ("hot", "cold"):
            reserve, commit = _batch_rounds(batch_pool(size, k, rounds, evict), size, k, rounds,
                                            mode == "cold")
            out["reserve"][f"{pool} {mode}"] = statistics.median(reserve) * 1e6
            out["commit"][f"{pool} {mode}"] = statistics.median(commit) * 1e6
    return out


def _batch_rounds(pool: int, size: int, k: int, rounds: int, cold: bool) -> tuple[list[float], list[float]]:
    """Seconds in ``Service.handle`` of each RESERVE and each COMMIT of ``rounds`` batch saves
    of ``k`` new blocks of ``size`` bytes, on a fresh store of ``pool`` bytes with the daemon's
    shared index (after the first tenth); ``cold``: each request after a copy of a batch's
    bytes."""
    from emsd.config import PoolConfig
    from emsd.pool import shared_index
    from emsd.pool.keys import KeyBatch
    from emsd.pool.store import BlockStore
    from emsd.protocol.local import (
        CommitRequest,
        NamespaceAnswer,
        NamespaceRequest,
        ReserveAnswer,
        ReserveRequest,
    )
    from emsd.transport.frames import Op

    store = BlockStore(pool, PAGE, eviction=PoolConfig().eviction)
    if shared_index.available():
        store.shared = shared_index.SharedIndex(shared_index.slots_for(store.capacity))
        while not store.shared.filled():  # its pages allocated, as in a daemon that has run a moment
            time.sleep(0.01)
    svc, session = _service(store)
    junk, sink = (np.ones(size * k, np.uint8), np.empty(size * k, np.uint8)) if cold else (None, None)

    def handle(op: Op, message: Any, rid: int) -> tuple[dict[str, Any], bytes, float]:
        if sink is not None:
            np.copyto(sink, junk)
        return _timed_handle(svc, session, op, message, rid)

    reserves: list[float] = []
    commits: list[float] = []
    try:
        resp, payload, _ = handle(Op.NAMESPACE, NamespaceRequest("bench"), 1)
        ns = NamespaceAnswer.decode(resp, payload).ns
        sizes = np.full(k, size, np.uint64)
        for r in range(rounds):
            keys = KeyBatch.from_ints(np.arange(r * k, (r + 1) * k, dtype=np.uint64) + 1)
            resp, payload, reserve = handle(Op.RESERVE, ReserveRequest(ns, keys, sizes), 2)
            handles = ReserveAnswer.decode(resp, payload, k).handles
            if len(handles) != k:
                raise RuntimeError(f"a RESERVE of {k} blocks placed {len(handles)}: {resp}")
            resp, _, commit = handle(Op.COMMIT, CommitRequest(handles), 3)
            if resp.get("committed") != k:
                raise RuntimeError(f"a COMMIT of {k} blocks committed {resp.get('committed')}: {resp}")
            if r >= rounds // 10:
                reserves.append(reserve)
                commits.append(commit)
    finally:
        if store.shared is not None:
            store.shared.close()
    return reserves, commits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64 << 10, help="block bytes (default 64 KiB)")
    ap.add_argument("--n", type=int, default=1000, help="calls per op (default 1000)")
    ap.add_argument("--batch", type=int, default=32, help="blocks of the batch save (default 32; 0: none)")
    ap.add_argument("--batch-size", type=int, default=2 << 20, help="their bytes (default 2 MiB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 4096 <= args.size <= 8 << 20 or not 10 <= args.n <= 100_000 or args.size * args.n > 4 << 30:
        ap.error("--size must be 4 KiB..8 MiB, --n 10..100000, and --size times --n at most 4 GiB")
    if not 0 <= args.batch <= 1024 or not 4096 <= args.batch_size <= 8 << 20 \
            or args.batch * args.batch_size > 256 << 20:
        ap.error("--batch must be 0..1024, --batch-size 4 KiB..8 MiB, and a batch at most 256 MiB")
    print(f"[latency] {args.n} calls of each op through the SDK, busy polling off ...", file=sys.stderr)
    sleeping = bench_sdk_calls(args.size, args.n, poll=False)
    print(f"[latency] {args.n} calls of each op through the SDK ...", file=sys.stderr)
    sdk = bench_sdk_calls(args.size, args.n)
    print("[latency] the same requests on Service.handle in this process ...", file=sys.stderr)
    handler = bench_handler(args.size, args.n)
    batch = {}
    if args.batch:
        print(f"[latency] RESERVE and COMMIT of {args.batch} x {args.batch_size >> 10} KiB on "
              "Service.handle in this process ...", file=sys.stderr)
        batch = bench_batch_handler(args.batch_size, args.batch)
    echo = echo_p50_process(args.n) * 1e6
    polled = echo_p50_process(args.n, (DAEMON_POLL_US, busy_poll_budget_us())) * 1e6
    if args.json:
        print(json.dumps({"size": args.size, "echo_us": echo, "echo_polling_us": polled, "sdk": sdk,
                          "sdk_no_busy_poll": sleeping, "handler": handler, "batch_handler": batch},
                         indent=2))
        return
    print(f"single {args.size >> 10} KiB blocks, p50 us; raw Unix echo {echo:.0f} us sleeping, "
          f"{polled:.0f} us polling")
    print("| op | call | before send | round trip | after | call / echo (sleeping, polling) "
          "| call without busy polling | handler hot | handler cold |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in OPS:
        c, h = sdk[op], handler[op]
        print(f"| {op} | {c['call']:.0f} | {c['before']:.0f} | {c['trip']:.0f} | {c['after']:.0f} "
              f"| {c['call'] / echo:.1f}x, {c['call'] / polled:.1f}x | {sleeping[op]['call']:.0f} "
              f"| {h['hot']:.0f} | {h['cold']:.0f} |")
    if batch:
        print(f"\nthe daemon's handler for a batch save of {args.batch} x {args.batch_size >> 10} KiB, "
              "in this process, p50 us")
        cols = list(batch["reserve"])
        print("| request | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for op, row in batch.items():
            print(f"| {op.upper()} | " + " | ".join(f"{row[c]:.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
