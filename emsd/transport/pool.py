"""Links to peers, pooled: dialing, round robin, backoff, a retry on a fresh link, faults, metrics.

``PeerPool.call(node, op, request)`` runs one request on a link to ``node``
and turns every failure into 0 ("nothing moved"), so that a dead or slow
peer costs misses, never an exception:

- Up to ``size`` links per peer are opened on first use (never more, even
  when parallel requests race to dial) and then taken round robin.
- A pooled link that fails is replaced once by a freshly dialed one before
  the peer counts as down: the peer may have restarted since the link's last
  use, and only a new connection reaches its new process. Requests are
  idempotent (blocks are content-addressed), so the retry is safe.
- A peer that fails a fresh link, or cannot be dialed, is left alone for
  ``BACKOFF`` seconds, logged once when it goes down and once when it is up
  again, and counted in ``emsd_peer_errors_total``.
- Injected faults (``emsd.faults``, tests only) strike at ``peer.<op>``.

Which links exist follows the placement view: ``retain`` closes the links to
nodes that left it. Every backoff reads the running event loop's clock, so a
loop with a virtual clock (tests/sim/) makes them virtual.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

from emsd.faults import FAULTS
from emsd.metrics import Metrics
from emsd.transport.link import Dialer, PeerLink
from emsd.transport.stream import PeerError

log = logging.getLogger("emsd.cluster")

BACKOFF = 1.0  # seconds a peer that failed is left alone

Request = Callable[[PeerLink], Coroutine[Any, Any, int]]  # one request on a link: how many blocks
Moved = Callable[[PeerLink, int], int]  # (link, blocks the request answered) -> bytes it moved


def _now() -> float:
    """The running loop's clock: backoffs are measured on it."""
    return asyncio.get_running_loop().time()


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


async def _inject(site: str, conn: PeerLink) -> None:
    """Apply an injected fault at ``site`` (tests only: ``emsd.faults``)."""
    rule = FAULTS.at(site) if FAULTS is not None else None
    if rule is None:
        return
    if rule.action == "delay":
        await asyncio.sleep(rule.seconds)
        return
    if rule.action == "drop":
        conn.close()
    raise PeerError(f"injected fault at {site}: {rule.action}")


class PeerPool:
    """Pooled links to the peers of one daemon (see the module docstring)."""

    def __init__(self, dial: Dialer, address: Callable[[str], str | None], size: int,
                 metrics: Metrics | None = None) -> None:
        """``dial`` makes an unconnected link; ``address(node)`` is the node's peer endpoint
        ("host:port"), or None while it is not a member; ``size``: links per peer at most."""
        self.dial = dial
        self.address = address
        self.size = size
        self.metrics = metrics
        self.down: set[str] = set()  # peers last seen failing (logged once)
        self._conns: dict[str, list[PeerLink]] = {}
        self._next: dict[str, int] = defaultdict(int)
        self._down_until: dict[str, float] = {}
        self._dialing: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._fresh: set[PeerLink] = set()  # links dialed and not used yet

    async def call(self, node: str, op: str, request: Request, moved: Moved | None = None) -> int:
        """``request`` on a link to ``node``: what it returns, 0 if it fails (see the module
        docstring). ``moved`` gives the bytes of a request that answered blocks, for metrics."""
        conn = await self._conn(node)
        if conn is None:
            return 0
        fresh = conn in self._fresh
        self._fresh.discard(conn)
        got = await self._guard(node, op, conn, request(conn), moved, stale_ok=not fresh)
        if got is not None:
            return got
        conn = await self._conn(node, new=True)  # not another pooled link: it may be as stale
        if conn is None:
            return 0
        self._fresh.discard(conn)
        return await self._guard(node, op, conn, request(conn), moved) or 0

    def retain(self, present: set[str]) -> list[str]:
        """Close the links to nodes not in ``present``; the nodes whose links were closed."""
        gone = [node for node in self._conns if node not in present]
        for node in gone:
            for conn in self._conns.pop(node):
                conn.close()
                self._fresh.discard(conn)
        return gone

    def close(self) -> None:
        """Close every link."""
        for conns in self._conns.values():
            for conn in conns:
                conn.close()
        self._conns.clear()
        self._fresh.clear()

    async def _guard(self, node: str, op: str, conn: PeerLink, job: Coroutine[Any, Any, int],
                     moved: Moved | None, stale_ok: bool = False) -> int | None:
        """Run ``job`` on ``conn``: what it returns; 0 if it fails, or None with ``stale_ok`` (try anew)."""
        try:
            if FAULTS is not None:
                await _inject(f"peer.{op}", conn)
            got = int(await job)
        except PeerError as exc:
            if stale_ok:
                log.debug("pooled link to %s failed (%s): trying a fresh one", node, exc)
                self._discard(node, conn)
                return None
            self._mark_down(node, str(exc))
            self._drop(node, conn)
            if self.metrics is not None:
                self.metrics.peer(node, op, 0, 0, False)
            return 0
        finally:
            job.close()  # never started when an injected fault or a cancel came first
        self._mark_up(node)
        if self.metrics is not None and moved is not None and got:
            self.metrics.peer(node, op, got, moved(conn, got), True)
        return got

    def _mark_down(self, node: str, why: str) -> None:
        """Log a peer going down once, not once per failed request."""
        if node not in self.down:
            self.down.add(node)
            log.warning("peer %s down: %s", node, why)

    def _mark_up(self, node: str) -> None:
        if node in self.down:
            self.down.discard(node)
            log.info("peer %s up again", node)

    async def _conn(self, node: str, new: bool = False) -> PeerLink | None:
        """A connection to ``node`` (round robin over up to ``size``; ``new``: one dialed now, in
        place of a pooled one the caller has just dropped); None if unreachable."""
        if _now() < self._down_until.get(node, 0.0):
            return None
        addr = self.address(node)
        if addr is None:
            return None
        conns = self._conns.setdefault(node, [])
        # A call cut off by its deadline closed its link (the stream was out of step) without
        # failing: drop such links here, or the next call would fail on one and back off.
        conns[:] = [c for c in conns if not c.closed]
        if new or len(conns) < self.size:
            async with self._dialing[node]:  # parallel jobs must not open more than the limit
                if new or len(conns) < self.size:
                    return await self._dial(node, addr, conns)
        if not conns:  # another job's dial failed while this one waited
            return None
        self._next[node] += 1
        return conns[self._next[node] % len(conns)]

    async def _dial(self, node: str, addr: str, conns: list[PeerLink]) -> PeerLink | None:
        conn = self.dial()
        try:
            await conn.connect(*split_endpoint(addr))
        except PeerError as exc:
            self._mark_down(node, str(exc))
            self._down_until[node] = _now() + BACKOFF
            return None
        conns.append(conn)
        self._fresh.add(conn)
        return conn

    def _drop(self, node: str, conn: PeerLink) -> None:
        """Close and forget a failed link; leave the peer alone for ``BACKOFF`` seconds."""
        self._discard(node, conn)
        self._down_until[node] = _now() + BACKOFF

    def _discard(self, node: str, conn: PeerLink) -> None:
        conn.close()
        self._fresh.discard(conn)
        conns = self._conns.get(node, [])
        if conn in conns:
            conns.remove(conn)
