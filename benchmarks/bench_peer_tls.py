"""The cost of mutual TLS on the peer transport: GET throughput over TLS as a ratio of plain TCP.

    python benchmarks/bench_peer_tls.py [--json] [--rounds N]

In one process, over loopback: a ``PeerServer`` serves 32 blocks of 2 MiB
from its pool and a ``PeerConnection`` fetches them into another pool (the
daemon-to-daemon path, no SDK), once over plain TCP and once over mutual
TLS (certificates made with the ``openssl`` command, as the tests do).
Rounds alternate plain and TLS so the machine's background load hits both
alike; each figure is the median over the rounds, and the result is the
ratio TLS / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import certs  # noqa: E402

from emsd.metrics import Metrics  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.pool.store import BlockStore  # noqa: E402
from emsd.service import Service  # noqa: E402
from emsd.transport.peer import PeerConnection, PeerServer  # noqa: E402
from emsd.transport.tls import PeerTls  # noqa: E402

BLOCK, BLOCKS = 2 << 20, 32
POOL, PAGE = 256 << 20, 8 << 20
SECRET = b"benchmark-cluster-secret"


class Pool:
    def __init__(self) -> None:
        self.mem = bytearray(POOL)
        self.store = BlockStore(POOL, PAGE)
        self.pool = memoryview(self.mem)
        self.service = Service(self.store, "bench", "bench", Metrics())  # the transports' BlockOwner
        self.service.namespace_id("ns")  # id 0, where fill() puts the blocks

    def fill(self, keys: list[int]) -> None:
        res = self.store.reserve(0, KeyBatch.from_user(keys), np.full(len(keys), BLOCK, np.uint64))
        rng = np.random.default_rng(1)
        for off in res.offsets.tolist():
            self.mem[off : off + BLOCK] = rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        self.store.commit(res.handles[res.status == 0])


async def fetch_seconds(tls_pair: tuple[PeerTls, PeerTls] | None) -> float:
    """Seconds to GET all blocks once into a fresh pool."""
    owner, fetcher = Pool(), Pool()
    keys = list(range(1, BLOCKS + 1))
    owner.fill(keys)
    server = PeerServer(owner.service, owner.pool, "b", SECRET, tls=tls_pair[0] if tls_pair else None)
    _, port = await server.start("127.0.0.1", 0)
    conn = PeerConnection(fetcher.service, fetcher.pool, "a", SECRET, tls_pair[1] if tls_pair else None)
    try:
        await conn.connect("127.0.0.1", port)
        t0 = time.perf_counter()
        got = await conn.get("ns", KeyBatch.from_user(keys))
        seconds = time.perf_counter() - t0
        assert got == BLOCKS, got
        return seconds
    finally:
        conn.close()
        await server.close()


async def run(rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        ca = certs.Authority(Path(tmp), "bench").create()
        files = {n: ca.issue(n) for n in ("a", "b")}
        pair = tuple(PeerTls.load(str(files[n][0]), str(files[n][1]), str(ca.cert)) for n in ("b", "a"))
        plain, tls = [], []
        await fetch_seconds(None)  # warm-up: threads, page faults
        for _ in range(rounds):
            plain.append(await fetch_seconds(None))
            tls.append(await fetch_seconds(pair))  # type: ignore[arg-type]
    gib = BLOCK * BLOCKS / (1 << 30)
    p, t = statistics.median(plain), statistics.median(tls)
    return {"plain_gib_s": gib / p, "tls_gib_s": gib / t, "tls_over_plain": p / t}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if certs.available() is not None:
        sys.exit(str(certs.available()))
    result = asyncio.run(run(args.rounds))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"peer GET of {BLOCKS} x {BLOCK >> 20} MiB: plain {result['plain_gib_s']:.2f} GiB/s, "
              f"mutual TLS {result['tls_gib_s']:.2f} GiB/s, TLS/plain {result['tls_over_plain']:.2f}")


if __name__ == "__main__":
    main()
