"""The daemon's lifecycle in one place: start, serve, shut down.

Start-up order matters for clients and probes:

1. bind the Unix socket and the HTTP endpoint at once, so a client that
   connects early gets ``RECOVERING`` (retry later) rather than "no such file",
   and ``/healthz`` answers 503;
2. create the pool region (or get it back from its keeper) in a worker
   thread while the loop keeps answering;
3. build the store and the service, flip to ready: HELLO now succeeds and
   ``/healthz`` answers 200;
4. with ``pool.prefault``, fault the pool's pages in behind it, on
   ``PREFAULT_THREADS`` threads (``emsd.pool.prefault``): a pool of any size
   serves within a second of start. Where the kernel lacks
   ``MADV_POPULATE_WRITE`` the pool is prefaulted in step 2 instead.

SIGTERM or SIGINT: stop accepting, close every client connection (their
reservations are aborted and pins dropped; every request already received
has been answered, since requests are handled synchronously), close the
HTTP endpoint, unmap the region, remove the socket file, exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from emsd import __version__
from emsd.config import Config, ConfigError
from emsd.files import UnsafePath, check_dir
from emsd.http import HttpEndpoint
from emsd.membership.base import MembershipState
from emsd.metrics import Metrics
from emsd.pool import prefault, shared_index
from emsd.pool.admission import AdmissionRule
from emsd.pool.checksum import Checksums
from emsd.pool.ledger import Geometry, Ledger, LedgerBusy
from emsd.pool.region import Region
from emsd.pool.shared_index import SharedIndex
from emsd.pool.slab import SlabError
from emsd.pool.store import BlockStore
from emsd.pool.tenancy import TenantMemory, stop_tenant_keeper
from emsd.service import RETIRED, Service
from emsd.solo import Solo
from emsd.tenants import DEFAULT as DEFAULT_TENANT
from emsd.tenants import Tenants
from emsd.tenants import load as load_tenants
from emsd.tier.disk import DiskTier, TierStats
from emsd.tier.stack import TierStack
from emsd.transport.unix import UnixControlServer

if TYPE_CHECKING:
    from emsd.cluster import Cluster
    from emsd.handoff import Handoff

_SERVING = (MembershipState.STANDALONE, MembershipState.JOINED)  # ready to serve in these states

log = logging.getLogger("emsd")
PREFAULT_THREADS = 4  # enough to reach the memory bandwidth of page zeroing on most hosts


class StartupError(Exception):
    """The daemon cannot start; the message is the one line to print."""


class Daemon:
    """One emsd process: pool, index, control socket and metrics endpoint."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.region: Region | None = None
        self.memory: TenantMemory | None = None  # with tenants: each tenant's own memfd
        self.shared: SharedIndex | None = None  # READY blocks for clients to find (pool.shared_index)
        self.service: Service | None = None
        self.control = UnixControlServer(
            config.socket_path,
            config.node.socket_mode,
            pool_fd=self._pool_fd,
            service=lambda: self.service,
            allowed=(config.node.allowed_uids, config.node.allowed_gids),
            on_count=self.metrics.clients.set,
            lease=config.node.client_lease,
            on_expired=self.metrics.clients_expired.inc,
            busy_poll=config.node.busy_poll / 1e6,
        )
        self.http = HttpEndpoint(self.metrics, readiness=self.readiness)
        self.cluster: Cluster | Solo | None = None  # the service's, once the pool is attached
        self._pool_view: memoryview | None = None
        self.ledger: Ledger | None = None
        self.prefaulter: prefault.Prefaulter | None = None  # pool.prefault, in the background
        self.restart_outcome = "off"
        self.restored = 0
        self.disk: DiskTier | None = None
        self.disk_error = ""  # why the configured disk tier is not running ("" when it is)
        self.handoff: Handoff | None = None  # in a cluster (``emsd.handoff``)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT; raises ``StartupError`` if start-up fails."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            await self._start()
            await self._stop.wait()
            log.info("shutting down")
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        cfg = self.config
        try:
            self.control.bind()
        except (OSError, UnsafePath) as exc:
            raise StartupError(f"node.socket_dir: cannot serve {cfg.socket_path}: {exc}") from None
        self.control.start()
        address = cfg.metrics.address()
        if address is not None:
            try:
                await self.http.start(*address)
            except OSError as exc:
                raise StartupError(f"metrics.listen: cannot listen on {cfg.metrics.listen}: "
                                   f"{exc.strerror}") from None
        log.info("emsd %s starting: socket %s, metrics %s", cfg.node.id, cfg.socket_path,
                 cfg.metrics.listen or "off")
        loop = asyncio.get_running_loop()
        region = await loop.run_in_executor(None, self._make_region)
        self.region = region
        tenants = self._tenants()
        store, names = await loop.run_in_executor(None, self._attach, region, tenants)
        self._pool_view = memoryview(region.mm)
        service = Service(store, cfg.node.id, region.kind, self.metrics, tenants)
        if self.memory is not None:
            service.tenant_group = self.memory.open
            service.sparse = True
        if cfg.pool.checksum:
            service.checksums = Checksums(store, self._pool_view)
        service.grants = cfg.pool.grants
        service.max_namespaces = cfg.tenants.max_namespaces
        if cfg.pool.connection_uncommitted:
            service.connection_uncommitted = cfg.pool.connection_uncommitted
        service.restore_namespaces(names)
        self.metrics.watch_pool(store.stats, service.namespace_name, cfg.metrics.namespace_labels)
        if cfg.disk.enabled:
            service.tiers = await loop.run_in_executor(None, self._open_disk, store, service)
        self.metrics.restart.labels(self.restart_outcome.split(":")[0]).set(1)
        self.metrics.restored.set(self.restored)
        service.info.update(version=__version__, pid=os.getpid(), metrics=cfg.metrics.listen,
                            restart=self.restart_outcome, restored=self.restored,
                            socket=str(cfg.socket_path))
        if cfg.cluster.enabled:
            service.cluster = await self._join(region, service)
            self.metrics.watch_peer_refusals(service.cluster.server.refusals)
            peers = service.cluster.server
            self.metrics.watch_direct_reads(lambda: peers.reads)
            if cfg.cluster.handoff:
                self.handoff = self._handoff(service)
        self.cluster = cluster = service.cluster
        self.metrics.watch_cluster(self._membership)
        self.metrics.watch_handoff(lambda: cluster.handed)  # zeros standalone or with it off
        self.metrics.build.labels(__version__, self.cluster.transport_name).set(1)
        self.service = service
        if cfg.pool.prefault and prefault.supported(region.mm):
            self.prefaulter = prefault.Prefaulter(region.address(), region.size, PREFAULT_THREADS).start()
            service.prefault = self._prefault_progress
            self.metrics.watch_prefault(lambda: (self._prefault_progress()["done"], region.size))
        self.metrics.ready.set(1)
        c = self.cluster
        membership = c.state.value if not cfg.cluster.enabled else (
            f"cluster {cfg.cluster.name}, {c.state.value}, {len(c.placement.members)} members")
        log.info("ready: emsd %s node %s; pool %d MiB %s (%s), slab page %d MiB; warm restart %s, "
                 "%d blocks; %s; transport %s; socket %s; metrics %s; pid %d",
                 __version__, cfg.node.id, region.size >> 20, region.kind, region.reason,
                 min(cfg.pool.page_size, region.size) >> 20, self.restart_outcome, self.restored,
                 membership, c.transport_summary(), cfg.socket_path,
                 cfg.metrics.listen or "off", os.getpid())

    def _handoff(self, service: Service) -> Handoff:
        """Hand the blocks the ring gives to others to their owners, now (a warm restart may
        hold some) and after every ring change (``emsd.handoff``)."""
        from emsd.handoff import Handoff
        from emsd.remote import Remote

        cluster = service.cluster
        assert not isinstance(cluster, Solo)
        handoff = Handoff(Remote(service))
        cluster.on_ring = handoff.changed
        handoff.changed()
        return handoff

    async def _join(self, region: Region, service: Service) -> Cluster:
        """Serve peers and join the cluster; raises ``StartupError`` for a bad secret or a taken id.
        The peer transports keep blocks through ``service`` (their ``BlockOwner``); a peer's GET
        promotes from the disk tier as a local PIN does (``Remote.before``)."""
        from emsd.cluster import Cluster
        from emsd.config import ConfigError, read_secret
        from emsd.membership.base import DuplicateNodeError
        from emsd.remote import Remote
        from emsd.transport.tls import PeerTls

        cfg = self.config
        try:
            secret = read_secret(cfg.cluster.secret_file)
            tls = (PeerTls.load(cfg.cluster.tls_cert, cfg.cluster.tls_key, cfg.cluster.tls_ca)
                   if cfg.cluster.tls else None)
        except (ConfigError, ValueError) as exc:
            raise StartupError(str(exc)) from None
        assert self._pool_view is not None
        rdma, why = await asyncio.get_running_loop().run_in_executor(None, self._open_rdma, self._pool_view)
        promote = None if service.tiers is None else Remote(service).before
        cluster = Cluster(cfg.cluster, cfg.node.id, region.size, service, self._pool_view, secret,
                          metrics=self.metrics, rdma=rdma, rdma_reason=why, tls=tls, busy=self.control.busy,
                          promote=promote)
        try:
            await cluster.start()
        except DuplicateNodeError as exc:
            await cluster.stop()
            raise StartupError(f"node.id: {exc}") from None
        except OSError as exc:
            await cluster.stop()
            raise StartupError(f"cluster.peer_listen: cannot listen on {cfg.cluster.peer_listen}: "
                               f"{exc.strerror}") from None
        log.info("cluster %s: peers on %s (advertised %s, %s), ZooKeeper %s, membership %s",
                 cfg.cluster.name, cfg.cluster.peer_listen, cfg.cluster.advertised,
                 "mutual TLS" if tls else "plain TCP", cfg.cluster.zookeeper, cluster.state.value)
        return cluster

    def _open_rdma(self, pool: memoryview) -> tuple[Any, str]:
        """(RdmaEndpoint or None, why not) per ``cluster.transport``; raises ``StartupError`` for
        "rdma" without a usable device."""
        mode = self.config.cluster.transport
        if mode == "tcp":
            return None, 'cluster.transport is "tcp"'
        if self.memory is not None:
            why = ("tenants are configured: pages move between the tenants' memfds, which a "
                   "registered RDMA memory region cannot follow")
            if mode == "rdma":
                raise StartupError(f'cluster.transport: "rdma" with {why} (use "auto" or "tcp")')
            log.info("transport: TCP only (%s)", why)
            return None, why
        from emsd.transport.rdma import open_endpoint

        c = self.config.cluster
        endpoint, why = open_endpoint(pool, device=c.rdma_device, port=c.rdma_port,
                                      gid_index=c.rdma_gid_index)
        if endpoint is None:
            if mode == "rdma":
                raise StartupError(f'cluster.transport: "rdma" needs an RDMA device, but: {why} '
                                   '(use "auto" to fall back to TCP)')
            log.info("transport: TCP only (%s)", why)
        else:
            info = endpoint.descriptor.port
            log.info("transport: RDMA on %s port %d (gid %s, index %s), %d MiB registered in %d regions",
                     info.device, info.port, info.gid, getattr(endpoint.engine, "gid_index", "?"),
                     endpoint.size >> 20, len(endpoint.local))
        return endpoint, why

    def _state_dir(self) -> Path:
        return self.config.pool.state_dir or self.config.node.socket_dir

    def _make_region(self) -> Region:
        from emsd.pool.region import RegionError

        cfg = self.config.pool
        persist = self._state_dir() if cfg.warm_restart else None
        try:
            if persist is not None:
                persist.mkdir(parents=True, exist_ok=True)
                check_dir(persist)
            region = Region.create(cfg.size, cfg.hugepages, name=f"emsd-{self.config.node.id}",
                                   persist_dir=persist)
        except RegionError as exc:
            raise StartupError(str(exc)) from None
        except UnsafePath as exc:
            raise StartupError(f"pool.state_dir: {exc}") from None
        except OSError as exc:
            raise StartupError(f"pool.state_dir: cannot use {persist}: {exc.strerror or exc}") from None
        if cfg.prefault and not prefault.supported(region.mm):  # no background way: before serving
            started = time.monotonic()
            method = region.prefault()
            log.info("prefaulted %d MiB with %s in %.1f s, before serving", region.size >> 20, method,
                     time.monotonic() - started)
        return region

    def _store(self, size: int, page: int) -> BlockStore:
        """An empty store with the configured eviction policy, admission rule and checksums,
        its pages bound to tenants' memory (``self.memory``) as they change hands."""
        cfg = self.config.pool
        store = BlockStore(size, page, eviction=cfg.eviction,
                           admission=AdmissionRule(cfg.admit_after, cfg.admit_after_namespaces))
        if self.memory is not None:
            store.slabs.on_bind = self.memory.bind
        store.copy_floor = int(size * cfg.read_cache_share)
        if cfg.checksum:
            store.enable_checksums()  # before a warm restart's attach: it restores the digests
        store.shared = self._shared_index(size)
        return store

    def _shared_index(self, size: int) -> SharedIndex | None:
        """A new, empty shared index for a new store (the last one's is closed), or None where
        none is offered: ``pool.shared_index`` off, tenants (a client would see other tenants'
        keys), ``pool.checksum`` (the daemon checks digests on a load), or no C extension."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        cfg = self.config.pool
        if cfg.shared_index and not cfg.checksum and self.memory is None and shared_index.available():
            self.shared = SharedIndex(shared_index.slots_for(size))
        return self.shared

    def _attach(self, region: Region, tenants: Tenants) -> tuple[BlockStore, dict[int, str]]:
        """The store over ``region``: with warm restart, re-indexing what the ledger holds.

        With tenants, each tenant's memfd is made (or taken back from its
        keeper) first (``emsd.pool.tenancy``). Logs the outcome in one line.
        A ledger that does not match the pool, or whose rows do not describe
        a consistent pool, is cleared: the node starts empty rather than
        serve bytes it cannot vouch for.
        """
        page = min(self.config.pool.page_size, region.size)
        if tenants.enabled:
            self.memory = self._tenant_memory(region, page, tenants)
        store, names = self._restore(region, self._store(region.size, page), page)
        if self.memory is not None:
            # free pages of a kept pool may hold blocks that did not come back; a new one holds none
            free = (store.slabs.page_owner < 0) & region.reused
            self.memory.restore(store.slabs.page_group, free)
        return store, names

    def _tenant_memory(self, region: Region, page: int, tenants: Tenants) -> TenantMemory:
        from emsd.pool.region import RegionError

        persist = self._state_dir() if region.keeper is not None else None
        try:
            memory = TenantMemory(region, page, f"emsd-{self.config.node.id}", persist)
            for tenant in sorted(tenants.by_id):
                memory.open(tenant)
        except RegionError as exc:
            raise StartupError(str(exc)) from None
        log.info("tenant memory: a memfd per tenant (%d), clients map their own; pages of %d KiB "
                 "change hands", len(tenants.by_id), page >> 10)
        return memory

    def _restore(self, region: Region, store: BlockStore, page: int) -> tuple[BlockStore, dict[int, str]]:
        if region.keeper is None:
            if self.config.pool.warm_restart:
                log.info("warm restart: off for this pool (%s)", region.reason)
            return store, {}
        st = os.fstat(region.fd)
        geometry = Geometry(region.size, store.page_size, store.slabs.align, st.st_dev, st.st_ino)
        path = self._state_dir() / f"emsd-{self.config.node.id}.ledger"
        try:
            ledger, outcome = Ledger.open(path, geometry)
        except (LedgerBusy, UnsafePath) as exc:
            raise StartupError(f"pool.state_dir: {exc}") from None
        except OSError as exc:
            raise StartupError(f"pool.state_dir: cannot open {path}: {exc.strerror or exc}") from None
        if outcome == "attached" and not region.reused:
            outcome = "rebuilt: the pool was new"
        names = ledger.names() if outcome == "attached" else {}
        try:
            restored = store.attach(ledger, self._restorable(store, names)) if names else 0
        except SlabError as exc:
            outcome, restored, names = f"rebuilt: inconsistent ledger ({exc})", 0, {}
            store = self._store(region.size, page)
        if not names:
            ledger.clear()
            store.ledger = ledger
        self.ledger = ledger
        self.restart_outcome, self.restored = outcome, restored
        log.info("warm restart: %s; %d blocks restored (%s, ledger %s)", outcome, restored,
                 region.keeper, path)
        return store, names

    def _restorable(self, store: BlockStore, names: dict[int, str]) -> set[int]:
        """The namespaces of ``names`` whose blocks can come back, their slab groups set: the
        default tenant's, and those of tenants whose memfd came back from its keeper. The
        others are renamed ``RETIRED`` in ``names`` (their ids unreachable, as if dropped), and
        the keepers of tenants no longer configured let their memory go."""
        keep: set[int] = set()
        lost: set[str] = set()
        memory = self.memory
        for ns, name in names.items():
            tenant = Tenants.tenant_of(name)
            if tenant == DEFAULT_TENANT:
                if memory is None or name != RETIRED:  # a dropped id's blocks: nowhere to map them
                    keep.add(ns)
            elif memory is not None and memory.reused.get(tenant):
                store.set_group(ns, memory.group(tenant))
                keep.add(ns)
            else:
                lost.add(tenant)
                names[ns] = RETIRED
        for tenant in lost:
            if memory is None or tenant not in memory.reused:
                stop_tenant_keeper(self._state_dir(), f"emsd-{self.config.node.id}", tenant)
        if lost:
            log.warning("warm restart: the blocks of %d tenants are not restored (not configured, "
                        "or their memory did not come back)", len(lost))
        return keep

    def _open_disk(self, store: BlockStore, service: Service) -> TierStack | None:
        """The disk tier of ``[disk]`` under ``store``, or None (logged, said on /readyz and in
        metrics) when it cannot be opened: the daemon then serves from DRAM only."""
        cfg = self.config.disk
        assert cfg.dir is not None and self._pool_view is not None
        self.metrics.watch_disk(self._disk_stats)
        self.http.degraded = self._disk_degraded
        try:
            self.disk = DiskTier(cfg.dir, cfg.size, cfg.queue, cfg.readers, cfg.writers, cfg.extent,
                                 quota=lambda name: service.tenants.quota(Tenants.tenant_of(name)),
                                 tenant=Tenants.tenant_of, on_read=self.metrics.disk_read.observe)
        except (OSError, ValueError, UnsafePath) as exc:
            self.disk_error = f"cannot open {cfg.dir}: {exc}"
            log.error("disk tier off: %s; serving from DRAM only", self.disk_error)
            service.info.update(disk={"dir": str(cfg.dir), "failed": self.disk_error})
            return None
        log.info("disk tier: %d MiB in %s, index %s, %d blocks; %s", self.disk.space.size >> 20, cfg.dir,
                 self.disk.outcome, self.disk.restored,
                 "O_DIRECT" if self.disk.data.direct else self.disk.data.reason)
        return TierStack(store, self.disk, self._pool_view, service.namespace_name, service.checksums,
                         service)

    def _disk_stats(self) -> TierStats:
        if self.disk is None:
            return TierStats(0, 0, 0, 0, 0, 0, 0, {}, 0, 0, False, self.disk_error)
        self.disk.check()
        return self.disk.stats()

    def _disk_degraded(self) -> str | None:
        if self.disk is not None:
            self.disk_error = self.disk.check()
        return f"disk tier off: {self.disk_error}" if self.disk_error else None

    def _tenants(self) -> Tenants:
        """The configured tenants (none: one default tenant); raises ``StartupError`` for a bad file."""
        cfg = self.config.tenants
        if cfg.file is None:
            return Tenants([])
        try:
            tenants = load_tenants(cfg.file, cfg.allow_default)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        log.info("tenants: %d from %s%s", len(tenants.by_id), cfg.file,
                 ", and the default tenant" if cfg.allow_default else "")
        return tenants

    def _pool_fd(self, tenant: str) -> int | None:
        """The memfd a client of ``tenant`` maps, once the daemon serves (else None)."""
        if self.region is None or self.service is None:
            return None
        return self.region.fd if self.memory is None else self.memory.fd(tenant)

    def readiness(self) -> str | None:
        """None when ready to serve (pool attached; standalone, or joined to the cluster), else why not."""
        if self.service is None:
            return "the pool is not attached yet"
        c = self.cluster
        if c is not None and c.state not in _SERVING and not c.placement.draining:
            return f"cluster membership is {c.state.value}"
        return None

    def _membership(self) -> tuple[str, int, int]:
        c = self.cluster
        assert c is not None  # watched from the moment the pool is attached
        p = c.placement
        return c.state.value, len(p.members), len(p.disagree) + int(p.config_differs)

    def stop(self) -> None:
        self._stop.set()

    def _prefault_progress(self) -> dict[str, Any]:
        assert self.prefaulter is not None
        return dataclasses.asdict(self.prefaulter.progress())

    async def _shutdown(self) -> None:
        if self.prefaulter is not None:  # before the pool is unmapped under it
            await asyncio.get_running_loop().run_in_executor(None, self.prefaulter.stop)
        await self.control.close()
        if self.handoff is not None:
            await self.handoff.close()
        if self.cluster is not None:
            await self.cluster.stop()  # leave the ring first: peers stop sending here
        await self.http.close()
        self.service = None
        if self.disk is not None:  # its last demotions written and its index flushed, then the pool goes
            await asyncio.get_running_loop().run_in_executor(None, self.disk.close)
            self.disk = None
        if self._pool_view is not None:
            self._pool_view.release()
            self._pool_view = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.region is not None:
            try:
                self.region.close()
            except BufferError:  # a transfer still holds a view: the process exit unmaps it
                log.warning("the pool was still in use by a transfer at exit; left to the OS to unmap")
            self.region = None
        log.info("stopped")
