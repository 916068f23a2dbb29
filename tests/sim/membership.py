"""A simulated coordination service: what ZooKeeper does for emsd, in one process.

``Coordinator`` holds the registrations (ZooKeeper's ephemeral znodes) and
tells every watching member about changes after a random delay drawn from
the simulation's one ``random.Random`` (a children watch firing, the client
reading the children again). A delivery reads the registrations as they are
when it fires, as a re-read after a watch does, so a member never goes back
to an older view; views differ between members only until the deliveries
land.

``SimMembership`` implements ``emsd.membership.base.Membership`` the way
``ZooKeeperMembership`` behaves: the view always includes the member
itself, callbacks run only when the view changed, a lost session
(``Coordinator.expire``) keeps the last view in state LOST until
``Coordinator.restore`` registers the member again.
"""

from __future__ import annotations

import asyncio
import random

from emsd.membership.base import DuplicateNodeError, MembershipState, NodeInfo, ViewCallback


class Coordinator:
    """The registrations and the watches of one simulated cluster."""

    def __init__(self, rng: random.Random, loop: asyncio.AbstractEventLoop, max_delay: float) -> None:
        self.rng = rng
        self.loop = loop
        self.max_delay = max_delay  # a watch fires within this many virtual seconds
        self.registered: dict[str, NodeInfo] = {}
        self.watchers: dict[str, SimMembership] = {}
        self.in_flight = 0  # deliveries scheduled and not yet fired

    def register(self, member: SimMembership) -> None:
        """Create the member's registration; raises ``DuplicateNodeError`` if the id is live."""
        node_id = member.me.node_id
        if node_id in self.registered and self.watchers.get(node_id) is not member:
            raise DuplicateNodeError(f"node id {node_id!r} is registered by another live member")
        self.registered[node_id] = member.me
        self.watchers[node_id] = member
        self._changed()

    def deregister(self, member: SimMembership) -> None:
        """Remove the member's registration and watch (a clean stop, or its session expired)."""
        node_id = member.me.node_id
        if self.watchers.get(node_id) is member:
            del self.watchers[node_id]
            self.registered.pop(node_id, None)
            self._changed()

    def expire(self, member: SimMembership) -> None:
        """The member's session expires: its registration goes, it keeps its last view (LOST)."""
        self.deregister(member)
        member.state = MembershipState.LOST

    def restore(self, member: SimMembership) -> None:
        """A LOST member reconnects with a new session and registers again."""
        if member.state is MembershipState.LOST and not member.stopped:
            self.register(member)
            member.state = MembershipState.JOINED

    def view(self) -> tuple[NodeInfo, ...]:
        return tuple(self.registered[k] for k in sorted(self.registered))

    def _changed(self) -> None:
        for node_id in sorted(self.watchers):
            self.in_flight += 1
            self.loop.call_later(self.rng.uniform(0.0, self.max_delay), self._deliver, self.watchers[node_id])

    def _deliver(self, member: SimMembership) -> None:
        self.in_flight -= 1
        if self.watchers.get(member.me.node_id) is member:
            member.refresh(self.view())


class SimMembership:
    """One daemon's membership in a ``Coordinator`` (the ``Membership`` protocol)."""

    def __init__(self, coordinator: Coordinator, me: NodeInfo) -> None:
        self.coordinator = coordinator
        self.me = me
        self.state = MembershipState.CONNECTING
        self.stopped = False
        self._view: tuple[NodeInfo, ...] = (me,)
        self._callbacks: list[ViewCallback] = []

    def start(self) -> None:
        self.coordinator.register(self)
        self.state = MembershipState.JOINED
        self.refresh(self.coordinator.view())

    def stop(self) -> None:
        self.stopped = True
        self.coordinator.deregister(self)

    def members(self) -> tuple[NodeInfo, ...]:
        return self._view

    def on_change(self, callback: ViewCallback) -> None:
        self._callbacks.append(callback)

    def refresh(self, registered: tuple[NodeInfo, ...]) -> None:
        """Adopt the registrations read from the coordinator (plus this member itself)."""
        view = {n.node_id: n for n in registered}
        view[self.me.node_id] = self.me
        members = tuple(view[k] for k in sorted(view))
        if members != self._view:
            self._view = members
            for callback in self._callbacks:
                callback(members)
