"""The HTTP endpoint: health, readiness and Prometheus metrics.

``HttpEndpoint`` answers ``GET /healthz`` (200 while the process serves:
liveness), ``GET /readyz`` (200 once the pool is attached and the node is
standalone or joined to its cluster, else 503 and the reason: readiness; a
ready node that runs without a part, such as a failed disk tier, adds a
``degraded:`` line),
``GET /metrics`` (Prometheus text format) and 404 otherwise. It is a
deliberately tiny HTTP/1.0 server on asyncio: one request per connection, no
body, and the limits below on everything a stranger could stretch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from emsd.logs import Once
from emsd.metrics import Metrics

log = logging.getLogger("emsd.http")

# The HTTP endpoint's limits: it is reachable by anything on the network (metrics.listen is
# often 0.0.0.0). A request head must arrive whole within REQUEST_DEADLINE, in at most
# MAX_HEAD_LINES lines of at most 8 KiB; the answer must be taken within DRAIN_TIMEOUT; at most
# MAX_HTTP_CONNECTIONS are open at once, MAX_HTTP_PER_ADDRESS from one source address. A
# connection past a cap is closed unanswered, counted in emsd_http_connections_refused_total
# and logged at most once a minute, so the process keeps descriptors for its SDK clients and
# the probes of other addresses (the kubelet's, Prometheus') keep their answers.
REQUEST_DEADLINE = 5.0
DRAIN_TIMEOUT = 10.0
MAX_HEAD_LINES = 64
MAX_HTTP_CONNECTIONS = 64
MAX_HTTP_PER_ADDRESS = 8


class HttpEndpoint:
    """``/healthz``, ``/readyz`` and ``/metrics`` over a minimal asyncio HTTP/1.0 server, with the
    limits above."""

    def __init__(self, metrics: Metrics, readiness: Callable[[], str | None]) -> None:
        self.metrics = metrics
        self.readiness = readiness  # None: ready; else the reason it is not
        self.degraded: Callable[[], str | None] = lambda: None  # ready, but a part is off (a failed disk)
        self.server: asyncio.base_events.Server | None = None
        self.open: collections.Counter[str] = collections.Counter()  # connections by source address
        self._refusal_log = Once(60.0)
        self._refused = metrics.http_refused

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port, limit=8192)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def _admit(self, address: str) -> bool:
        """Whether a connection from ``address`` may be served now (and count it if so)."""
        if sum(self.open.values()) < MAX_HTTP_CONNECTIONS and self.open[address] < MAX_HTTP_PER_ADDRESS:
            self.open[address] += 1
            return True
        self._refused.inc()
        if self._refusal_log.due():
            log.warning("HTTP connection from %s closed unanswered: %d open (at most %d, %d from one "
                        "address; it has %d); said once a minute at most", address, sum(self.open.values()),
                        MAX_HTTP_CONNECTIONS, MAX_HTTP_PER_ADDRESS, self.open[address])
        return False

    def _left(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._admit(address):
            writer.transport.abort()
            return
        try:
            line = await asyncio.wait_for(_read_head(reader), REQUEST_DEADLINE)
            status, ctype, body = self._answer(line)
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body
            )
            await asyncio.wait_for(writer.drain(), DRAIN_TIMEOUT)
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            writer.transport.abort()  # no lingering over a peer that does not read
        finally:
            self._left(address)
            writer.close()

    def _answer(self, line: bytes) -> tuple[str, str, bytes]:
        """(status, content type, body) for a request line."""
        parts = line.decode("latin-1").split()
        path = parts[1].split("?")[0] if len(parts) >= 2 else ""
        if len(parts) < 2 or parts[0] != "GET":
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/healthz":  # the process is alive and its event loop turns
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            why = self.readiness()
            if why is None:
                less = self.degraded()
                return "200 OK", "text/plain", b"ready\n" + (f"degraded: {less}\n".encode() if less else b"")
            return "503 Service Unavailable", "text/plain", why.encode() + b"\n"
        if path == "/metrics":
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", self.metrics.render()
        return "404 Not Found", "text/plain", b"not found\n"


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The request line, after reading the head through its blank line (at most
    ``MAX_HEAD_LINES`` lines: ``ValueError`` past them)."""
    line = await reader.readline()
    for _ in range(MAX_HEAD_LINES):
        if await reader.readline() in (b"\r\n", b"\n", b""):
            return line
    raise ValueError("request head too long")
