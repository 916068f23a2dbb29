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
re-init.
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

from ems.client import DaemonClient, socket_path
from ems.common.exception import EmsErrorCode, EmsException, invalid
from ems.config import EmsConfig
from ems.context_caching import ContextCaching
from ems.profiling import Profiler, install_log_handler, remove_log_handler
from emsd.transport.frames import Op

log = logging.getLogger("ems")

HEALTH_TIMEOUT = 0.5


class Ems:
    """Process-wide SDK state; all methods are class methods."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _client: ClassVar[DaemonClient | None] = None
    _cc: ClassVar[ContextCaching | None] = None
    _config: ClassVar[EmsConfig | None] = None

    @classmethod
    def init(cls, config: EmsConfig) -> None:
        """Connect to the local emsd; raises ``EmsException`` on failure."""
        if not isinstance(config, EmsConfig):
            raise invalid(f"config must be an EmsConfig, not {type(config).__name__}")
        cc_cfg = config.validate()
        install_log_handler()  # $EMS_SDK_LOG/ems_sdk.log (default /var/log/ems, else a temp dir)
        with cls._lock:
            if cls._client is not None and not cls._client.broken and cls._config is config:
                return
            client = DaemonClient(socket_path())
            hello = {"access_id": config.access_id or "", "access_key": config.access_key or ""}
            client.connect(hello)
            old, cls._client = cls._client, client
            if old is not None:
                old.close()
            if cls._cc is None or cls._config is not config:
                cls._cc = ContextCaching(cls._current_client, cc_cfg, config.access_id,
                                         Profiler.from_env())
            cls._config = config
            log.info("connected to emsd %s (%s pool, %d MiB)", client.info.get("node"),
                     client.info.get("region"), int(client.info.get("pool_size", 0)) >> 20)

    @classmethod
    def get_cc(cls) -> ContextCaching | None:
        """The ``ContextCaching`` object, or None before a successful init."""
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        """True when the local daemon answers and its pool is mapped; never raises."""
        client = cls._client
        if client is None or client.broken or client.pool is None:
            return False
        try:
            client.call(Op.PING, {}, timeout=HEALTH_TIMEOUT)
        except EmsException:
            return False
        return True

    @classmethod
    def _current_client(cls) -> DaemonClient:
        client = cls._client
        if client is None:
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, "Ems.init() has not succeeded")
        return client

    @classmethod
    def _reset(cls) -> None:
        """Forget the connection (tests and shutdown); not part of the EMS API."""
        with cls._lock:
            if cls._cc is not None:
                cls._cc.close()
            if cls._client is not None:
                cls._client.close()
            cls._client = cls._cc = cls._config = None
        remove_log_handler()
