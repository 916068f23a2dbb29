"""``Ems``: the process-wide entry point of the SDK (initialised once).

``Ems.init(config)`` validates the config, connects to the local emsd
(``$EMS_SOCKET_DIR/emsd.sock``, default /dev/shm/ems), authenticates and maps
the pool. A second ``init`` while connected is a no-op; after a failure (the
daemon restarted, the connection broke) it reconnects and keeps the same
``ContextCaching`` object, whose registered layout stays valid.

The SDK logs to ``$EMS_SDK_LOG/ems_sdk.log`` (default /var/log/ems, or a
temp directory when that cannot be created); ``ENABLE_CC_PROFILING=1`` adds
one JSON line per call next to it.

``check_health()`` never raises and never blocks for long (a PING with a
short deadline): a connector can poll it from a thread to decide when to
re-init. When there is no usable connection it tries to make one with the
config of the last ``init`` (at most once per ``RECONNECT_INTERVAL``), so that
it turns ``True`` once the daemon is back: the published connectors stop
calling while unhealthy and re-init only when ``check_health()`` says so.
After an ``init`` that failed (the daemon was away or still recovering) that
connection is the one the next ``init`` with the same config then finds.

``init`` keeps a copy of the config it was given: changing the config object
afterwards (it is a plain settings object) changes nothing until ``init`` is
called with it again, which then connects and builds a new ``ContextCaching``
if the values differ. ``init`` with equal values is a no-op whether or not it
is the same object: published samples build a new config in each code path.

A daemon that restarts (an upgrade, a crash; its pool survives a warm
restart) needs nothing from the caller: the next call finds the connection
broken and reconnects on its own, mapping the pool again, at most once per
``RECONNECT_INTERVAL``; while the daemon is away calls fail fast with
EMS_IO_ERROR. A replaced connection's pool mapping is kept until the next
replacement, so that a copy still running on another thread never touches
unmapped memory.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import ClassVar

from ems.client import CONNECT_TIMEOUT, DaemonClient, socket_path
from ems.common.exception import EmsErrorCode, EmsException, invalid
from ems.config import EmsConfig
from ems.context_caching import ContextCaching
from ems.profiling import Profiler, install_log_handler, remove_log_handler
from emsd.transport.frames import Op

log = logging.getLogger("ems")

# seconds a health check waits for the daemon's PING: a busy daemon is not a sick one (the
# published connector turns one false "unhealthy" into 30 s without the cache)
HEALTH_TIMEOUT = 2.0
RECONNECT_INTERVAL = 0.2  # seconds between reconnection attempts while the daemon is away
RECONNECT_TIMEOUT = 1.0  # seconds one attempt may take


class Ems:
    """Process-wide SDK state; all methods are class methods."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _client: ClassVar[DaemonClient | None] = None
    _cc: ClassVar[ContextCaching | None] = None
    _config: ClassVar[EmsConfig | None] = None  # copy of the config connected with
    _wanted: ClassVar[EmsConfig | None] = None  # copy of it, validated (also after a failed init)
    _retired: ClassVar[DaemonClient | None] = None  # the connection replaced last, still mapped
    _next_try: ClassVar[float] = 0.0

    @classmethod
    def init(cls, config: EmsConfig) -> None:
        """Connect to the local emsd; raises ``EmsException`` on failure.

        A no-op while connected with a config of the same values (the same
        object or another: the SDK is initialised once per process); after a
        failure it connects again, keeping the ``ContextCaching`` (and its
        registered layout) when the values are those connected with before.
        A config of other values connects anew with a new ``ContextCaching``.
        """
        if not isinstance(config, EmsConfig):
            raise invalid(f"config must be an EmsConfig, not {type(config).__name__}")
        config.validate()
        wanted = config.copy()
        install_log_handler()  # $EMS_SDK_LOG/ems_sdk.log (default /var/log/ems, else a temp dir)
        with cls._lock:
            cls._wanted = wanted
            client = cls._client
            if client is not None and not client.broken and cls._config is not None \
                    and cls._config.same(wanted):
                return
            cls._connect(wanted, CONNECT_TIMEOUT)

    @classmethod
    def _connect(cls, wanted: EmsConfig, timeout: float) -> None:
        """Connect with ``wanted`` (validated) and make it current; the caller holds the lock."""
        client = DaemonClient(socket_path())
        client.connect(_hello(wanted), timeout=timeout)
        cls._replace(client)
        if cls._cc is None or cls._config is None or not cls._config.same(wanted):
            cls._cc = ContextCaching(cls._current_client, wanted.validate(), wanted.access_id,
                                     Profiler.from_env())
        cls._config = wanted
        log.info("connected to emsd %s (%s pool, %d MiB)", client.info.get("node"),
                 client.info.get("region"), int(client.info.get("pool_size", 0)) >> 20)

    @classmethod
    def get_cc(cls) -> ContextCaching | None:
        """The ``ContextCaching`` object, or None before a successful init."""
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """True when the local daemon answers and its pool is mapped; never raises."""
        try:
            client = cls._client
            if client is None:
                client = cls._first_connection()
            elif client.broken:
                client = cls._reconnect(client, HEALTH_TIMEOUT)
            if client is None or client.pool is None:
                return False
            client.call(Op.PING, {}, timeout=HEALTH_TIMEOUT)
        except EmsException:
            return False
        return True

    @classmethod
    def _first_connection(cls) -> DaemonClient | None:
        """After a failed ``init``: connect with its config (at most once per
        ``RECONNECT_INTERVAL``); None when there is none or it is too early.
        Raises ``EmsException`` when the daemon is away or still recovering."""
        with cls._lock:
            if cls._client is not None:
                return cls._client
            now = time.monotonic()
            if cls._wanted is None or now < cls._next_try:
                return None
            cls._next_try = now + RECONNECT_INTERVAL
            cls._connect(cls._wanted, HEALTH_TIMEOUT)
            return cls._client

    @classmethod
    def _current_client(cls) -> DaemonClient:
        client = cls._client
        if client is None:
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, "Ems.init() has not succeeded")
        return client if not client.hung_up() else cls._reconnect(client)

    @classmethod
    def _reconnect(cls, broken: DaemonClient, timeout: float = RECONNECT_TIMEOUT) -> DaemonClient:
        """A new connection in place of ``broken``; raises EMS_IO_ERROR at once while emsd is away."""
        with cls._lock:
            current = cls._client
            if current is not broken and current is not None and not current.broken:
                return current  # another thread reconnected meanwhile
            if cls._config is None:
                raise EmsException(EmsErrorCode.EMS_IO_ERROR, "Ems.init() has not succeeded")
            now = time.monotonic()
            if now < cls._next_try:
                raise EmsException(EmsErrorCode.EMS_IO_ERROR, "emsd is unreachable (restarting?)")
            cls._next_try = now + RECONNECT_INTERVAL
            client = DaemonClient(socket_path())
            client.connect(_hello(cls._config), timeout=timeout)  # raises EMS_IO_ERROR
            cls._replace(client)
            log.info("reconnected to emsd %s (%s pool, %d MiB)", client.info.get("node"),
                     client.info.get("region"), int(client.info.get("pool_size", 0)) >> 20)
            return client

    @classmethod
    def _replace(cls, client: DaemonClient) -> None:
        """Make ``client`` current; the one before stays mapped until the next replacement."""
        old, cls._client = cls._client, client
        if old is not None:
            if cls._retired is not None:
                cls._retired.close()
            old.close_socket()
            cls._retired = old

    @classmethod
    def _reset(cls) -> None:
        """Forget the connection (tests and shutdown); not part of the EMS API."""
        with cls._lock:
            if cls._cc is not None:
                cls._cc.close()
            for client in (cls._client, cls._retired):
                if client is not None:
                    client.close()
            cls._client = cls._cc = cls._config = cls._wanted = cls._retired = None
            cls._next_try = 0.0
        remove_log_handler()


def _hello(config: EmsConfig) -> dict[str, str]:
    return {"access_id": config.access_id or "", "access_key": config.access_key or ""}
