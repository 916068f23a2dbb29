"""LMCache remote storage plugin: ``EmsdConnector``, an LMCache ``RemoteConnector`` on emsd.

Use (LMCache config; LMCache 0.5.x loads the class through its
``remote_storage_plugins`` mechanism)::

    local_cpu: true            # the remote backend needs the CPU backend as its buffer
    max_local_cpu_size: 5
    remote_storage_plugins: ["emsd"]
    extra_config:
      remote_storage_plugin.emsd.module_path: ems.integrations.lmcache
      remote_storage_plugin.emsd.class_name: EmsdConnector
      # optional, see OPTIONS below:
      remote_storage_plugin.emsd.timeout_ms: 5000

This module imports without LMCache installed; instantiating
``EmsdConnector`` without it raises ``ImportError``.

What is stored, under which key
-------------------------------
- One emsd value per LMCache chunk (``MemoryObj``): LMCache's own
  ``RemoteMetadata`` header (length, shapes, dtypes, memory format; the same
  header its fs and redis connectors write) followed by the chunk's bytes,
  zero-padded to one fixed size, header plus a full chunk. A partial last
  chunk therefore takes a full chunk's space; the header says its real
  length and shape.
- The key is ``CacheEngineKey.to_string()`` (model name, world size, worker
  id, chunk hash, dtype, tags) hashed with BLAKE2b to 32 bytes
  (``ems.integrations.keys.digest_key``): two workers of one model never
  share a value, two engines of the same model and world size do.
- The SDK namespace is ``<model>.lmcache-<fingerprint>``: ``<model>`` is the
  ``model_id`` option or LMCache's model name, the fingerprint covers chunk
  size, shapes, dtypes, memory format, serde and this value format, so
  engines whose chunks would be read differently never share values.

Fail open: emsd down, hung, full or refusing gives misses (``None``,
``False``, 0) and dropped puts, never an exception into LMCache (see
``ems.integrations.region_store``). ``put`` never calls
``ref_count_down()``: LMCache's ``InstrumentedRemoteConnector`` does it
after ``put`` returns.

Not supported: ``list()`` returns ``[]`` and ``remove_sync`` ``False`` (the SDK
has no listing or delete; emsd evicts by itself); layerwise mode
(``use_layerwise``) is refused at start; the scheduler role (no local CPU
backend) cannot build the connector, as with LMCache's fs connector.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
from collections.abc import Sequence
from typing import Any

from ems.cc_v1.cc_config import CcConfig_v1
from ems.config import EmsConfig
from ems.integrations.keys import digest_key, model_id
from ems.integrations.staging import StagedValues

log = logging.getLogger("ems.integrations.lmcache")

try:
    from lmcache.v1.protocol import RemoteMetadata
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # LMCache not installed: the module still imports
    RemoteConnector = object
    RemoteMetadata = None
    _IMPORT_ERROR = exc

OPTION_PREFIX = "remote_storage_plugin.emsd."
VALUE_FORMAT = "lmcache-remote-metadata-v1"
OPTIONS: dict[str, Any] = {
    "model_id": None,          # base of the namespace; default: LMCache's model name
    "namespace": None,         # the SDK model_id verbatim (no fingerprint)
    "access_id": None,         # emsd tenant; access_key also from env EMS_ACCESS_KEY
    "access_key": None,
    "timeout_ms": 5000,        # one SDK call
    "retry_interval_s": 5.0,   # how long emsd stays out of use after a failure
    "staging_chunks": 4,       # chunks per SDK call (the staging buffer's size)
}


def read_options(extra_config: dict[str, Any] | None) -> dict[str, Any]:
    """``OPTIONS`` overridden by ``extra_config["remote_storage_plugin.emsd.<name>"]``.

    Raises ``ValueError`` naming an unknown ``remote_storage_plugin.emsd.*`` key
    (``module_path`` and ``class_name`` belong to LMCache).
    """
    opts = dict(OPTIONS)
    for name, value in (extra_config or {}).items():
        if not name.startswith(OPTION_PREFIX):
            continue
        opt = name[len(OPTION_PREFIX):]
        if opt in ("module_path", "class_name"):
            continue
        if opt not in OPTIONS:
            raise ValueError(f"unknown option {name!r}; known: "
                             + ", ".join(OPTION_PREFIX + k for k in OPTIONS))
        opts[opt] = value
    if opts["access_key"] is None:
        opts["access_key"] = os.environ.get("EMS_ACCESS_KEY") or None
    return opts


def lmcache_key(key: Any) -> bytes:
    """The emsd key of an LMCache ``CacheEngineKey`` (32 bytes)."""
    return digest_key(key.to_string())


class EmsdConnector(RemoteConnector):  # type: ignore[misc,valid-type]
    """LMCache ``RemoteConnector`` storing chunks in the node's emsd (module docstring).

    Built by LMCache's ``DynamicConnectorAdapter`` as
    ``EmsdConnector(loop=, local_cpu_backend=, config=)``; ``metadata``
    defaults to the CPU backend's. Raises ``ImportError`` without LMCache and
    ``ValueError`` for a bad option or a missing CPU backend.
    """

    def __init__(self, loop: Any = None, local_cpu_backend: Any = None, config: Any = None,
                 metadata: Any = None, **_ignored: Any) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(f"EmsdConnector needs LMCache (pip install lmcache): {_IMPORT_ERROR}")
        config = config if config is not None else getattr(local_cpu_backend, "config", None)
        metadata = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if config is None or metadata is None or not hasattr(local_cpu_backend, "allocate"):
            raise ValueError("EmsdConnector needs LMCache's local CPU backend (with its config and "
                             "metadata) to allocate chunks; none was given (scheduler role?)")
        if getattr(config, "use_layerwise", False):
            raise ValueError("EmsdConnector does not support LMCache's layerwise mode (use_layerwise)")
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        opts = read_options(config.extra_config)
        self.options = opts
        self.value_bytes = self.remote_metadata_bytes + self.full_chunk_size_bytes
        ns = opts["namespace"] or model_id(opts["model_id"] or metadata.model_name, "lmcache", {
            "format": VALUE_FORMAT, "chunk_size": metadata.chunk_size,
            "shapes": [list(s) for s in self.meta_shapes], "dtypes": [str(d) for d in self.meta_dtypes],
            "fmt": str(self.meta_fmt), "serde": getattr(config, "remote_serde", None),
            "header": self.remote_metadata_bytes})
        cc = CcConfig_v1(rank_id=0, device_id=0, model_id=ns, llm_engine="lmcache")
        ems_config = EmsConfig(access_id=opts["access_id"], access_key=opts["access_key"], cc_config=cc)
        self._values = StagedValues(ems_config, self.value_bytes, int(opts["staging_chunks"]),
                                    timeout_ms=int(opts["timeout_ms"]),
                                    retry_interval_s=float(opts["retry_interval_s"]),
                                    name="lmcache-emsd")
        self.namespace = ns
        log.info("EmsdConnector: namespace %s, %d-byte values", ns, self.value_bytes)

    # -- lookups -------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: Any) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading keys emsd holds (one round trip per 4096 keys)."""
        try:
            return self._values.exists([lmcache_key(k) for k in keys])
        except Exception:
            log.exception("EmsdConnector.batched_contains failed; reporting misses")
            return 0

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # -- reads ---------------------------------------------------------------------

    async def get(self, key: Any) -> Any:
        return (await asyncio.to_thread(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """A ``MemoryObj`` per leading hit, then ``None`` from the first miss on."""
        return await asyncio.to_thread(self._get_many, keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading hits only (LMCache's contract for this call)."""
        objs = await asyncio.to_thread(self._get_many, keys)
        return objs[:_leading(objs)]

    # -- writes --------------------------------------------------------------------

    async def put(self, key: Any, memory_obj: Any) -> None:
        await asyncio.to_thread(self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await asyncio.to_thread(self._put_many, keys, memory_objs)

    # -- the rest of the interface ---------------------------------------------------

    async def list(self) -> list[str]:
        return []  # the SDK has no listing

    def remove_sync(self, key: Any) -> bool:
        return False  # the SDK has no delete; emsd evicts by itself

    async def close(self) -> None:
        self._values.close()

    def __repr__(self) -> str:
        return f"<EmsdConnector {getattr(self, 'namespace', '?')}>"

    # -- the work ------------------------------------------------------------------

    def _put_many(self, keys: Sequence[Any], objs: Sequence[Any]) -> int:
        """Store the chunks; returns how many leading ones were stored. Never raises."""
        try:
            values = [self._pack(obj) for obj in objs]
            return self._values.put([lmcache_key(k) for k in keys], values)
        except Exception:
            log.exception("EmsdConnector put failed; the chunks are not stored")
            return 0

    def _pack(self, obj: Any) -> tuple[bytes, memoryview]:
        data = memoryview(obj.byte_array).cast("B")
        header = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(),
                                obj.get_memory_format()).serialize()
        return header, data

    def _get_many(self, keys: Sequence[Any]) -> builtins.list[Any]:  # "list" is a method here
        out: builtins.list[Any] = [None] * len(keys)

        def consume(i: int, value: memoryview) -> bool:
            out[i] = self._unpack(value)
            return out[i] is not None

        try:
            self._values.get([lmcache_key(k) for k in keys], consume)
        except Exception:
            log.exception("EmsdConnector get failed; reporting misses")
            for i, obj in enumerate(out):
                if obj is not None:
                    obj.ref_count_down()
                    out[i] = None
        return out

    def _unpack(self, value: memoryview) -> Any:
        """A new ``MemoryObj`` holding the stored chunk, or None (bad header, no memory)."""
        h = self.remote_metadata_bytes
        try:
            meta = RemoteMetadata.deserialize(bytes(value[:h]))
        except Exception as exc:
            log.warning("EmsdConnector: unreadable chunk header (%s); a miss", exc)
            return None
        if not 0 < meta.length <= len(value) - h:
            log.warning("EmsdConnector: chunk header says %d bytes, values hold %d; a miss",
                        meta.length, len(value) - h)
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            return None  # LMCache's CPU buffer is full: a miss
        try:
            dst = memoryview(obj.byte_array).cast("B")
            if len(dst) != meta.length:
                raise ValueError(f"shapes {meta.shapes} need {len(dst)} bytes, header says {meta.length}")
            dst[:] = value[h:h + meta.length]
        except Exception as exc:
            obj.ref_count_down()
            log.warning("EmsdConnector: stored chunk does not fit its header (%s); a miss", exc)
            return None
        return obj


def _leading(objs: Sequence[Any]) -> int:
    for i, obj in enumerate(objs):
        if obj is None:
            return i
    return len(objs)
