"""Reads straight from the owner: a load of blocks another node owns without the local daemon.

In a cluster, a load of blocks this node does not hold goes, by default,
through the local daemon: the SDK asks it (PIN), it fetches the blocks from
their owner into its pool, and the SDK copies them out: four process
wake-ups (SDK, daemon, owner, daemon, SDK). A load that keeps no read-cache
copy here (``write_rcache`` off) needs nothing from the local daemon, so the
SDK can ask the owner itself, as a Mooncake client asks its owner: two
wake-ups, and the bytes cross one socket, straight into a buffer of the
caller's process.

``DirectReads`` asks the local daemon for its ring and a read pass (local op
RING: ``emsd.protocol.local.RingAnswer``, ``emsd.protocol.readpass``), builds
the same consistent-hash ring (``emsd.placement.ring``) and places the load's
keys itself; the leading keys whose owners do not include this node are read
from their primary owner over a TCP connection to its peer port that shows the
pass (peer op READ, then GETs of the client's own tenant only:
``emsd.transport.peer``). What the owner lacks, and everything after, is
loaded through the local daemon as before, so a stale ring costs a round trip,
never a wrong answer: an owner serves only blocks it holds under the key asked.

When it is not used: a standalone node, a node alone in its view, TLS peers
or ``cluster.direct_reads = false`` (the daemon refuses RING; asked again
every ``RING_REFRESH`` seconds), loads that keep a read-cache copy
(``write_rcache`` on, the default: the daemon's fetch keeps it) or read this
node only, CUDA layouts (the bytes land in host memory first; untested here,
no GPU), runs of more than ``DIRECT_MOST`` bytes (the daemon moves bulk in
threads without the GIL), and ``EMS_DIRECT_READS=0``. An owner that cannot be
reached is not asked again for ``DOWN_FOR`` seconds. The ring and the pass
are asked for again every ``RING_REFRESH`` seconds, and the pass before it
expires.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ems.common.exception import EmsException
from emsd.placement.ring import ClusterView, Member, Ring
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import RingAnswer
from emsd.protocol.peer import GetAnswer, GetRequest
from emsd.transport.frames import (
    PREFIX,
    PROTOCOL_VERSION,
    FrameError,
    Op,
    PeerOp,
    Status,
    check_lengths,
    decode_header,
    encode_parts,
)

if TYPE_CHECKING:
    from ems.client import DaemonClient

DIRECT_ENV = "EMS_DIRECT_READS"  # "0": always load through the local daemon
DIRECT_MOST = 4 << 20  # block bytes one direct read may bring
RING_REFRESH = 10.0  # seconds a ring (or a refusal to give one) is used before asking again
DOWN_FOR = 1.0  # seconds an owner that failed is not asked
CONNECT_TIMEOUT = 1.0  # seconds to reach an owner and show the pass
LINKS_PER_OWNER = 4  # idle connections kept to one owner (one GET at a time each)


def wanted() -> bool:
    """Whether this process reads from owners directly (``EMS_DIRECT_READS``, default on)."""
    return os.environ.get(DIRECT_ENV, "1") != "0"


class DirectError(Exception):
    """The owner could not be asked, or broke the protocol: load through the daemon instead."""


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise DirectError("the owner closed the connection")
        view = view[got:]


def _recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    prefix = bytearray(PREFIX.size)
    _recv_exact(sock, memoryview(prefix))
    head_len, body_len = PREFIX.unpack(prefix)
    check_lengths(head_len, body_len)
    raw = bytearray(head_len + body_len)
    _recv_exact(sock, memoryview(raw))
    return decode_header(memoryview(raw)[:head_len]), bytes(raw[head_len:])


def _send_frame(sock: socket.socket, header: dict[str, Any], *payload: bytes) -> None:
    sock.sendall(b"".join(encode_parts({"v": PROTOCOL_VERSION, **header}, *payload)))


class OwnerLink:
    """One connection to an owner's peer port that showed a read pass; one GET at a time."""

    def __init__(self, address: str, read_pass: bytes) -> None:
        """Connect and show ``read_pass``; raises ``DirectError``."""
        host, _, port = address.rpartition(":")
        self.read_pass = read_pass
        self._ids = 0
        try:
            self.sock = socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT)
        except (OSError, ValueError) as exc:
            raise DirectError(f"cannot reach owner {address}: {exc}") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header, _ = _recv_frame(self.sock)
            if header.get("op") != PeerOp.CHALLENGE:
                raise DirectError("the owner did not open with a challenge")
            _send_frame(self.sock, {"id": 0, "op": int(PeerOp.READ), "pass": read_pass})
            answer, _ = _recv_frame(self.sock)
            if answer.get("st") != Status.OK:
                raise DirectError(f"the owner refused the read pass: {answer.get('msg')}")
        except (OSError, FrameError, DirectError) as exc:
            self.sock.close()
            raise DirectError(f"owner {address}: {exc}") from None

    def get(self, name: str, keys: KeyBatch, into: memoryview, timeout: float) -> np.ndarray:
        """The lengths of the leading blocks of ``keys`` the owner holds, their bytes received
        into ``into`` one after the other; raises ``DirectError`` (then close the link) if the
        owner fails, refuses or sends more than ``into`` holds."""
        self._ids += 1
        rid = self._ids
        header, parts = GetRequest(name, keys).encode()
        try:
            self.sock.settimeout(timeout)
            _send_frame(self.sock, {**header, "id": rid}, *parts)
            answer, payload = _recv_frame(self.sock)
            if answer.get("id") != rid or answer.get("st") != Status.OK:
                raise DirectError(f"GET refused: {answer.get('msg', 'answer out of step')}")
            got = GetAnswer.decode(answer, payload, len(keys))
            if got.bulk > len(into):
                raise DirectError(f"the owner sent {got.bulk} bytes for {len(into)} asked")
            _recv_exact(self.sock, into[: got.bulk])
        except (OSError, FrameError) as exc:
            raise DirectError(f"GET from the owner failed: {exc}") from None
        return got.lengths

    def close(self) -> None:
        self.sock.close()


