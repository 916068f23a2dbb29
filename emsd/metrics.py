"""Prometheus metrics.

``Metrics`` owns one ``CollectorRegistry`` per daemon (not the global one, so
several daemons can live in one test process). Counters and histograms are
updated on the request path; pool gauges are read from the store at scrape
time by ``PoolCollector``, so the hot path pays nothing for them.

The HTTP endpoint that serves them is ``emsd.http``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from emsd.tenants import Tenants

log = logging.getLogger("emsd.metrics")

# 10 us to 5 s, roughly x2.5 per step.
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)


class Metrics:
    """The daemon's metrics; every method is cheap enough for the request path."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they double the output and nobody graphs them
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = RequestCounts()  # ops, their latency, keys and bytes: plain ints
        r.register(self.requests)
        self.clients = Gauge("emsd_clients_connected", "SDK connections open", registry=r)
        self.clients_expired = Counter("emsd_clients_expired",
                                       "SDK connections closed for silence past node.client_lease "
                                       "(their pins, reservations and grants released)", registry=r)
        self.http_refused = Counter("emsd_http_connections_refused",
                                    "HTTP connections closed unanswered: too many open, in all or from "
                                    "one address", registry=r)
        self.ready = Gauge("emsd_ready", "1 once the pool is attached and serving", registry=r)
        self.peer_blocks = Counter("emsd_peer_blocks", "Blocks moved with a peer, by peer and op (get/put)",
                                   ["peer", "op"], registry=r)
        self.peer_bytes = Counter("emsd_peer_bytes", "Block bytes moved with a peer, by peer and direction",
                                  ["peer", "direction"], registry=r)
        self.peer_errors = Counter("emsd_peer_errors", "Peer requests that failed, by peer and op",
                                   ["peer", "op"], registry=r)
        self.peer_transport = Gauge("emsd_peer_transport", "Transport in use with a peer (1 = current)",
                                    ["peer", "transport"], registry=r)
        self.peer_fallbacks = Counter("emsd_peer_transport_fallbacks",
                                      "Times a peer was put on TCP although RDMA was allowed, by reason",
                                      ["peer", "reason"], registry=r)
        self.restart = Gauge("emsd_warm_restart_info",
                             "How the pool was attached at start (1 = this outcome)", ["outcome"], registry=r)
        self.restored = Gauge("emsd_warm_restart_restored_blocks", "Blocks served again after a warm restart",
                              registry=r)
        self.build = Gauge("emsd_build_info", "emsd version and peer transport", ["version", "transport"],
                           registry=r)
        self._children: dict[Any, Any] = {}

    def peer(self, node: str, op: str, blocks: int, nbytes: int, ok: bool) -> None:
        """One request to peer ``node`` done: ``blocks`` of ``nbytes`` moved, or an error."""
        if not ok:
            self._child(self.peer_errors, node, op).inc()
        if blocks:
            self._child(self.peer_blocks, node, op).inc(blocks)
            self._child(self.peer_bytes, node, "in" if op == "get" else "out").inc(nbytes)

    def transport(self, node: str, transport: str, reason: str) -> None:
        """Peer ``node`` now uses ``transport`` ("rdma"/"tcp"); a TCP ``reason`` other than "config" counts
        as a fallback (reasons: ``emsd.transport.selection.KINDS``)."""
        for name in ("rdma", "tcp"):
            self._child(self.peer_transport, node, name).set(1 if name == transport else 0)
        if transport == "tcp" and reason != "config":
            self._child(self.peer_fallbacks, node, reason).inc()

    def observe_op(self, op: str, result: str, seconds: float) -> None:
        """One request of ``op`` handled (``result`` "ok" or "error") in ``seconds``."""
        counts = self.requests
        key = (op, result)
        counts.ops[key] = counts.ops.get(key, 0) + 1
        hist = counts.latency.get(op)
        if hist is None:
            hist = counts.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1)
            counts.latency_sum[op] = 0.0
        hist[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bound >= seconds
        counts.latency_sum[op] += seconds

    def reserved(self, keys: int, nbytes: int, failed: int, op: str = "reserve") -> None:
        """A save (RESERVE or PUT: ``op``) placed ``keys`` new blocks of ``nbytes``; ``failed`` got none."""
        counts = self.requests
        counts.bytes[op] = counts.bytes.get(op, 0) + nbytes
        counts.save_failed += failed

    def looked_up(self, op: str, hits: int, misses: int, nbytes: int) -> None:
        """A lookup (``op`` "pin" or "exists") found ``hits`` keys and missed ``misses``,
        handing out ``nbytes`` bytes."""
        keys = self.requests.keys
        if hits:
            keys[op, "hit"] = keys.get((op, "hit"), 0) + hits
        if misses:
            keys[op, "miss"] = keys.get((op, "miss"), 0) + misses
        if nbytes:
            counts = self.requests.bytes
            counts[op] = counts.get(op, 0) + nbytes

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: ``labels()`` costs microseconds a call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch_pool(self, stats: Callable[[], Any], ns_name: Callable[[int], str] = str,
                   namespace_labels: bool = False) -> None:
        """Publish the store's gauges, read from ``stats()`` at each scrape (``PoolCollector``)."""
        self.registry.register(PoolCollector(stats, ns_name, namespace_labels))

    def watch_cluster(self, view: Callable[[], tuple[str, int, int]]) -> None:
        """Publish the membership state and size, read from ``view()`` -> (state, members,
        members whose ring parameters differ from this node's)."""
        self.registry.register(ClusterCollector(view))

    def watch_disk(self, stats: Callable[[], Any]) -> None:
        """Publish the disk tier's gauges and counters, read from ``stats()`` (``TierStats``) at
        each scrape; its read latency is observed by the reader threads (``disk_read``)."""
        self.disk_read = Histogram("emsd_disk_read_seconds",
                                   "Time of one disk tier read: a block, or a run of adjacent blocks",
                                   buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(DiskCollector(stats))

    def watch_prefault(self, progress: Callable[[], tuple[int, int]]) -> None:
        """Publish ``emsd_pool_prefault_bytes`` (done, total) of the background prefault, read
        from ``progress()`` at each scrape."""
        self.registry.register(PrefaultCollector(progress))

    def watch_peer_refusals(self, counts: Callable[[], dict[str, int]]) -> None:
        """Publish ``emsd_peer_connections_refused_total`` by reason, read from ``counts()`` at
        each scrape (``PeerServer.refusals``)."""
        self.registry.register(RefusalCollector(counts))

    def watch_handoff(self, handed: Callable[[], dict[str, float]]) -> None:
        """Publish ``emsd_handoff_blocks_total`` by result and ``emsd_handoff_passes_total``,
        read from ``handed()`` at each scrape (``Cluster.handed``, ``emsd.handoff``)."""
        self.registry.register(HandoffCollector(handed))

    def watch_direct_reads(self, served: Callable[[], int]) -> None:
        """Publish ``emsd_direct_read_requests_total``, the GETs this node served to SDK
        clients that showed a read pass (``PeerServer.reads``), read at each scrape."""
        self.registry.register(DirectReadCollector(served))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_BUCKET_LABELS = (*map(floatToGoString, LATENCY_BUCKETS), "+Inf")  # each histogram bucket's "le"


class RequestCounts(Collector):
    """The request path's counters, kept as plain ints and published at scrape time:
    ``emsd_ops_total``, ``emsd_op_duration_seconds``, ``emsd_lookup_keys_total``,
    ``emsd_op_bytes_total`` and ``emsd_reserve_failed_keys_total``.

    Adding to a dict costs a fraction of a ``prometheus_client`` update, which takes a
    lock per value (memcached keeps its stats so too). Updated from the event loop's
    thread only (``Service``); a scrape from another thread copies each dict first,
    in one step under the GIL.
    """

    def __init__(self) -> None:
        self.ops: dict[tuple[str, str], int] = {}  # (op, result) -> requests
        self.latency: dict[str, list[int]] = {}  # op -> count per LATENCY_BUCKETS bound, then +Inf
        self.latency_sum: dict[str, float] = {}  # op -> seconds in all
        self.keys: dict[tuple[str, str], int] = {}  # (op, "hit"/"miss") -> keys
        self.bytes: dict[str, int] = {}  # op -> bytes
        self.save_failed = 0  # keys a save could not place

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        ops = CounterMetricFamily("emsd_ops", "Requests handled, by op and result", labels=["op", "result"])
        for (op, result), n in sorted(self.ops.copy().items()):
            ops.add_metric([op, result], n)
        yield ops
        latency = HistogramMetricFamily("emsd_op_duration_seconds", "Server-side request time, by op",
                                        labels=["op"])
        sums = self.latency_sum.copy()
        for op, counts in sorted(self.latency.copy().items()):
            cumulative = itertools.accumulate(counts.copy())
            latency.add_metric([op], list(zip(_BUCKET_LABELS, cumulative, strict=True)), sums.get(op, 0.0))
        yield latency
        keys = CounterMetricFamily("emsd_lookup_keys", "Keys looked up, by op and result (hit/miss)",
                                   labels=["op", "result"])
        for (op, result), n in sorted(self.keys.copy().items()):
            keys.add_metric([op, result], n)
        yield keys
        nbytes = CounterMetricFamily("emsd_op_bytes", "Block bytes handed out, by op (reserve/put/pin)",
                                     labels=["op"])
        for op, n in sorted(self.bytes.copy().items()):
            nbytes.add_metric([op], n)
        yield nbytes
        yield CounterMetricFamily("emsd_reserve_failed_keys",
                                  "Keys a reserve could not place (pool full of pinned blocks)",
                                  value=self.save_failed)


class DiskCollector(Collector):
    """Disk tier gauges and counters computed at scrape time from ``DiskTier.stats()``."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._stats()
        size = GaugeMetricFamily("emsd_disk_bytes", "Disk tier bytes by state", labels=["state"])
        size.add_metric(["capacity"], st.capacity)
        size.add_metric(["used"], st.bytes_used)
        yield size
        yield GaugeMetricFamily("emsd_disk_blocks", "Blocks on the disk tier", value=st.blocks)
        yield GaugeMetricFamily("emsd_disk_queue_blocks", "Demotions waiting for a writer", value=st.queued)
        yield GaugeMetricFamily("emsd_disk_queue_bytes", "Bytes of demotions waiting for a writer",
                                value=st.queued_bytes)
        yield CounterMetricFamily("emsd_disk_writes", "Blocks written to the disk tier", value=st.writes)
        yield CounterMetricFamily("emsd_disk_reads", "Blocks read back from the disk tier (checked)",
                                  value=st.reads)
        yield CounterMetricFamily("emsd_disk_corrupt", "Blocks read from disk that failed their checksum",
                                  value=st.corrupt)
        yield CounterMetricFamily("emsd_disk_evictions", "Blocks removed from disk for room",
                                  value=st.evicted)
        dropped = CounterMetricFamily("emsd_disk_dropped_demotions",
                                      "Evicted blocks not written to disk, by reason", labels=["reason"])
        for reason, n in sorted(st.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped
        yield GaugeMetricFamily("emsd_disk_failed", "1 when the disk tier failed (DRAM only since)",
                                value=1 if st.failed else 0)
        yield GaugeMetricFamily("emsd_disk_direct_io", "1 when the data file moves with O_DIRECT",
                                value=1 if st.direct else 0)


class PoolCollector(Collector):
    """Pool gauges computed at scrape time from ``BlockStore.stats()``."""

    def __init__(self, stats: Callable[[], Any], ns_name: Callable[[int], str] = str,
                 namespace_labels: bool = False) -> None:
        """``namespace_labels``: publish ``emsd_pool_namespace_bytes`` with one series per
        namespace name (``metrics.namespace_labels``). Off by default: names are chosen by
        clients (a tenant's model names, as long as 4 KiB each), so they would tell every
        reader of /metrics other tenants' names and let clients grow the page without bound;
        ``emsd_pool_tenant_bytes`` (one series per configured tenant) is always there."""
        self._stats = stats
        self._ns_name = ns_name
        self._namespace_labels = namespace_labels

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
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
        yield GaugeMetricFamily("emsd_pool_granted_bytes",
                                "Bytes of chunks granted to clients for their next saves, not yet used",
                                value=st.granted)
        yield GaugeMetricFamily("emsd_pool_cached_blocks",
                                "Read-cache copies of blocks owned by other nodes", value=st.cached)
        ev = CounterMetricFamily("emsd_pool_evictions", "Blocks evicted since start, by reason",
                                 labels=["reason"])
        for reason, n in sorted(st.evictions.items()):
            ev.add_metric([reason], n)
        yield ev
        yield CounterMetricFamily("emsd_shared_index_unpublished",
                                  "Blocks the shared index had no free slot for (their loads ask the daemon)",
                                  value=st.unpublished)
        by_name: dict[str, int] = {}  # a dropped namespace's old id has the same name as its new one
        for ns_id, n in st.ns_bytes.items():
            name = self._ns_name(ns_id)
            by_name[name] = by_name.get(name, 0) + n
        by_tenant: dict[str, int] = {}
        for name, n in by_name.items():
            tenant = Tenants.tenant_of(name)
            by_tenant[tenant] = by_tenant.get(tenant, 0) + n
        tenants = GaugeMetricFamily("emsd_pool_tenant_bytes",
                                    'Committed bytes by tenant ("" the default tenant)', labels=["tenant"])
        for tenant, n in sorted(by_tenant.items()):
            tenants.add_metric([tenant], n)
        yield tenants
        if self._namespace_labels:
            ns = GaugeMetricFamily("emsd_pool_namespace_bytes", "Committed bytes by namespace",
                                   labels=["namespace"])
            for name, n in sorted(by_name.items()):
                ns.add_metric([name], n)
            yield ns
        cls = GaugeMetricFamily("emsd_pool_class_bytes", "Bytes of slab pages by size class and state",
                                labels=["chunk_size", "state"])
        for c in st.classes:
            cls.add_metric([str(c.chunk_size), "pages"], c.pages * _page_bytes(st, c))
            cls.add_metric([str(c.chunk_size), "used"], c.chunks_used * c.chunk_size)
            cls.add_metric([str(c.chunk_size), "free"], c.chunks_free * c.chunk_size)
        yield cls


class ClusterCollector(Collector):
    """Membership gauges computed at scrape time."""

    STATES = ("standalone", "connecting", "joined", "suspended", "lost")

    def __init__(self, view: Callable[[], tuple[str, int, int]]) -> None:
        self._view = view

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state, members, differs = self._view()
        yield GaugeMetricFamily("emsd_cluster_members", "Nodes in this node's view of the ring",
                                value=members)
        yield GaugeMetricFamily("emsd_cluster_placement_differs",
                                "1 when this node's vnodes/replicas config differs from the cluster's "
                                "placement record (the record is used), plus the members that place keys "
                                "otherwise than this node (no record followed: loads between them miss)",
                                value=differs)
        fam = GaugeMetricFamily("emsd_cluster_membership_state",
                                "ZooKeeper membership state (1 = current)", labels=["state"])
        for name in self.STATES:
            fam.add_metric([name], 1.0 if name == state else 0.0)
        yield fam


class PrefaultCollector(Collector):
    """The background prefault's progress, computed at scrape time."""

    def __init__(self, progress: Callable[[], tuple[int, int]]) -> None:
        self._progress = progress

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        done, total = self._progress()
        fam = GaugeMetricFamily("emsd_pool_prefault_bytes",
                                "Pool bytes faulted in by the background prefault, and in all",
                                labels=["state"])
        fam.add_metric(["done"], done)
        fam.add_metric(["total"], total)
        yield fam


class DirectReadCollector(Collector):
    """GETs served to SDK clients reading straight from this node (``ems.direct``)."""

    def __init__(self, served: Callable[[], int]) -> None:
        self._served = served

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("emsd_direct_read_requests", "GETs served to SDK clients of other "
                                  "nodes that read from this node's pool with a read pass",
                                  value=self._served())


class RefusalCollector(Collector):
    """Peer connections refused before authentication, by reason, computed at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("emsd_peer_connections_refused",
                                  "Peer connections refused: failed TLS or AUTH (auth), or closed at once "
                                  "with too many not yet authenticated (busy)", labels=["reason"])
        for reason, n in sorted(self._counts().items()):
            fam.add_metric([reason], n)
        yield fam


class HandoffCollector(Collector):
    """The handoff's counts (blocks moved to their new owners, kept; passes), at scrape time."""

    def __init__(self, handed: Callable[[], dict[str, float]]) -> None:
        self._handed = handed

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        h = self._handed()
        blocks = CounterMetricFamily("emsd_handoff_blocks", "Blocks handed to their new owners after "
                                     "ring changes (moved), or kept here because no owner took them "
                                     "(kept)", labels=["result"])
        blocks.add_metric(["moved"], h["moved"])
        blocks.add_metric(["kept"], h["kept"])
        yield blocks
        yield CounterMetricFamily("emsd_handoff_passes", "Handoff passes run after ring changes",
                                  value=h["passes"])


def _page_bytes(st: Any, c: Any) -> int:
    return int(getattr(c, "page_size", 0) or getattr(st, "page_size", 0) or 0)
