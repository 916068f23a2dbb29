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

VNODES = range(1, 4097)  # the values cluster.vnodes accepts (emsd.config)
REPLICAS = range(1, 9)  # and cluster.replicas


def invalid(vnodes: object, replicas: object) -> str | None:
    """Why (vnodes, replicas) cannot be a record's, or None when they can."""
    if type(vnodes) is not int or vnodes not in VNODES:
        return f"vnodes must be an integer in 1..{VNODES[-1]} (got {vnodes!r})"
    if type(replicas) is not int or replicas not in REPLICAS:
        return f"replicas must be an integer in 1..{REPLICAS[-1]} (got {replicas!r})"
    return None


class NotWritten(Exception):
    """The record could not be written (ZooKeeper did not answer)."""


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
        """The record in ``data``; None for anything else (empty, not JSON, values out of range:
        a hand-edited znode must not build a ring of a million points)."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(raw, dict):
            return None
        vnodes, replicas, version = raw.get("vnodes"), raw.get("replicas"), raw.get("version")
        if invalid(vnodes, replicas) is not None or type(version) is not int or version < 1:
            return None
        assert isinstance(vnodes, int) and isinstance(replicas, int) and isinstance(version, int)
        return cls(vnodes, replicas, version)


def path(cluster: str) -> str:
    """The record's znode for cluster ``cluster``."""
    return f"/emsd/{cluster}/placement"
