"""The cluster's one placement record: the ring parameters every node of a ZooKeeper cluster uses.

Advertising each node's ``cluster.vnodes`` and ``cluster.replicas``
(``emsd.placement.agreement``) names the nodes that differ, but they still
place keys otherwise and loads between them miss. So a ZooKeeper cluster
keeps one record, the znode ``/emsd/<cluster>/placement``: the first node
to join creates it from its own config (a create race: exactly one node
wins, the others read the winner's), and every node builds its ring from
the record, not from its config. A node whose config differs adopts the
record (a cache keeps serving) and says so: one log line, ``emsctl
status``, STATS and ``emsd_cluster_placement_differs``. ``emsctl placement
set`` rewrites the record; every node's watch rebuilds its ring. Pure
functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from emsd.placement.agreement import Params


@dataclass(frozen=True)
class Record:
    """Ring parameters shared by a cluster; ``version`` counts the changes (1 = as created)."""

    vnodes: int
    replicas: int
    version: int = 1

    @property
    def params(self) -> Params:
        return self.vnodes, self.replicas

    def encode(self) -> bytes:
        return json.dumps({"vnodes": self.vnodes, "replicas": self.replicas,
                           "version": self.version}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Record | None:
        """The record in ``data``; None for anything else (empty, not JSON, values out of range)."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(raw, dict):
            return None
        vnodes, replicas, version = raw.get("vnodes"), raw.get("replicas"), raw.get("version")
        if not all(type(v) is int and v >= 1 for v in (vnodes, replicas, version)):
            return None
        assert isinstance(vnodes, int) and isinstance(replicas, int) and isinstance(version, int)
        return cls(vnodes, replicas, version)


def path(cluster: str) -> str:
    """The record's znode for cluster ``cluster``."""
    return f"/emsd/{cluster}/placement"
