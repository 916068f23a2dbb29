"""Placement: which nodes own a block (consistent hashing; pure functions)."""

from emsd.placement.ring import ClusterView, Member, Ring, key_positions

__all__ = ["ClusterView", "Member", "Ring", "key_positions"]
