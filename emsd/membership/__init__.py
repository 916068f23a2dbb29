"""Membership: who is in the cluster (ZooKeeper, or a static list)."""

from emsd.membership.base import DuplicateNodeError, MembershipState, NodeInfo
from emsd.membership.static import StaticMembership

__all__ = ["DuplicateNodeError", "MembershipState", "NodeInfo", "StaticMembership"]
