"""The cluster of a standalone node: one member, this node, and nobody else to reach.

A daemon without ``[cluster]`` is a cluster of one (the embedded default). ``Solo``
answers what the request path asks of a cluster (``emsd.cluster.Cluster``) the way a
cluster whose only member is this node would: the placement view has one member
(``PlacementView.alone``), so every key is owned here and the service plans no work
with other nodes; STATS and the metrics show the one-member view (and a handoff that
never runs); there is no membership to join, no peer to serve and no ring to leave
(``state`` STANDALONE).
"""

from __future__ import annotations

from typing import Any

from emsd.membership.base import MembershipState, NodeInfo
from emsd.placement.ring import DEFAULT_VNODES
from emsd.placement.view import PlacementView


class Solo:
    """A standalone node's cluster (see the module docstring)."""

    state = MembershipState.STANDALONE
    shares_placement = False  # no placement record: nothing to rewrite
    transport_name = "none"  # no peers

    def __init__(self, node_id: str, capacity: int) -> None:
        self.node_id = node_id
        self.placement = PlacementView(NodeInfo(node_id, "", capacity, 0, {}), (DEFAULT_VNODES, 1))
        self.handed: dict[str, float] = {"passes": 0, "moved": 0, "kept": 0, "seconds": 0.0}  # none, ever

    def read_ring(self, tenant: str) -> None:
        """No other node to read from: clients read here (local op RING is refused)."""
        return None

    def stats(self) -> dict[str, Any]:
        """STATS' cluster fields: the one-member view, which owns the whole hash space."""
        me = self.placement.me
        return {"transport": self.transport_name, "share": {self.node_id: 1.0},
                "view": [{"id": me.node_id, "capacity": me.capacity, "peer": ""}]}

    def transport_summary(self) -> str:
        """How this node reaches peers, for its start-up line: it does not."""
        return self.transport_name

    async def stop(self) -> None:
        """Nothing to leave or close."""
