"""Tenants' quotas on one node: what each tenant holds, and how much more of it fits.

A tenant with a quota (``tenants.*.quota``) may hold at most that many bytes on
this node: the committed bytes of its namespaces (``BlockStore.ns_bytes``) plus
what is held for it uncommitted, by its client connections (reserved and granted
chunks) and by transfers without a session here (a peer's blocks still arriving,
a promotion still reading). ``Quotas`` keeps that uncommitted total per tenant
(``hold``, signed, from integers: exact) and answers the two questions every
path that stores a tenant's bytes asks:

- ``fit``: how many leading blocks of a save fit, after evicting the tenant's
  own least recently used blocks (never another tenant's, never the save's own
  keys);
- ``fit_grant``: how many chunks a GRANT may hand out, from free room only (a
  GRANT is speculative and never evicts).

A tenant without a quota always fits. The ``Service`` decides who the tenant is
(from the connection, or from a namespace's name) and owns the namespace table
this reads (``namespaces``: tenant -> its namespace ids).
"""

from __future__ import annotations

import numpy as np

from emsd.pool.index import FIRST_ID
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.tenants import Tenants


class Quotas:
    """The quota books of one node's tenants (see the module docstring)."""

    def __init__(self, tenants: Tenants, store: BlockStore, namespaces: dict[str, set[int]]) -> None:
        """``namespaces``: each tenant's namespace ids, kept by the caller (read, never written)."""
        self.tenants = tenants
        self.store = store
        self.namespaces = namespaces
        self.uncommitted: dict[str, int] = {}  # tenant -> bytes held for it uncommitted

    def held(self, tenant: str) -> int:
        """What ``tenant``'s quota counts now: the committed bytes of its namespaces plus what
        is held for it uncommitted."""
        committed = sum(self.store.ns_bytes(ns) for ns in self.namespaces.get(tenant, ()))
        return committed + self.uncommitted.get(tenant, 0)

    def hold(self, tenant: str, delta: int) -> None:
        """``delta`` more (negative: fewer) bytes are held for ``tenant`` uncommitted."""
        left = self.uncommitted.get(tenant, 0) + delta
        if left:
            self.uncommitted[tenant] = left
        else:
            self.uncommitted.pop(tenant, None)

    def fit(self, tenant: str, ns: int, keys: KeyBatch, sizes: np.ndarray, counted: int = 0) -> int:
        """How many leading ``keys`` (``sizes`` bytes) of a save into namespace ``ns`` fit
        ``tenant``'s quota (all without one), after evicting its own LRU blocks other than
        ``keys``. ``counted``: bytes of the save already held (granted chunks it fills)."""
        quota = self.tenants.quota(tenant)
        if quota is None:
            return len(keys)
        want = int(sizes.sum())
        held = self.held(tenant) - counted
        if held + want > quota:
            present = self.store.index.find(ns, keys)
            mine = np.fromiter(self.namespaces.get(tenant, ()), dtype=np.int64)
            held -= self.store.evict_within(mine, held + want - quota, present[present >= FIRST_ID])
        room = np.cumsum(sizes.astype(np.int64)) <= quota - held
        return int(room.argmin()) if not room.all() else len(keys)

    def fit_grant(self, tenant: str, chunk: int, k: int) -> int:
        """How many of ``k`` chunks of ``chunk`` bytes a GRANT may hand ``tenant`` (all without a
        quota): only from room the quota has free. A GRANT is speculative (the SDK asks after
        each save for the next one's worth, and more), so evicting for it would drop the blocks
        just saved; a tenant at its quota gets none and saves with RESERVE, which evicts its own
        LRU blocks as a commit over the quota does."""
        quota = self.tenants.quota(tenant)
        if quota is None:
            return k
        return max(0, min(k, (quota - self.held(tenant)) // chunk))
