"""SGLang HiCache storage backend: ``EmsdHiCacheStorage``, HiCache's L3 tier in emsd.

Use (SGLang 0.5.23; HiCache loads the class with its ``dynamic`` backend)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "emsd",
        "module_path": "ems.integrations.sglang", "class_name": "EmsdHiCacheStorage",
        "interface_v1": 1}'

``interface_v1: 1`` selects the zero-copy path (``batch_get_v1`` /
``batch_set_v1``): the SDK copies pages straight between SGLang's host KV
pool (registered once, in ``register_mem_pool_host``) and emsd's shared
memory, one memcpy per contiguous piece of a page. Without it SGLang uses
``batch_get``/``batch_set`` on a flat page tensor per call, which goes
through a staging buffer (one extra copy). Optional ``emsd_*`` keys in the
same JSON: see ``OPTIONS``.

This module imports without SGLang; instantiating the backend without it
raises ``ImportError``.

What is stored, under which key
-------------------------------
- One emsd value per HiCache page (``page_size`` tokens, every layer, K and
  V). With ``interface_v1`` the value is the page's pieces as the host pool
  reports them (``get_page_buffer_meta``: K then V per layer for the
  ``layer_first`` layout, K then V of all layers for ``page_first``), copied
  in that order; without it, SGLang's flat page
  (``get_data_page(flat=True)``). The two formats live in different
  namespaces, so they never read each other's bytes.
- The key is SGLang's page hash (64 hex digits, a SHA-256 chained over the
  prefix) taken as its 32 bytes; other strings are hashed to 32 bytes
  (``ems.integrations.keys.digest_key``).
- The SDK namespace carries the TP and PP rank (MLA: one shared copy for all
  TP ranks, as SGLang's file backend does) and a fingerprint of the page's
  geometry, dtype, layout, the interface and context-parallel ranks:
  ``<model>.sglang-<fingerprint>``.

Fail open: emsd down, hung, full or refusing gives misses (``None``,
``False``, 0, all-``False`` lists); no exception reaches SGLang's cache
controller (see ``ems.integrations.region_store``). ``batch_exists``
returns the length of the stored prefix with one round trip.

``clear()`` drops this backend's namespaces on every emsd of the cluster
(``ContextCaching.clear``): SGLang's ``/clear_hicache_storage_backend``, to
call after weights change in place. Not supported: the v2 interface for
hybrid models (``batch_*_v2``, Mamba/SWA side pools).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.config import EmsConfig
from ems.integrations.keys import digest_key, model_id
from ems.integrations.region_store import RegionStore
from ems.integrations.staging import StagedValues

log = logging.getLogger("ems.integrations.sglang")

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # SGLang not installed: the module still imports
    HiCacheStorage = object
    _IMPORT_ERROR = exc

OPTION_PREFIX = "emsd_"
OPTIONS: dict[str, Any] = {
    "emsd_model_id": None,         # base of the namespace; default: SGLang's model name
    "emsd_namespace": None,        # the SDK model_id verbatim (no fingerprint, no rank)
    "emsd_access_id": None,        # emsd tenant; the key also from env EMS_ACCESS_KEY
    "emsd_access_key": None,
    "emsd_timeout_ms": 5000,       # one SDK call
    "emsd_retry_interval_s": 5.0,  # how long emsd stays out of use after a failure
    "emsd_staging_pages": 16,      # pages per SDK call on the non-zero-copy path
}


def read_options(extra_config: dict[str, Any] | None) -> dict[str, Any]:
    """``OPTIONS`` overridden by ``extra_config``; ``ValueError`` names an unknown ``emsd_*`` key."""
    opts = dict(OPTIONS)
    for name, value in (extra_config or {}).items():
        if name.startswith(OPTION_PREFIX):
            if name not in OPTIONS:
                raise ValueError(f"unknown option {name!r}; known: {', '.join(OPTIONS)}")
            opts[name] = value
    if opts["emsd_access_key"] is None:
        opts["emsd_access_key"] = os.environ.get("EMS_ACCESS_KEY") or None
    return opts


def page_granularity(base: int, segments: Sequence[tuple[int, int]]) -> int:
    """The largest slot size that every segment's offset from ``base`` and length are multiples of."""
    g = 0
    for addr, nbytes in segments:
        g = math.gcd(g, int(addr) - base, int(nbytes))
    return g


