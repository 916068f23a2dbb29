"""Every node of a cluster must place keys alike: the ring parameters it advertises, and who differs.

A node builds its ring from its own ``cluster.vnodes`` and ``cluster.replicas``.
Two nodes with different values disagree on owners: a block saved through
one is looked for elsewhere by the other, and loads between them miss (a
rolling upgrade across the 2026-11-23 change of the ``vnodes`` default from
160 to 512 does exactly that). So each node advertises its values in its
membership entry (``NodeInfo.extra[RING_KEY]``) and names the members whose
values differ. Nodes from before this was advertised say nothing and are
not named. Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from emsd.membership.base import NodeInfo

RING_KEY = "ring"
Params = tuple[int, int]  # (vnodes, replicas)


def advertised(vnodes: int, replicas: int) -> dict[str, Any]:
    """The ``NodeInfo.extra`` entries that announce this node's ring parameters."""
    return {RING_KEY: {"vnodes": vnodes, "replicas": replicas}}


def params_of(extra: Mapping[str, Any]) -> Params | None:
    """(vnodes, replicas) a member advertised; None when it advertised none, or nothing valid."""
    raw = extra.get(RING_KEY)
    if not isinstance(raw, Mapping):
        return None
    vnodes, replicas = raw.get("vnodes"), raw.get("replicas")
    if type(vnodes) is not int or type(replicas) is not int or vnodes < 1 or replicas < 1:
        return None
    return vnodes, replicas


def disagreeing(view: Iterable[NodeInfo], me: str, mine: Params) -> dict[str, Params]:
    """The other members of ``view`` that advertise parameters other than ``mine``: id -> theirs."""
    out: dict[str, Params] = {}
    for node in view:
        theirs = params_of(node.extra)
        if node.node_id != me and theirs is not None and theirs != mine:
            out[node.node_id] = theirs
    return out
