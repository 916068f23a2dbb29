"""What every membership implementation offers, and what a node advertises.

A daemon learns who its peers are through a ``Membership``: ``start()``
joins, ``members()`` is the last known view (always including the daemon
itself), ``on_change`` callbacks fire when the view changes, ``stop()``
leaves. States, and what they mean for the caller:

- STANDALONE: no cluster configured; the view is this node alone.
- CONNECTING: not joined yet (the coordination service is unreachable);
  keep serving locally, the join happens in the background.
- JOINED: registered and watching; the view is current.
- SUSPENDED: the connection dropped but the session may still be alive;
  keep serving with the last view.
- LOST: the session expired (our registration is gone); keep serving with
  the last view, re-registration happens as soon as the service is back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import msgpack

MAX_INFO_BYTES = 16 * 1024


class DuplicateNodeError(Exception):
    """Another live daemon is registered under this node id."""


class MembershipState(Enum):
    STANDALONE = "standalone"
    CONNECTING = "connecting"
    JOINED = "joined"
    SUSPENDED = "suspended"
    LOST = "lost"


@dataclass(frozen=True)
class NodeInfo:
    """What a daemon advertises to the others."""

    node_id: str
    peer_addr: str  # "host:port" of its peer transport
    capacity: int  # pool bytes
    protocol: int  # peer protocol version
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. RDMA endpoint info, later

    def encode(self) -> bytes:
        return msgpack.packb({"id": self.node_id, "peer": self.peer_addr, "cap": self.capacity,
                              "proto": self.protocol, "extra": self.extra}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> NodeInfo:
        """Parse an advertisement; raises ``ValueError`` on anything malformed."""
        if len(data) > MAX_INFO_BYTES:
            raise ValueError("node info too large")
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception:  # msgpack raises several unrelated types
            raise ValueError("node info is not msgpack") from None
        if not isinstance(raw, dict):
            raise ValueError("node info is not a map")
        node_id, peer, cap, proto = raw.get("id"), raw.get("peer"), raw.get("cap"), raw.get("proto")
        extra = raw.get("extra", {})
        if not (isinstance(node_id, str) and node_id and isinstance(peer, str)
                and type(cap) is int and cap > 0 and type(proto) is int and isinstance(extra, dict)):
            raise ValueError("node info has missing or mistyped fields")
        return cls(node_id, peer, cap, proto, extra)


ViewCallback = Callable[[tuple[NodeInfo, ...]], None]


class Membership(Protocol):
    state: MembershipState

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def members(self) -> tuple[NodeInfo, ...]: ...

    def on_change(self, callback: ViewCallback) -> None: ...