def hit_list(hits: int, n: int) -> list[bool]:
    return [i < hits for i in range(n)]


class EmsdHiCacheStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    """HiCache storage backend on emsd (module docstring).

    ``EmsdHiCacheStorage(storage_config, kwargs)``, as SGLang's
    ``StorageBackendFactory`` builds a ``dynamic`` backend. Calls before
    ``register_mem_pool_host`` are misses. Raises ``ImportError`` without
    SGLang and ``ValueError`` for a bad option.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(f"EmsdHiCacheStorage needs SGLang (pip install sglang): {_IMPORT_ERROR}")
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.options = read_options(extra)
        self.interface_v1 = bool(int(extra.get("interface_v1", 0) or 0))
        self.zero_copy: RegionStore | None = None
        self.flat: StagedValues | None = None
        self.namespaces: dict[str, str] = {}

    # -- registration --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool: the zero-copy region, and the flat-page staging buffer."""
        super().register_mem_pool_host(mem_pool_host)
        opts = self.options
        common = {"timeout_ms": int(opts["emsd_timeout_ms"]),
                  "retry_interval_s": float(opts["emsd_retry_interval_s"])}
        flat_page = mem_pool_host.get_dummy_flat_data_page()
        page_bytes = flat_page.numel() * flat_page.element_size()
        self.close()
        self.flat = StagedValues(self._ems_config(mem_pool_host, "flat", page_bytes), page_bytes,
                                 int(opts["emsd_staging_pages"]), name="sglang-emsd-flat", **common)
        if self.interface_v1:
            self.zero_copy = self._zero_copy_store(mem_pool_host, page_bytes, common)

    def _zero_copy_store(self, pool: Any, page_bytes: int, common: dict[str, Any]) -> RegionStore | None:
        buf = pool.kv_buffer
        base, length = buf.data_ptr(), buf.numel() * buf.element_size()
        pages = min(2, max(1, pool.size // pool.page_size))
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pages * pool.page_size, dtype=torch.int64))
        g = page_granularity(base, list(zip(ptrs, sizes, strict=True)))
        if g <= 0 or sum(sizes) != pages * page_bytes:
            log.error("EmsdHiCacheStorage: host pool %s reports pages emsd cannot map "
                      "(granularity %d); the zero-copy path is off (all misses)", type(pool).__name__, g)
            return None
        layout = f"v1-{getattr(pool, 'layout', '?')}"
        return RegionStore(self._ems_config(pool, layout, page_bytes), base, length, g,
                           name="sglang-emsd-v1", **common)

    def _ems_config(self, pool: Any, interface: str, page_bytes: int) -> EmsConfig:
        sc, opts = self.storage_config, self.options
        mla = bool(sc.is_mla_model)
        tp, tp_rank = (1, 0) if mla else (int(sc.tp_size), int(sc.tp_rank))
        pp, pp_rank = int(sc.pp_size), int(sc.pp_rank)
        ns = opts["emsd_namespace"] or model_id(opts["emsd_model_id"] or sc.model_name, "sglang", {
            "interface": interface, "page_bytes": page_bytes, "page_size": pool.page_size,
            "dtype": str(getattr(pool, "dtype", "")), "pool": type(pool).__name__,
            "cp": [sc.attn_cp_rank, sc.attn_cp_size], "dcp": [sc.dcp_rank, sc.dcp_size],
            "split_heads": sc.should_split_heads, "tp_lcm": sc.tp_lcm_size})
        self.namespaces[interface] = ns
        cc = CcConfig_v1(rank_id=tp_rank + tp * pp_rank, device_id=0, model_id=ns,
                         tp_world_size=tp, pp_world_size=pp, rank_in_tp_group=tp_rank,
                         rank_in_pp_group=pp_rank, llm_engine="sglang",
                         kvcache_type=KVCacheType.MLA if mla else KVCacheType.MHA)
        return EmsConfig(access_id=opts["emsd_access_id"], access_key=opts["emsd_access_key"],
                         cc_config=cc)

    # -- zero-copy interface ---------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Load pages into the host pool at ``host_indices``; True for each leading hit."""
        return self._v1("load", keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; True for each leading stored page."""
        return self._v1("save", keys, host_indices)

    def _v1(self, op: str, keys: list[str], host_indices: Any) -> list[bool]:
        store = self.zero_copy
        if store is None or not keys:
            return [False] * len(keys)
        try:
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
            per, rest = divmod(len(ptrs), len(keys))
            if rest or per == 0 or len(sizes) != len(ptrs):
                log.error("EmsdHiCacheStorage: %d keys but %d page pieces; nothing done",
                          len(keys), len(ptrs))
                return [False] * len(keys)
            pieces = list(zip(ptrs, sizes, strict=True))
            segments = [pieces[i * per:(i + 1) * per] for i in range(len(keys))]
            digests = [digest_key(k) for k in keys]
            hits = store.save(digests, segments) if op == "save" else store.load(digests, segments)
        except Exception:
            log.exception("EmsdHiCacheStorage.batch_%s_v1 failed; reporting misses", op)
            hits = 0
        return hit_list(hits, len(keys))

    # -- flat-page interface ---------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Each leading hit copied into its target tensor (a new flat page if None); then None."""
        out: list[Any] = [None] * len(keys)
        flat = self.flat
        if flat is None or not keys:
            return out
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)

        def consume(i: int, value: memoryview) -> bool:
            target = targets[i] if targets[i] is not None else self.mem_pool_host.get_dummy_flat_data_page()
            dst = _writable_bytes(target)
            if dst is None or len(dst) != len(value):
                log.warning("EmsdHiCacheStorage.get: target of %s bytes for a %d-byte page; a miss",
                            None if dst is None else len(dst), len(value))
                return False
            dst[:] = value
            out[i] = target
            return True

        try:
            flat.get([digest_key(k) for k in keys], consume)
        except Exception:
            log.exception("EmsdHiCacheStorage.batch_get failed; reporting misses")
            return [None] * len(keys)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages; True only when every page was stored."""
        flat = self.flat
        if flat is None or values is None or len(values) != len(keys):
            return False
        if not keys:
            return True
        try:
            data = [_readable_bytes(v) for v in values]
            return flat.put([digest_key(k) for k in keys], data) == len(keys)
        except Exception:
            log.exception("EmsdHiCacheStorage.batch_set failed; the pages are not stored")
            return False

    # -- lookups ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Length of the stored prefix of ``keys`` in the active interface's namespace."""
        store: Any = self.zero_copy if self.interface_v1 else self.flat
        if store is None or not keys:
            return 0
        try:
            return int(store.exists([digest_key(k) for k in keys]))
        except Exception:
            log.exception("EmsdHiCacheStorage.batch_exists failed; reporting misses")
            return 0

    def clear(self) -> bool:
        """Drop every page this backend's namespaces hold (both formats), on every emsd
        of the cluster (``ContextCaching.clear``); True once all confirmed. SGLang calls
        it for ``/clear_hicache_storage_backend``, e.g. after a weight update."""
        stores = [store for store in (self.zero_copy, self.flat) if store is not None]
        if not stores:
            return False
        return all([store.clear() for store in stores])  # a list: every store is cleared

    def close(self) -> None:
        for store in (self.zero_copy, self.flat):
            if store is not None:
                store.close()


def _writable_bytes(tensor: Any) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's memory, or None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _readable_bytes(tensor: Any) -> memoryview:
    """The bytes of a CPU tensor (a contiguous copy if it is strided)."""
    flat = tensor.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