class _Ring:
    """A RING answer in use: the ring built from it and when to ask again."""

    def __init__(self, answer: RingAnswer, now: float) -> None:
        self.answer = answer
        view = ClusterView.of(Member(node, cap) for node, cap, _ in answer.members)
        self.ring = Ring.build(view, answer.vnodes, answer.replicas)
        self.me = next((i for i, m in enumerate(view.members) if m.node_id == answer.me), -1)
        self.address = {node: peer for node, _, peer in answer.members}
        self.renew = now + min(RING_REFRESH, answer.ttl / 2)


class DirectReads:
    """Reads from owners for one ``ContextCaching`` (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ring: _Ring | None = None
        self._ring_of: DaemonClient | None = None  # the connection the ring was asked on
        self._asked_at = -RING_REFRESH  # when RING was last asked (monotonic): refused, ask again later
        self._idle: dict[str, list[OwnerLink]] = {}
        self._down: dict[str, float] = {}  # owner -> monotonic time until which it is not asked
        self.reads = 0  # blocks loaded from owners directly (tests, benchmarks)

    def run(self, client: DaemonClient, name: str, keys: KeyBatch,
            timeout: float | None) -> tuple[str, int] | None:
        """The owner to read the leading keys from and how many of them it is the primary
        owner of (none of them owned by this node), or None: load through the daemon."""
        ring = self._current(client, timeout)
        if ring is None:
            return None
        owners = ring.ring.owners(ring.answer.prefix + name, keys)
        first = int(owners[0, 0])
        ok = (owners[:, 0] == first) & ~(owners == ring.me).any(axis=1)
        if not ok[0]:
            return None  # this node owns the first key: the daemon has it, or nobody does
        run = len(keys) if ok.all() else int(np.argmin(ok))
        node = ring.ring.view.members[first].node_id
        if self._down.get(node, 0.0) > time.monotonic():
            return None
        return node, run

    def read(self, node: str, name: str, keys: KeyBatch, into: memoryview,
             timeout: float) -> np.ndarray | None:
        """The lengths of the leading blocks of ``keys`` owner ``node`` sent into ``into``, or
        None if it could not be asked (then it is not asked for ``DOWN_FOR`` seconds)."""
        ring = self._ring
        if ring is None:
            return None
        try:
            link = self._take(node, ring)
            try:
                lengths = link.get(name, keys, into, timeout)
            except DirectError:
                link.close()
                raise
        except DirectError:
            self._down[node] = time.monotonic() + DOWN_FOR
            return None
        self._give(node, link)
        self.reads += lengths.size
        return lengths

    def close(self) -> None:
        with self._lock:
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
        for link in links:
            link.close()

    def _current(self, client: DaemonClient, timeout: float | None) -> _Ring | None:
        """The ring to place keys by, asked of ``client``'s daemon when due; None when the
        daemon does not offer reads from owners."""
        now = time.monotonic()
        ring = self._ring
        if self._ring_of is client:
            if ring is not None and now < ring.renew:
                return ring
            if ring is None and now - self._asked_at < RING_REFRESH:
                return None  # refused a moment ago
        self._asked_at = now
        try:
            header, payload = client.call(Op.RING, {}, timeout=timeout)
            fresh = _Ring(RingAnswer.decode(header, payload), now)
        except (EmsException, FrameError, ValueError):
            fresh = None
        with self._lock:
            old = self._ring
            self._ring, self._ring_of = fresh, client
            same = old is not None and fresh is not None and old.answer.read_pass == fresh.answer.read_pass
            links = [] if same else [link for idle in self._idle.values() for link in idle]
            if links:
                self._idle.clear()
        for link in links:
            link.close()
        return fresh

    def _take(self, node: str, ring: _Ring) -> OwnerLink:
        with self._lock:
            idle = self._idle.get(node)
            if idle:
                return idle.pop()
        address = ring.address.get(node)
        if address is None:
            raise DirectError(f"{node} is not in the ring")
        return OwnerLink(address, ring.answer.read_pass)

    def _give(self, node: str, link: OwnerLink) -> None:
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if len(idle) < LINKS_PER_OWNER and (self._ring is not None
                                                 and link.read_pass == self._ring.answer.read_pass):
                idle.append(link)
                return
        link.close()
