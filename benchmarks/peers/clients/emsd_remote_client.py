"""emsd's remote path: a client of node A saves and loads blocks that node B owns.

Two daemons in one cluster (a ZooKeeper and two standalone processes on loopback,
started as benchmarks/bench_cluster.py does). A put is a save on A with
``write_rcache`` off: A forwards the block to its owner B over the peer transport and
keeps no copy. A get is a load on A: A fetches the block from B into its pool, then
the SDK copies it into the destination. Every key is read once, so no get is served
from A's copy. Keys are remapped, untimed (``plan``), to ones the ring gives to B.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: the helpers
from bench_sdk import connect  # noqa: E402
from clients.emsd_client import EmsdClient  # noqa: E402


class EmsdRemoteClient(EmsdClient):
    def __init__(self, sock_dir: Path, volume: int, pool: int) -> None:
        from ems import CcConfig, CcKvOption
        from ems.namespace import namespace_name
        from emsd.placement import ClusterView, Member, Ring

        self.cc = connect(sock_dir)
        self.buffer = np.ones(2 * volume, dtype=np.uint8)
        self.n = 0
        self.ns = namespace_name(None, CcConfig(rank_id=0, device_id=0, model_id="bench"), "")
        self.ring = Ring.build(ClusterView.of([Member("a", pool), Member("b", pool)]))
        self.remote_only = CcKvOption(write_rcache=False)
        self.owned: dict[int, int] = {}

    def plan(self, keys: list[int]) -> None:
        """Map each key to the first of 64 candidates that B owns (all A's: 2**-64)."""
        from emsd.pool.keys import KeyBatch

        cand = (np.array(keys, dtype=np.uint64)[:, None] * np.uint64(64) + np.arange(64, dtype=np.uint64))
        owners = np.array(self.ring.owner_ids(self.ns, KeyBatch.from_ints(cand.ravel())))[:, 0]
        mine = (owners == "b").reshape(len(keys), 64)
        if not mine.any(axis=1).all():
            raise RuntimeError("no candidate key owned by node b")
        picked = cand[np.arange(len(keys)), mine.argmax(axis=1)]
        self.owned = {k: int(c) for k, c in zip(keys, picked, strict=True)}

    def put(self, keys: list[int], first: int) -> None:
        hashes = [self.owned[k] for k in keys]
        res = self.cc.save(list(range(first, first + len(keys))), hashes=hashes, offsets=[1] * len(keys),
                           option=self.remote_only)
        if res.success != len(keys):
            raise RuntimeError(f"emsd remote save stored {res.success} of {len(keys)}: {res}")

    def get(self, keys: list[int], first: int) -> None:
        super().get([self.owned[k] for k in keys], first)


def open_client(options: dict[str, Any]) -> EmsdRemoteClient:
    return EmsdRemoteClient(Path(options["sock_dir"]), int(options["volume"]), int(options["pool"]))
