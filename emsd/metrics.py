"""Prometheus metrics and the small HTTP endpoint that serves them.

``Metrics`` owns one ``CollectorRegistry`` per daemon (not the global one, so
several daemons can live in one test process). Counters and histograms are
updated on the request path; pool gauges are read from the store at scrape
time by ``PoolCollector``, so the hot path pays nothing for them.

``HttpEndpoint`` answers ``GET /healthz`` (200 once the pool is ready, 503
before), ``GET /metrics`` (Prometheus text format) and 404 otherwise. It is a
deliberately tiny HTTP/1.0 server on asyncio: one request per connection, a
bounded request line, no body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("emsd.metrics")

# 10 us to 5 s, roughly x2.5 per step.
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)


class Metrics:
    """The daemon's metrics; every method is cheap enough for the request path."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ops = Counter("emsd_ops", "Requests handled, by op and result", ["op", "result"],
                           registry=r)
        self.latency = Histogram("emsd_op_duration_seconds", "Server-side request time, by op",
                                 ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.keys = Counter("emsd_lookup_keys", "Keys looked up, by op and result (hit/miss)",
                            ["op", "result"], registry=r)
        self.bytes = Counter("emsd_op_bytes", "Block bytes handed out, by op (reserve/pin)",
                             ["op"], registry=r)
        self.save_failed = Counter("emsd_reserve_failed_keys",
                                   "Keys a reserve could not place (pool full of pinned blocks)",
                                   registry=r)
        self.clients = Gauge("emsd_clients_connected", "SDK connections open", registry=r)
        self.ready = Gauge("emsd_ready", "1 once the pool is attached and serving", registry=r)
        self._children: dict[Any, Any] = {}

    def observe_op(self, op: str, result: str, seconds: float) -> None:
        key = (op, result)
        child = self._children.get(key)
        if child is None:
            child = (self.ops.labels(op, result), self.latency.labels(op))
            self._children[key] = child
        child[0].inc()
        child[1].observe(seconds)

    def reserved(self, keys: int, nbytes: int, failed: int) -> None:
        self._child(self.bytes, "reserve").inc(nbytes)
        if failed:
            self.save_failed.inc(failed)

    def looked_up(self, op: str, hits: int, misses: int, nbytes: int) -> None:
        if hits:
            self._child(self.keys, op, "hit").inc(hits)
        if misses:
            self._child(self.keys, op, "miss").inc(misses)
        if nbytes:
            self._child(self.bytes, op).inc(nbytes)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: ``labels()`` costs microseconds a call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch_pool(self, stats: Callable[[], Any]) -> None:
        """Publish the store's gauges, read from ``stats()`` at each scrape."""
        self.registry.register(PoolCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolCollector(Collector):
    """Pool gauges computed at scrape time from ``BlockStore.stats()``."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self._stats()
        pool = GaugeMetricFamily("emsd_pool_bytes", "Pool bytes by state", labels=["state"])
        pool.add_metric(["capacity"], st.capacity)
        pool.add_metric(["used"], st.bytes_used)
        pool.add_metric(["free"], st.bytes_free)
        yield pool
        yield GaugeMetricFamily("emsd_pool_entries", "Blocks in the index", value=st.entries)
        yield GaugeMetricFamily("emsd_pool_pending_blocks", "Blocks reserved, not committed",
                                value=st.pending)
        yield GaugeMetricFamily("emsd_pool_pinned_blocks", "Blocks pinned by readers",
                                value=st.pinned)
        yield GaugeMetricFamily("emsd_pool_cached_blocks",
                                "Read-cache copies of blocks owned by other nodes", value=st.cached)
        ev = GaugeMetricFamily("emsd_pool_evictions", "Blocks evicted since start, by reason",
                               labels=["reason"])
        for reason, n in sorted(st.evictions.items()):
            ev.add_metric([reason], n)
        yield ev
        ns = GaugeMetricFamily("emsd_pool_namespace_bytes", "Committed bytes by namespace id",
                               labels=["namespace"])
        for ns_id, n in sorted(st.ns_bytes.items()):
            ns.add_metric([str(ns_id)], n)
        yield ns
        cls = GaugeMetricFamily("emsd_pool_class_bytes", "Bytes in slab pages by size class",
                                labels=["chunk_size"])
        for c in st.classes:
            cls.add_metric([str(c.chunk_size)], c.pages * _page_bytes(st, c))
        yield cls


def _page_bytes(st: Any, c: Any) -> int:
    return int(getattr(c, "page_size", 0) or getattr(st, "page_size", 0) or 0)


class HttpEndpoint:
    """``/healthz`` and ``/metrics`` over a minimal asyncio HTTP/1.0 server."""

    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool]) -> None:
        self.metrics = metrics
        self.is_ready = is_ready
        self.server: asyncio.base_events.Server | None = None

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] != "GET":
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"only GET\n"
            elif path == "/healthz":
                ok = self.is_ready()
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", b"ok\n" if ok else b"starting\n"
            elif path == "/metrics":
                status, body = "200 OK", self.metrics.render()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
