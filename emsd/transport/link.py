"""The interface between the cluster and a peer transport: one link to one peer.

``emsd.cluster`` only talks to peers through ``PeerLink`` objects made by a
``Dialer``. The TCP transport (``emsd.transport.peer.PeerConnection``)
is the one implementation today; an RDMA transport slots in by providing
the same six calls and ``closed``. Every failure surfaces as ``PeerError`` (the
cluster then treats the peer as down for a moment); a cancelled call must leave
nothing reserved in the local pool and the link closed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from emsd.pool.keys import KeyBatch


class PeerLink(Protocol):
    peer_id: str  # the node id the peer proved during authentication

    async def connect(self, host: str, port: int, timeout: float = 5.0) -> None:
        """Open and authenticate; raises ``PeerError``."""

    async def get(self, ns_name: str, keys: KeyBatch) -> int:
        """Fetch the leading blocks the peer has into the local pool; how many are now local."""

    async def put(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray) -> int:
        """Send local blocks (pool offsets/lengths, pinned by the caller); the peer's leading stored count."""

    async def exists(self, ns_name: str, keys: KeyBatch) -> int:
        """How many leading ``keys`` the peer holds (READY); nothing moves, nothing is pinned."""

    async def drop(self, ns_name: str) -> int:
        """Have the peer drop namespace ``ns_name`` (``Service.drop_namespace``): 1 once it has,
        0 if the peer refused (it stays up); raises ``PeerError`` if the link fails."""

    def close(self) -> None:
        """Drop the link; later calls raise ``PeerError``."""

    @property
    def closed(self) -> bool:
        """True once the link is closed (``close``, or a call that failed or was cancelled): unusable."""


Dialer = Callable[[], PeerLink]  # a fresh, unconnected link
