"""A fixed membership: the node itself plus a configured list (or nobody: standalone)."""

from __future__ import annotations

from emsd.membership.base import MembershipState, NodeInfo, ViewCallback


class StaticMembership:
    """The view never changes; STANDALONE when there are no others."""

    def __init__(self, me: NodeInfo, others: tuple[NodeInfo, ...] = ()) -> None:
        ids = [me.node_id, *(o.node_id for o in others)]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate node id in the static member list")
        self._view = tuple(sorted((me, *others), key=lambda n: n.node_id))
        self.state = MembershipState.STANDALONE if not others else MembershipState.CONNECTING

    def start(self) -> None:
        if self.state is not MembershipState.STANDALONE:
            self.state = MembershipState.JOINED

    def stop(self) -> None:
        pass

    def members(self) -> tuple[NodeInfo, ...]:
        return self._view

    def on_change(self, callback: ViewCallback) -> None:
        pass  # a static view never changes
