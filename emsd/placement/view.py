"""One daemon's placement view: the members it knows, the ring built from them, who disagrees.

``PlacementView`` is the part of a cluster that decides where keys live,
and nothing else: no sockets, no threads, no event loop. ``emsd.cluster``
feeds it what membership reports (``update`` with a view of members,
``adopt`` with the cluster's placement record) and asks it for owners.

- The ring is rebuilt from scratch at every ``update``, with the record's
  ``(vnodes, replicas)`` once there is one, else this node's config.
- A draining node (``draining``) leaves itself out of every view: it owns
  nothing, and new saves go to the others. A view with no member left keeps
  this node alone, so that keys can still be placed.
- Members whose ring parameters differ from the ones in use are named in
  ``disagree`` and logged once per member and value
  (``emsd.placement.agreement``).
"""

from __future__ import annotations

import logging

import numpy as np

from emsd.membership.base import NodeInfo
from emsd.placement.agreement import Params, disagreeing
from emsd.placement.record import Record
from emsd.placement.ring import ClusterView, Member, Ring
from emsd.pool.keys import KeyBatch

log = logging.getLogger("emsd.cluster")


class PlacementView:
    """Members, ring and placement agreement of the daemon ``me`` (see the module docstring)."""

    def __init__(self, me: NodeInfo, config: Params) -> None:
        """``config``: this node's own ``(cluster.vnodes, cluster.replicas)``."""
        self.me = me
        self.node_id = me.node_id
        self.config = config
        self.record: Record | None = None  # the cluster's placement record (ZooKeeper), once read
        self.members: tuple[NodeInfo, ...] = (me,)
        self.ring = Ring.build(ClusterView.of([Member(me.node_id, me.capacity)]), *config)
        self._alone = True  # the ring's only member is this node (``alone``)
        self.draining = False  # left the ring (emsctl drain): owns nothing, serves what it has
        self.disagree: dict[str, Params] = {}  # members whose ring parameters differ (update)
        self._disagree_logged: set[tuple[str, Params]] = set()

    @property
    def params(self) -> Params:
        """(vnodes, replicas) the ring is built with: the cluster's record, else this node's config."""
        return self.record.params if self.record is not None else self.config

    @property
    def config_differs(self) -> bool:
        """This node's own ``cluster.vnodes``/``replicas`` differ from the record it places keys by."""
        return self.record is not None and self.record.params != self.config

    def adopt(self, record: Record) -> bool:
        """Place keys by the cluster's placement record (``emsd.placement.record``) from the next
        ``update`` on; False if it is the record already in use (nothing to rebuild)."""
        if record == self.record:
            return False
        before, self.record = self.params, record
        if self.config_differs:
            log.error("placement: this node's config says vnodes=%d replicas=%d, the cluster's record "
                      "vnodes=%d replicas=%d (version %d): using the record; the config is not used",
                      *self.config, *record.params, record.version)
        if record.params != before:
            log.warning("placement: ring parameters vnodes=%d replicas=%d -> vnodes=%d replicas=%d "
                        "(record version %d)", *before, *record.params, record.version)
        return True

    def update(self, view: tuple[NodeInfo, ...]) -> set[str]:
        """Adopt a membership view: rebuild the ring; the node ids it now holds."""
        if self.draining:
            view = tuple(n for n in view if n.node_id != self.node_id)
        if not view:  # even a drained node needs a ring to place keys on: keep itself
            view = (self.me,)
        self.members = view
        self.ring = Ring.build(ClusterView.of(Member(n.node_id, n.capacity) for n in view), *self.params)
        self._alone = all(n.node_id == self.node_id for n in view)
        self._check(view)
        present = {n.node_id for n in view}
        log.info("placement ring: %d members (%s)", len(view), ", ".join(sorted(present)))
        return present

    def _check(self, view: tuple[NodeInfo, ...]) -> None:
        """Name the members that place keys otherwise (``emsd.placement.agreement``): in
        ``self.disagree`` (STATS), and in one error line per member and value. Under the
        cluster's record, members that follow it place keys alike whatever their config says:
        only those that do not (older daemons) are compared, with the record's values."""
        mine = self.params
        self.disagree = disagreeing(view, self.node_id, mine, skip_followers=self.record is not None)
        for node, theirs in self.disagree.items():
            if (node, theirs) not in self._disagree_logged:
                self._disagree_logged.add((node, theirs))
                log.error("placement: node %s uses vnodes=%d replicas=%d, this node vnodes=%d replicas=%d: "
                          "they disagree on owners and loads between them miss; set the same "
                          "cluster.vnodes and cluster.replicas on every node", node, *theirs, *mine)

    def member(self, node: str) -> NodeInfo | None:
        """``node``'s entry in the current view (None: not a member now)."""
        return next((n for n in self.members if n.node_id == node), None)

    def owned_here(self, ns_name: str, keys: KeyBatch) -> np.ndarray:
        """True per key that this node owns (as primary or as a replica)."""
        me = self.my_index()
        if me < 0 or len(keys) == 0:
            return np.full(len(keys), me >= 0 and not self.draining, dtype=bool)
        return (self.ring.owners(ns_name, keys) == me).any(axis=1)

    def owner_ids(self, ns_name: str, keys: KeyBatch) -> list[list[str]]:
        """The owners' node ids of each key, primary first."""
        return self.ring.owner_ids(ns_name, keys)

    def share(self) -> dict[str, float]:
        """Each member's fraction of the hash space (as primary)."""
        return self.ring.share()

    def alone(self) -> bool:
        """No other node to talk to: every key is owned here (a standalone node, or a cluster
        whose other members are gone). Kept with the ring: every request asks."""
        return self._alone

    def others(self) -> list[str]:
        """The other members' node ids."""
        return [m.node_id for m in self.ring.view.members if m.node_id != self.node_id]

    def my_index(self, ring: Ring | None = None) -> int:
        """This node's index in the (current) ring's members; -1 while the view lacks it (ZooKeeper lost)."""
        ids = [m.node_id for m in (ring or self.ring).view.members]
        return ids.index(self.node_id) if self.node_id in ids else -1

    def group(self, ring: Ring, owner_idx: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """``positions`` grouped by the node id at ``owner_idx`` (same length; indices into the
        members of ``ring``, the ring they were computed with), skipping this node."""
        members = ring.view.members
        if owner_idx.size == 1:  # one key
            node = members[int(owner_idx[0])].node_id
            return {} if node == self.node_id else {node: positions}
        return {members[o].node_id: positions[owner_idx == o]
                for o in np.unique(owner_idx).tolist() if members[o].node_id != self.node_id}
