"""What the peer transports need of their daemon: one owner of the pool's blocks.

A block that arrives from a peer (its forwarded save, a replica, a copy this
node fetched) or leaves to one (a GET it serves) is stored or lent through a
``BlockOwner``, never through the store directly: the owner checks tenants'
quotas, seals and verifies checksums and plans disk-tier promotions in one
place for local clients and peers alike. ``emsd.service.Service`` is the
owner; this protocol keeps the transport from importing it.

Every method is synchronous and runs on the event loop's thread. The pool's
bytes (where the transport reads and writes a block) are handed to the
transports next to the owner, as a writable memoryview of the whole region.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from emsd.effects import Promote
    from emsd.pool.keys import KeyBatch
    from emsd.pool.store import Pinned, Reservation


class BlockOwner(Protocol):
    """Blocks that arrive from and leave to peers, as ``emsd.service.Service`` keeps them."""

    def namespace_id(self, name: str) -> int:
        """The local id of a peer's namespace ``name`` (created on first use)."""
        ...

    def readers_namespace(self, tenant: str, name: str) -> int | None:
        """The local id of namespace ``name`` as a client of ``tenant`` names it, if it is in
        use here, else None (nothing made): how a reader with a pass names blocks."""
        ...

    def reserve_arriving(self, ns: int, keys: KeyBatch, sizes: np.ndarray, copy: bool) -> Reservation:
        """Places for blocks about to arrive from a peer, within the tenant's quota (the keys
        past what fits are FAILED); the NEW ones are held against the quota until
        ``commit_arrived`` or ``abort_arriving`` ends them. ``copy``: read-cache copies this
        node fetched (they evict only other copies)."""
        ...

    def commit_arrived(self, handles: np.ndarray) -> int:
        """The NEW blocks of one ``reserve_arriving`` have arrived: sealed, committed, their
        hold ended. Returns how many were committed."""
        ...

    def abort_arriving(self, handles: np.ndarray) -> int:
        """The NEW blocks of one ``reserve_arriving`` will not arrive: aborted, hold ended."""
        ...

    def pin_to_lend(self, ns: int, keys: KeyBatch) -> Pinned:
        """Pin the leading present ``keys`` to send to a peer, cut before the first block whose
        checksum fails; end with ``release_lent``."""
        ...

    def release_lent(self, handles: np.ndarray) -> None:
        """Release blocks ``pin_to_lend`` pinned."""
        ...

    def present_count(self, ns: int, keys: KeyBatch) -> int:
        """How many leading ``keys`` this node holds, in the pool or on its disk tier."""
        ...

    def drop_namespace(self, name: str) -> int:
        """Drop namespace ``name`` here; the blocks evicted."""
        ...

    def peer_promotion(self, ns: int, keys: KeyBatch) -> Promote | None:
        """The disk-tier promotion a peer's GET of ``keys`` needs before its blocks are pinned,
        or None (all in the pool, no disk tier, or the next missing block not on disk)."""
        ...
