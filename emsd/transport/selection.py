"""Which transport each peer gets: the selection and fallback state machine.

Config ``cluster.transport`` sets the mode:

- ``tcp``: every peer over TCP.
- ``auto``: RDMA with a peer when this node has a working RDMA endpoint,
  the peer advertises a well-formed one, and the QP connection succeeds;
  TCP otherwise.
- ``rdma``: like ``auto``, except that start-up fails when this node has no
  RDMA device (``emsd.server``); a peer without RDMA still gets TCP, with a
  warning, so data keeps moving.

Per peer, states (``PeerPath``), one line each:

- UNDECIDED: not dialed yet.
- RDMA: the last link opened over RDMA.
- TCP: over TCP, for ``reason`` (mode, no local device, peer advertises
  none, malformed advertisement, connect failed).
- FELL_BACK: RDMA failed mid-transfer; TCP from then on (until the peer
  re-registers with a different advertisement, or this daemon restarts).

``PeerTransports`` holds the states; its methods return whether the state
changed, so callers log and count each change once, never per request.
It never awaits and never touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MODES = ("auto", "rdma", "tcp")
KINDS = ("config", "no_local_device", "no_advert", "bad_advert", "connect", "transfer")


class PeerPath(Enum):
    UNDECIDED = "undecided"
    RDMA = "rdma"
    TCP = "tcp"
    FELL_BACK = "fell_back"


@dataclass(frozen=True)
class PathState:
    path: PeerPath
    reason: str  # why not RDMA ("" for RDMA), for people
    advert: object = None  # the advertisement this was decided for (a change re-decides)
    kind: str = ""  # the reason as a metric label: one of KINDS

    @property
    def transport(self) -> str:
        return "rdma" if self.path is PeerPath.RDMA else "tcp"


class PeerTransports:
    """Per-peer transport choice for one daemon."""

    def __init__(self, mode: str, local_reason: str) -> None:
        """``local_reason``: why this node has no RDMA endpoint ("" when it has one)."""
        if mode not in MODES:
            raise ValueError(f"transport must be one of {', '.join(MODES)} (got {mode!r})")
        self.mode = mode
        self.local_reason = "cluster.transport is \"tcp\"" if mode == "tcp" else local_reason
        self._peers: dict[str, PathState] = {}

    @property
    def rdma_enabled(self) -> bool:
        return not self.local_reason

    def state(self, peer: str) -> PathState:
        return self._peers.get(peer, PathState(PeerPath.UNDECIDED, ""))

    def should_try_rdma(self, peer: str, advert: object, advert_error: str = "") -> tuple[bool, bool]:
        """Whether a new link to ``peer`` should try RDMA; and whether the state changed.

        ``advert`` is the peer's parsed descriptor (None: it advertises
        none); ``advert_error`` the reason a malformed one was rejected. A
        peer that fell back stays on TCP while its advertisement is the same.
        """
        cur = self.state(peer)
        if cur.path is PeerPath.FELL_BACK and cur.advert == advert:
            return False, False
        if self.local_reason:
            kind, reason = ("config" if self.mode == "tcp" else "no_local_device"), self.local_reason
        elif advert_error:
            kind, reason = "bad_advert", f"the peer's RDMA advertisement is malformed: {advert_error}"
        elif advert is None:
            kind, reason = "no_advert", "the peer advertises no RDMA endpoint"
        else:
            return True, False
        return False, self._set(peer, PathState(PeerPath.TCP, reason, advert, kind))

    def connected(self, peer: str, advert: object) -> bool:
        """A link to ``peer`` opened over RDMA; True if that is a change."""
        return self._set(peer, PathState(PeerPath.RDMA, "", advert))

    def connect_failed(self, peer: str, advert: object, why: str) -> bool:
        """Setting up RDMA with ``peer`` failed: TCP for this link; True if that is a change."""
        return self._set(peer, PathState(PeerPath.TCP, f"RDMA connect failed: {why}", advert, "connect"))

    def transfer_failed(self, peer: str, why: str) -> bool:
        """RDMA failed mid-transfer: TCP for this peer from now on; True if that is a change."""
        cur = self.state(peer)
        return self._set(peer, PathState(PeerPath.FELL_BACK, f"RDMA failed mid-transfer: {why}", cur.advert,
                                         "transfer"))

    def uses_rdma(self, peer: str) -> bool:
        return self.state(peer).path is PeerPath.RDMA

    def forget(self, peer: str) -> None:
        """``peer`` left the view."""
        self._peers.pop(peer, None)

    def snapshot(self) -> dict[str, dict[str, str]]:
        """Per peer: {"transport": "rdma"|"tcp", "state", "reason"} (for STATS and emsctl)."""
        return {p: {"transport": s.transport, "state": s.path.value, "reason": s.reason}
                for p, s in sorted(self._peers.items())}

    def _set(self, peer: str, new: PathState) -> bool:
        old = self._peers.get(peer)
        self._peers[peer] = new
        return old is None or (old.path, old.reason) != (new.path, new.reason)
