"""The daemon's configuration: one frozen dataclass per TOML table, checked on load.

``load_config(path)`` reads a TOML file and returns a ``Config`` or raises
``ConfigError`` whose message is one line naming the key and the rule
(``pool.size: must be a size like "4GiB" (got "lots")``). Unknown keys are
errors too, so a typo never silently falls back to a default. Every key, its
default and its rule are listed in docs/configuration.md; keep the two in
step.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_NODE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_LOG_LEVELS = ("debug", "info", "warning", "error")
MIN_POOL = 1 << 20
MIN_PAGE = 64 << 10


class ConfigError(ValueError):
    """A config value that breaks its rule; ``str()`` is the one line to print."""

    def __init__(self, key: str, rule: str) -> None:
        super().__init__(f"{key}: {rule}")
        self.key = key


@dataclass(frozen=True)
class NodeConfig:
    id: str = field(default_factory=socket.gethostname)
    socket_dir: Path = Path("/dev/shm/ems")
    socket_mode: int = 0o660  # who may connect (and so map the pool): owner and group
    allowed_uids: tuple[int, ...] = ()  # with allowed_gids: peers (SO_PEERCRED) let in; () both: anyone
    allowed_gids: tuple[int, ...] = ()
    client_lease: float = 30.0  # seconds a connection may stay silent (no request in flight); 0: forever
    busy_poll: int = 200  # microseconds the loop polls answered clients before sleeping; 0: off


@dataclass(frozen=True)
class PoolConfig:
    size: int = 1 << 30
    hugepages: str = "auto"
    page_size: int = 64 << 20
    prefault: bool = True
    warm_restart: bool = True  # pool and ledger in files that outlive the process
    state_dir: Path | None = None  # where those files live; None: node.socket_dir
    checksum: bool = False  # xxh3 digest per block, checked on every read (emsd.pool.checksum)
    eviction: str = "prefix"  # "lru" or "prefix" (emsd/pool/eviction.py)
    admit_after: int = 1  # store a block from its N-th save on; 1: admission off
    admit_after_namespaces: tuple[tuple[str, int], ...] = ()  # (namespace glob, N), first match wins
    grants: bool = True  # hand clients chunks for their next saves: one round trip a save (emsd.service)
    shared_index: bool = True  # clients find READY blocks themselves (emsd.pool.shared_index)
    connection_uncommitted: int = 0  # bytes a connection may hold reserved + granted; 0: half of size
    read_cache_share: float = 1 / 16  # of the pool, fetched copies may take from owned blocks (store)


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = "127.0.0.1:9400"  # "" disables the HTTP endpoint
    namespace_labels: bool = False  # emsd_pool_namespace_bytes by namespace name (names are clients')

    def address(self) -> tuple[str, int] | None:
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "text"  # "text" or "json" (one object per line)


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``; with ``zookeeper`` empty the node runs standalone."""

    name: str = "default"
    zookeeper: str = ""  # "host:port,host:port"; "" = standalone
    peer_listen: str = "127.0.0.1:11000"
    advertise: str = ""  # the address peers dial; "" = peer_listen
    session_timeout: float = 10.0
    replicas: int = 1
    vnodes: int = 512  # every node of a cluster must use the same value
    peer_connections: int = 2
    peer_socket_buffer: int = 256 << 10  # kernel buffer a direction of a peer connection; 0 = autotuning
    handoff: bool = True  # after a ring change, push the owned blocks others now own to them (emsd.handoff)
    direct_reads: bool = True  # clients may GET their tenant's blocks from the owners themselves (ems.direct)
    secret_file: str = ""  # file holding the cluster secret; required with zookeeper
    transport: str = "auto"  # peer data path: "auto" (RDMA where both ends can), "rdma" or "tcp"
    rdma_device: str = ""  # RDMA device name ("mlx5_0"); "" = the first one found
    rdma_port: int = 1
    rdma_gid_index: int | None = None  # the port's GID table entry; None ("auto") = verbs.choose_gid_index
    tls_cert: str = ""  # PEM certificate for peer connections; the three tls_* set together or not at all
    tls_key: str = ""  # its private key (PEM)
    tls_ca: str = ""  # the cluster CA (PEM): peers must present a certificate it signed

    @property
    def tls(self) -> bool:
        """Peer connections use mutual TLS."""
        return bool(self.tls_cert)

    @property
    def enabled(self) -> bool:
        return bool(self.zookeeper)

    @property
    def advertised(self) -> str:
        return self.advertise or self.peer_listen


