"""Every node of a cluster must place keys alike: the ring parameters it advertises, and who differs.

A node builds its ring from its own ``cluster.vnodes`` and ``cluster.replicas``.
Two nodes with different values disagree on owners: a block saved through
one is looked for elsewhere by the other, and loads between them miss (a
rolling upgrade across the 2026-11-23 change of the ``vnodes`` default from
160 to 512 does exactly that). So each node advertises its values in its
membership entry (``NodeInfo.extra[RING_KEY]``) and names the members whose
values differ. Nodes from before this was advertised say nothing and are
not named. In a ZooKeeper cluster every node places keys by the cluster's
record (``emsd.placement.record``) and advertises that it does
(``"record": true``): what such a node advertises is only its config, so it
is never named; members that do not follow a record (daemons from before
the record, in a rolling upgrade) are compared with the record's values.
Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from emsd.membership.base import NodeInfo

RING_KEY = "ring"
Params = tuple[int, int]  # (vnodes, replicas)


def advertised(vnodes: int, replicas: int, follows_record: bool = False) -> dict[str, Any]:
    """The ``NodeInfo.extra`` entries that announce this node's ring parameters (its config) and
    whether it places keys by the cluster's record instead."""
    ring: dict[str, Any] = {"vnodes": vnodes, "replicas": replicas}
    if follows_record:
        ring["record"] = True
    return {RING_KEY: ring}


def follows_record(extra: Mapping[str, Any]) -> bool:
    """The member says it places keys by the cluster's placement record."""
    raw = extra.get(RING_KEY)
    return isinstance(raw, Mapping) and raw.get("record") is True


def params_of(extra: Mapping[str, Any]) -> Params | None:
    """(vnodes, replicas) a member advertised; None when it advertised none, or nothing valid."""
    raw = extra.get(RING_KEY)
    if not isinstance(raw, Mapping):
        return None
    vnodes, replicas = raw.get("vnodes"), raw.get("replicas")
    if type(vnodes) is not int or type(replicas) is not int or vnodes < 1 or replicas < 1:
        return None
    return vnodes, replicas


def disagreeing(view: Iterable[NodeInfo], me: str, mine: Params,
                skip_followers: bool = False) -> dict[str, Params]:
    """The other members of ``view`` that advertise parameters other than ``mine``: id -> theirs.
    ``skip_followers`` (``mine`` are the record's): members that follow the record are not named."""
    out: dict[str, Params] = {}
    for node in view:
        theirs = params_of(node.extra)
        if skip_followers and follows_record(node.extra):
            continue
        if node.node_id != me and theirs is not None and theirs != mine:
            out[node.node_id] = theirs
    return out