@dataclass(frozen=True)
class TenantsConfig:
    file: Path | None = None  # None: one default tenant for everyone
    allow_default: bool = False  # with a file: also serve clients that give no access_id
    max_namespaces: int = 1024  # namespaces a tenant may have in use at once on a node


@dataclass(frozen=True)
class DiskConfig:
    """``[disk]``: the disk tier below DRAM (emsd/tier/); off while ``dir`` is empty."""

    dir: Path | None = None  # a directory on a local file system (not tmpfs: it is DRAM)
    size: int = 0  # bytes of data file
    queue: int = 256 << 20  # bytes of demotions waiting for the writers; more are dropped
    readers: int = 8  # reads in flight (promotions)
    writers: int = 2  # writes in flight (demotions)
    extent: int = 64 << 20  # the data file's unit of allocation to a block size

    @property
    def enabled(self) -> bool:
        return self.dir is not None


@dataclass(frozen=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)

    @property
    def socket_path(self) -> Path:
        from emsd.transport.frames import SOCKET_NAME

        return self.node.socket_dir / SOCKET_NAME


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string like "512MiB"; raises ``ConfigError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(key, f"must not be negative (got {value})")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * _UNITS[m.group(2)]
    raise ConfigError(key, f'must be a size in bytes or like "4GiB" (KiB/MiB/GiB/TiB) (got {value!r})')


def load_config(path: str | Path) -> Config:
    """Read and check a TOML config file; raises ``ConfigError`` with one clear line."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("--config", f"file {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {str(p)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{str(p)!r} is not valid TOML: {exc}") from None
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and check a ``Config`` from parsed TOML."""
    _only(raw, "", {"node", "pool", "metrics", "log", "cluster", "tenants", "disk"})
    node = _node(_table(raw, "node"))
    pool = _pool(_table(raw, "pool"))
    metrics = _metrics(_table(raw, "metrics"))
    log = _log(_table(raw, "log"))
    cluster = _cluster(_table(raw, "cluster"))
    tenants = _tenants(_table(raw, "tenants"))
    disk = _disk(_table(raw, "disk"))
    return Config(node=node, pool=pool, metrics=metrics, log=log, cluster=cluster, tenants=tenants,
                  disk=disk)


def _disk(t: dict[str, Any]) -> DiskConfig:
    _only(t, "disk", {"dir", "size", "queue", "readers", "writers", "extent"})
    d = DiskConfig()
    where = t.get("dir", "")
    if not isinstance(where, str) or (where and not where.startswith("/")):
        raise ConfigError("disk.dir", f"must be an absolute path or empty (got {where!r})")
    extent = parse_size("disk.extent", t.get("extent", d.extent))
    if extent < MIN_PAGE or extent & (extent - 1):
        raise ConfigError("disk.extent", f"must be a power of two >= 64KiB (got {extent} bytes)")
    size = parse_size("disk.size", t.get("size", d.size))
    if where and size < extent:
        raise ConfigError("disk.size", f"must hold at least one extent of {extent} bytes (got {size} bytes)")
    queue = parse_size("disk.queue", t.get("queue", d.queue))
    if queue < MIN_PAGE:
        raise ConfigError("disk.queue", f"must be at least 64KiB (got {queue} bytes)")
    threads = []
    for name in ("readers", "writers"):
        n = t.get(name, getattr(d, name))
        if type(n) is not int or not 1 <= n <= 64:
            raise ConfigError(f"disk.{name}", f"must be an integer in 1..64 (got {n!r})")
        threads.append(n)
    return DiskConfig(dir=Path(where) if where else None, size=size, queue=queue,
                      readers=threads[0], writers=threads[1], extent=extent)


def _tenants(t: dict[str, Any]) -> TenantsConfig:
    _only(t, "tenants", {"file", "allow_default", "max_namespaces"})
    file = t.get("file", "")
    if not isinstance(file, str) or (file and not file.startswith("/")):
        raise ConfigError("tenants.file", f"must be an absolute path or empty (got {file!r})")
    allow = t.get("allow_default", False)
    if not isinstance(allow, bool):
        raise ConfigError("tenants.allow_default", f"must be true or false (got {allow!r})")
    most = t.get("max_namespaces", TenantsConfig.max_namespaces)
    if type(most) is not int or not 1 <= most <= 65536:
        raise ConfigError("tenants.max_namespaces", f"must be an integer in 1..65536 (got {most!r})")
    return TenantsConfig(file=Path(file) if file else None, allow_default=allow, max_namespaces=most)


def _ids(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 2**32 for v in value):
        raise ConfigError(key, f"must be a list of numeric ids (got {value!r})")
    return tuple(value)


def _table(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(name, "must be a table ([" + name + "])")
    return value


def _only(table: dict[str, Any], prefix: str, allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _node(t: dict[str, Any]) -> NodeConfig:
    _only(t, "node", {"id", "socket_dir", "socket_mode", "allowed_uids", "allowed_gids", "client_lease",
                      "busy_poll"})
    d = NodeConfig()
    node_id = t.get("id", d.id)
    if not isinstance(node_id, str) or not _NODE_ID.match(node_id):
        raise ConfigError("node.id", f"must be 1-64 characters of [A-Za-z0-9._-] (got {node_id!r})")
    sock_dir = t.get("socket_dir", str(d.socket_dir))
    if not isinstance(sock_dir, str) or not sock_dir.startswith("/"):
        raise ConfigError("node.socket_dir", f"must be an absolute path (got {sock_dir!r})")
    if len(sock_dir) > 90:
        raise ConfigError("node.socket_dir", "must be at most 90 characters (Unix socket path limit)")
    mode = t.get("socket_mode", f"{d.socket_mode:04o}")
    if not isinstance(mode, str) or not re.fullmatch(r"0?[0-7]{3}", mode):
        raise ConfigError("node.socket_mode", f'must be an octal mode string like "0660" (got {mode!r})')
    lease = t.get("client_lease", d.client_lease)
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not (
            lease == 0 or 1 <= lease <= 86400):
        raise ConfigError("node.client_lease", f"must be seconds in 1..86400, or 0 for none (got {lease!r})")
    busy = t.get("busy_poll", d.busy_poll)
    if type(busy) is not int or not 0 <= busy <= 10_000:
        raise ConfigError("node.busy_poll", f"must be microseconds in 0..10000 (got {busy!r})")
    return NodeConfig(id=node_id, socket_dir=Path(sock_dir), socket_mode=int(mode, 8),
                      allowed_uids=_ids("node.allowed_uids", t.get("allowed_uids", [])),
                      allowed_gids=_ids("node.allowed_gids", t.get("allowed_gids", [])),
                      client_lease=float(lease), busy_poll=busy)


def _pool(t: dict[str, Any]) -> PoolConfig:
    _only(t, "pool", {"size", "hugepages", "page_size", "prefault", "warm_restart", "state_dir",
                      "checksum", "eviction", "admit_after", "admit_after_namespaces", "grants",
                      "connection_uncommitted", "read_cache_share", "shared_index"})
    d = PoolConfig()
    size = parse_size("pool.size", t.get("size", d.size))
    if size < MIN_POOL:
        raise ConfigError("pool.size", f"must be at least 1MiB (got {size} bytes)")
    huge = t.get("hugepages", d.hugepages)
    if huge not in ("auto", "on", "off"):
        raise ConfigError("pool.hugepages", f'must be "auto", "on" or "off" (got {huge!r})')
    page = parse_size("pool.page_size", t.get("page_size", d.page_size))
    if page < MIN_PAGE or page & (page - 1):
        raise ConfigError("pool.page_size", f"must be a power of two >= 64KiB (got {page} bytes)")
    prefault = t.get("prefault", d.prefault)
    if not isinstance(prefault, bool):
        raise ConfigError("pool.prefault", f"must be true or false (got {prefault!r})")
    warm = t.get("warm_restart", d.warm_restart)
    if not isinstance(warm, bool):
        raise ConfigError("pool.warm_restart", f"must be true or false (got {warm!r})")
    state = t.get("state_dir", "")
    if not isinstance(state, str) or (state and not state.startswith("/")):
        raise ConfigError("pool.state_dir", f"must be an absolute path or empty (got {state!r})")
    checksum = t.get("checksum", d.checksum)
    if not isinstance(checksum, bool):
        raise ConfigError("pool.checksum", f"must be true or false (got {checksum!r})")
    eviction = t.get("eviction", d.eviction)
    if eviction not in ("lru", "prefix"):
        raise ConfigError("pool.eviction", f'must be "lru" or "prefix" (got {eviction!r})')
    admit = _admit_count("pool.admit_after", t.get("admit_after", d.admit_after))
    grants = t.get("grants", d.grants)
    if not isinstance(grants, bool):
        raise ConfigError("pool.grants", f"must be true or false (got {grants!r})")
    shared = t.get("shared_index", d.shared_index)
    if not isinstance(shared, bool):
        raise ConfigError("pool.shared_index", f"must be true or false (got {shared!r})")
    uncommitted = parse_size("pool.connection_uncommitted",
                             t.get("connection_uncommitted", d.connection_uncommitted))
    share = t.get("read_cache_share", d.read_cache_share)
    if type(share) not in (int, float) or not 0 <= share <= 0.5:
        raise ConfigError("pool.read_cache_share", f"must be a number from 0 to 0.5 (got {share!r})")
    per_ns = t.get("admit_after_namespaces", {})
    if not isinstance(per_ns, dict):
        raise ConfigError("pool.admit_after_namespaces",
                          f"must be a table of namespace glob = count (got {per_ns!r})")
    patterns = tuple((str(k), _admit_count(f"pool.admit_after_namespaces.{k}", v))
                     for k, v in per_ns.items())
    return PoolConfig(size=size, hugepages=huge, page_size=min(page, size), prefault=prefault,
                      warm_restart=warm, state_dir=Path(state) if state else None,
                      eviction=eviction, admit_after=admit, admit_after_namespaces=patterns,
                      checksum=checksum, grants=grants, shared_index=shared,
                      connection_uncommitted=uncommitted, read_cache_share=float(share))


def _admit_count(key: str, value: Any) -> int:
    if type(value) is not int or not 1 <= value <= 255:
        raise ConfigError(key, f"must be an integer in 1..255 (got {value!r})")
    return value


def _metrics(t: dict[str, Any]) -> MetricsConfig:
    _only(t, "metrics", {"listen", "namespace_labels"})
    listen = t.get("listen", MetricsConfig().listen)
    if not isinstance(listen, str) or (listen and not _is_endpoint(listen)):
        raise ConfigError("metrics.listen", f'must be "host:port" or "" (got {listen!r})')
    labels = t.get("namespace_labels", False)
    if not isinstance(labels, bool):
        raise ConfigError("metrics.namespace_labels", f"must be true or false (got {labels!r})")
    return MetricsConfig(listen=listen, namespace_labels=labels)


def _is_endpoint(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)


def _cluster(t: dict[str, Any]) -> ClusterConfig:
    d = ClusterConfig()
    _only(t, "cluster", set(d.__dataclass_fields__))
    name = t.get("name", d.name)
    if not isinstance(name, str) or not _NODE_ID.match(name):
        raise ConfigError("cluster.name", f"must be 1-64 characters of [A-Za-z0-9._-] (got {name!r})")
    zk = t.get("zookeeper", d.zookeeper)
    if not isinstance(zk, str) or (zk and not all(_is_endpoint(h.strip()) for h in zk.split(","))):
        raise ConfigError("cluster.zookeeper", f'must be "" or "host:port[,host:port...]" (got {zk!r})')
    for key in ("peer_listen", "advertise"):
        value = t.get(key, getattr(d, key))
        if not isinstance(value, str) or (value and not _is_endpoint(value)) or (key == "peer_listen"
                                                                                and not value):
            raise ConfigError(f"cluster.{key}", f'must be "host:port" (got {value!r})')
    timeout = t.get("session_timeout", d.session_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 2 <= timeout <= 120:
        raise ConfigError("cluster.session_timeout", f"must be seconds in 2..120 (got {timeout!r})")
    ints = {}
    for key, low, high in (("replicas", 1, 8), ("vnodes", 1, 4096), ("peer_connections", 1, 64)):
        value = t.get(key, getattr(d, key))
        if type(value) is not int or not low <= value <= high:
            raise ConfigError(f"cluster.{key}", f"must be an integer in {low}..{high} (got {value!r})")
        ints[key] = value
    buffer = parse_size("cluster.peer_socket_buffer", t.get("peer_socket_buffer", d.peer_socket_buffer))
    if buffer and not 4 << 10 <= buffer <= 1 << 30:
        raise ConfigError("cluster.peer_socket_buffer", f"must be 0 (the kernel's autotuning) or 4KiB..1GiB "
                          f"(got {buffer} bytes)")
    handoff = t.get("handoff", d.handoff)
    if not isinstance(handoff, bool):
        raise ConfigError("cluster.handoff", f"must be true or false (got {handoff!r})")
    direct_reads = t.get("direct_reads", d.direct_reads)
    if not isinstance(direct_reads, bool):
        raise ConfigError("cluster.direct_reads", f"must be true or false (got {direct_reads!r})")
    secret = t.get("secret_file", d.secret_file)
    if not isinstance(secret, str) or (secret and not secret.startswith("/")):
        raise ConfigError("cluster.secret_file", f"must be an absolute path (got {secret!r})")
    transport = t.get("transport", d.transport)
    if transport not in ("auto", "rdma", "tcp"):
        raise ConfigError("cluster.transport", f'must be "auto", "rdma" or "tcp" (got {transport!r})')
    device = t.get("rdma_device", d.rdma_device)
    if not isinstance(device, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", device):
        raise ConfigError("cluster.rdma_device",
                          f"must be a device name as ibv_devices lists it (got {device!r})")
    port = t.get("rdma_port", d.rdma_port)
    if type(port) is not int or not 1 <= port <= 255:
        raise ConfigError("cluster.rdma_port", f"must be an integer in 1..255 (got {port!r})")
    gid = t.get("rdma_gid_index", "auto")
    if gid != "auto" and (type(gid) is not int or not 0 <= gid <= 1023):
        raise ConfigError("cluster.rdma_gid_index", f'must be "auto" or an integer in 0..1023 (got {gid!r})')
    if zk and not secret:
        raise ConfigError("cluster.secret_file", "is required when cluster.zookeeper is set "
                          "(peers authenticate with the secret it holds)")
    tls = _tls(t)
    return ClusterConfig(name=name, zookeeper=zk, peer_listen=t.get("peer_listen", d.peer_listen),
                         advertise=t.get("advertise", d.advertise), session_timeout=float(timeout),
                         peer_socket_buffer=buffer, handoff=handoff, direct_reads=direct_reads,
                         secret_file=secret, transport=transport,
                         rdma_device=device, rdma_port=port,
                         rdma_gid_index=None if gid == "auto" else gid, tls_cert=tls["tls_cert"],
                         tls_key=tls["tls_key"], tls_ca=tls["tls_ca"], **ints)


def _tls(t: dict[str, Any]) -> dict[str, str]:
    """``tls_cert``, ``tls_key``, ``tls_ca``: absolute paths, all three or none."""
    paths = {key: t.get(key, "") for key in ("tls_cert", "tls_key", "tls_ca")}
    for key, value in paths.items():
        if not isinstance(value, str) or (value and not value.startswith("/")):
            raise ConfigError(f"cluster.{key}", f"must be an absolute path (got {value!r})")
    missing = [key for key, value in paths.items() if not value]
    if missing and len(missing) < len(paths):
        raise ConfigError(f"cluster.{missing[0]}", "is required when any of tls_cert, tls_key, tls_ca is set")
    return paths


def check_private(where: str, st: os.stat_result) -> None:
    """Raise ``ConfigError`` if a user other than the daemon's may read the file of ``st``.

    For files holding credentials (the tenants file, the cluster secret): a key
    another local user can read is a key that user holds. Others may have no
    access; the group only when the file's group is the daemon's own (a
    Kubernetes secret volume is root's, group ``fsGroup``, mode 0440 at least).
    """
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007 or (mode & 0o070 and st.st_gid != os.getegid()):
        raise ConfigError(where, f"holds credentials: make it readable by the daemon's user only "
                                 f"(chmod 600; it is {mode:04o}, group {st.st_gid})")


def read_secret(path: str) -> bytes:
    """The cluster secret from ``path``: private (``check_private``), at least 16 bytes; raises
    ``ConfigError``."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError("cluster.secret_file", f"cannot read {path!r}: {exc.strerror}") from None
    check_private(f"cluster.secret_file ({path})", st)
    if len(secret) < 16:
        raise ConfigError("cluster.secret_file", f"{path!r} must hold a secret of at least 16 bytes")
    return secret


def _log(t: dict[str, Any]) -> LogConfig:
    _only(t, "log", {"level", "format"})
    level = t.get("level", LogConfig().level)
    if level not in _LOG_LEVELS:
        raise ConfigError("log.level", f"must be one of {', '.join(_LOG_LEVELS)} (got {level!r})")
    fmt = t.get("format", LogConfig().format)
    if fmt not in ("text", "json"):
        raise ConfigError("log.format", f'must be "text" or "json" (got {fmt!r})')
    return LogConfig(level=level, format=fmt)
