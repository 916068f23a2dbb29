"""``EmsStoreConnector``: a vLLM v1 KV connector that keeps KV blocks in emsd.

Use (vLLM >= 0.32; emsd running on the node, ``EMS_SOCKET_DIR`` pointing at
its socket directory when it is not ``/dev/shm/ems``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"EmsStoreConnector",
        "kv_connector_module_path":"ems.integrations.vllm","kv_role":"kv_both"}'

What it does
------------
Scheduler side (``get_num_new_matched_tokens``): the request's vLLM block
hashes (``request.block_hashes``, 32-byte SHA-256 chained digests by default)
become emsd keys (``block_key``); one ``exists`` call counts how many blocks
after the locally cached prefix emsd holds (``lookup_window``). The match is
reported in whole blocks, but never the whole prompt: vLLM needs at least one
token to compute, so a match that reaches the prompt's last token reports one
token fewer, and that block is still loaded whole (the engine then computes
its last token again). A match shorter than ``min_reuse_tokens`` is dropped
(``matched_tokens``). Loads are synchronous (``load_kv_async=False``): they
complete before the forward pass that needs them. ``reset_cache`` (vLLM's
``reset_prefix_cache(reset_connector=True)``, after a weight update) drops
the model's namespace of every rank in emsd.

Worker side: ``start_load_kv`` copies the matched blocks from emsd into the
paged KV cache (``async_load`` per request, then waits for all of them);
``wait_for_save`` issues one ``async_save`` per request for the blocks that
became full during the step, and ``get_finished`` polls those futures with
``is_ready``. A finished request whose blocks are still being saved is kept
allocated (``request_finished`` returns ``True``) until its saves are done,
and saves of a preempted request are waited for (``handle_preemptions``)
before its blocks can be reused: a save never copies bytes that another
request already overwrote.

The KV cache is registered with the SDK one vLLM block per SDK "slot": each
layer's cache is viewed as ``[num_blocks, 1, block_bytes]`` (split into more
pieces when a block is not contiguous in memory), so a stored value is one
whole vLLM block of every layer, whatever the attention backend's layout
inside the block.

Namespace
---------
Keys live in the SDK namespace of a ``CcConfig`` whose ``model_id`` is
``<model>.kv-<16 hex>``: ``<model>`` is ``model_id`` from the extra config,
else the served model name (a local path's last component), reduced to
``[0-9a-z._@-]``; the hex digest covers everything that changes the bytes of
a block: model dtype, KV-cache dtype and spec (heads, head size, block size,
layers), the physical KV layout, vLLM's minor version, the device type, the
quantization, the revision, and the block-hash algorithm (which changes the
keys). TP/PP shape and this rank's place go into the ``CcConfig`` fields, so
each TP rank keeps its own shard. ``namespace`` in the extra config replaces
the whole ``model_id`` verbatim (no digest): only for deployments known to
write identical bytes.

Fail open
---------
emsd down, slow, full or restarted never stops the engine: a lookup that
fails is a miss, a save that fails or would exceed ``max_inflight_saves`` is
dropped, a load that fails or misses (``success < total``, a timeout, a
block of another size) reports its blocks through
``get_block_ids_with_load_errors`` and vLLM recomputes them. The connector
therefore sets vLLM's ``kv_load_failure_policy`` to ``"recompute"`` (vLLM's
default ``"fail"`` would fail the request on a cache miss after the lookup)
unless ``keep_kv_load_failure_policy`` is true. After an I/O error or a
timeout the connector stops calling emsd and a background thread re-runs
``Ems.init`` every ``retry_interval_s`` seconds until it succeeds. Every
engine-facing method catches unexpected exceptions, logs them and falls back
to "no cache".

Extra config (``kv_connector_extra_config``), all optional: ``model_id``,
``namespace``, ``access_id``, ``access_key`` (else env ``EMS_ACCESS_KEY``),
``min_reuse_tokens`` (default: one block), ``lookup_timeout_ms`` (500),
``load_timeout_ms`` (5000), ``save_timeout_ms`` (5000), ``retry_interval_s``
(5.0), ``max_inflight_saves`` (8), ``save_decode_blocks`` (true),
``keep_kv_load_failure_policy`` (false). Unknown keys are refused at start.

Limits: one KV-cache group of full attention (vLLM turns its hybrid manager
off for connectors without ``SupportsHMA``), no decode/prefill context
parallelism. The module imports without vLLM; the connector then raises
``ImportError`` when instantiated. The pure helpers (``block_key``,
``kv_block_keys``, ``lookup_window``, ``matched_tokens``, ``blocks_to_load``,
``full_blocks``, ``ConnectorSettings``, ``namespace_model_id``) need neither
vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.common.exception import EmsErrorCode, EmsException
from ems.config import CcKvOption, EmsConfig
from ems.context_caching import ContextCaching
from ems.ems import Ems
from ems.profiling import Profiler

if TYPE_CHECKING:
    from ems.result import CcFuture

log = logging.getLogger("vllm.ems_store_connector")

_VLLM_IMPORT_ERROR: ImportError | None = None
_HIT_SOURCE: Any = None

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as _ConnectorBase
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _MetadataBase
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as _ConnectorBase
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _MetadataBase
    except ImportError as exc:  # vLLM not installed: pure helpers still work
        _VLLM_IMPORT_ERROR = exc

        class _ConnectorBase:
            """Stand-in base when vLLM is missing; instantiating the connector raises."""

            _cache_hit_source = None

        class _MetadataBase:
            """Stand-in for ``KVConnectorMetadata`` when vLLM is missing."""

    else:
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            _HIT_SOURCE = CacheHitSource.HOST
        except ImportError:  # older vLLM: keep the base class's default
            pass

KEY_BYTES = 32
CONNECTOR_FORMAT = "ems-vllm-v1"

# ---------------------------------------------------------------------------
# Pure helpers (no vLLM, no torch)
# ---------------------------------------------------------------------------


def block_key(block_hash: object) -> bytes:
    """The emsd key (``bytes`` of 1..32 bytes) of one vLLM block hash.

    - bytes-like (vLLM >= 0.11: ``BlockHash`` is a ``bytes`` NewType; SHA-256
      digests are 32 bytes, xxhash 8 or 16): the bytes themselves when they
      are 1..32 bytes, else their SHA-256 digest;
    - ``int`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, Python ``hash()``):
      8 little-endian bytes, two's complement, when it lies in the signed or
      unsigned 64-bit range, else the SHA-256 digest of its decimal text;
    - an object with ``hash_value`` (vLLM <= 0.10's ``BlockHash`` tuple): its
      ``hash_value`` converted as above.

    Equal hashes give equal keys, in every process. Raises ``TypeError`` for
    anything else (``bool`` included).
    """
    if isinstance(block_hash, bytes | bytearray | memoryview):
        raw = bytes(block_hash)
        return raw if 0 < len(raw) <= KEY_BYTES else hashlib.sha256(raw).digest()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        if -(2**63) <= block_hash < 2**64:
            return (block_hash % 2**64).to_bytes(8, "little")
        return hashlib.sha256(str(block_hash).encode()).digest()
    value = getattr(block_hash, "hash_value", None)
    if value is not None:
        return block_key(value)
    raise TypeError(f"not a vLLM block hash: {type(block_hash).__name__}")


def kv_block_keys(block_hashes: Sequence[object], ratio: int, start: int, stop: int) -> list[bytes]:
    """Keys of KV blocks ``[start, stop)``.

    ``block_hashes`` are vLLM's hashes at the hash block size, ``ratio`` =
    KV block size / hash block size (>= 1). KV block ``i`` covers hash blocks
    ``[i*ratio, (i+1)*ratio)``; the hashes are chained, so the last one names
    the whole prefix and is the block's key. Requires
    ``0 <= start <= stop <= len(block_hashes) // ratio``.
    """
    if ratio < 1 or not 0 <= start <= stop <= len(block_hashes) // ratio:
        raise ValueError(f"blocks [{start}, {stop}) with ratio {ratio} are out of range "
                         f"for {len(block_hashes)} hashes")
    return [block_key(block_hashes[(i + 1) * ratio - 1]) for i in range(start, stop)]


def lookup_window(num_tokens: int, num_computed_tokens: int, block_size: int,
                  num_hashed_blocks: int) -> tuple[int, int]:
    """KV blocks ``[first, stop)`` worth asking emsd for.

    ``first`` is the first block not already computed locally
    (``num_computed_tokens // block_size``; the scheduler passes a
    block-aligned count). ``stop`` is the end of the last full block of the
    prompt that has a hash: the window may reach the prompt's last token
    (``matched_tokens`` then reports one token fewer). ``stop >= first``
    always.
    """
    first = max(0, num_computed_tokens) // block_size
    stop = min(max(0, num_tokens) // block_size, num_hashed_blocks)
    return first, max(first, stop)


def matched_tokens(hit_blocks: int, block_size: int, min_tokens: int, room: int) -> int:
    """Tokens to report for ``hit_blocks`` leading hits when at most ``room``
    tokens may come from outside (``num_tokens - 1`` minus the tokens computed
    locally: vLLM computes at least the last token): ``hit_blocks * block_size``
    capped at ``room``, or 0 when that is 0 or below ``min_tokens`` (not worth a
    load)."""
    tokens = min(max(0, hit_blocks) * block_size, max(0, room))
    return tokens if tokens > 0 and tokens >= min_tokens else 0


def blocks_to_load(external_tokens: int, block_size: int) -> int:
    """Blocks holding ``external_tokens`` tokens reported by ``matched_tokens``
    (rounded up: a match capped one token short of the prompt loads its last
    block whole)."""
    return -(-max(0, external_tokens) // block_size)


def full_blocks(num_tokens_with_kv: int, block_size: int, num_hashed_blocks: int) -> int:
    """How many leading KV blocks are complete (all their tokens' KV written) and hashed."""
    return max(0, min(num_tokens_with_kv // block_size, num_hashed_blocks))


_MODEL_ID_RE = re.compile(r"[^0-9a-z._@-]+")
MAX_MODEL_BASE = 200


def sanitize_model_id(name: str) -> str:
    """``name`` reduced to ``[0-9a-z._@-]`` (lowercase; other runs become ``-``),
    at most 200 characters (the tail is kept); ``"model"`` if nothing is left.

    A local directory (``/models/Llama-3-8B/``) gives its last component, so
    nodes holding the same model at different paths share blocks.
    """
    text = name.strip().rstrip("/")
    if text.startswith(("/", "./", "../", "~")):
        text = os.path.basename(text)
    text = _MODEL_ID_RE.sub("-", text.lower()).strip("-.")
    return text[-MAX_MODEL_BASE:].strip("-.") or "model"


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> str:
    """16 hex characters of SHA-256 over the canonical JSON of ``fingerprint``."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def namespace_model_id(base: str, fingerprint: Mapping[str, Any]) -> str:
    """The ``CcConfig.model_id`` of a deployment: ``<sanitized base>.kv-<digest>``."""
    return f"{sanitize_model_id(base)}.kv-{fingerprint_digest(fingerprint)}"


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, checked (see the module docstring for each key)."""

    model_id: str | None = None
    namespace: str | None = None
    access_id: str | None = None
    access_key: str | None = None
    min_reuse_tokens: int | None = None  # None: one block
    lookup_timeout_ms: int = 500
    load_timeout_ms: int = 5000
    save_timeout_ms: int = 5000
    retry_interval_s: float = 5.0
    max_inflight_saves: int = 8
    save_decode_blocks: bool = True
    keep_kv_load_failure_policy: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse the extra config; ``ValueError`` names an unknown key or a bad value."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"EmsStoreConnector: unknown kv_connector_extra_config key(s) "
                             f"{unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name in ("model_id", "namespace", "access_id", "access_key"):
            if extra.get(name) is not None:
                if not isinstance(extra[name], str) or not extra[name]:
                    raise ValueError(f"EmsStoreConnector: {name} must be a non-empty string")
                values[name] = extra[name]
        for name in ("min_reuse_tokens", "lookup_timeout_ms", "load_timeout_ms", "save_timeout_ms",
                     "max_inflight_saves"):
            if extra.get(name) is not None:
                v = extra[name]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"EmsStoreConnector: {name} must be an int >= 0, got {v!r}")
                values[name] = v
        if extra.get("retry_interval_s") is not None:
            v = extra["retry_interval_s"]
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"EmsStoreConnector: retry_interval_s must be a number > 0, got {v!r}")
            values["retry_interval_s"] = float(v)
        for name in ("save_decode_blocks", "keep_kv_load_failure_policy"):
            if extra.get(name) is not None:
                if not isinstance(extra[name], bool):
                    raise ValueError(f"EmsStoreConnector: {name} must be true or false")
                values[name] = extra[name]
        if "access_key" not in values and os.environ.get("EMS_ACCESS_KEY"):
            values["access_key"] = os.environ["EMS_ACCESS_KEY"]
        return cls(**values)

    def min_tokens(self, block_size: int) -> int:
        """The smallest match worth loading, in tokens."""
        return block_size if self.min_reuse_tokens is None else self.min_reuse_tokens


# ---------------------------------------------------------------------------
# Metadata (scheduler -> workers; pickled by vLLM)
# ---------------------------------------------------------------------------


@dataclass
class BlockJob:
    """KV blocks of one request: ``block_ids[j]`` holds the block keyed ``keys[j]``."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class EmsConnectorMetadata(_MetadataBase):
    """One step's work: blocks to load before the forward, blocks to save after it,
    requests preempted in this step (their in-flight saves are waited for)."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------
# The SDK connection, failing open
# ---------------------------------------------------------------------------

_FATAL_FOR_LINK = {EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT, EmsErrorCode.EMS_RECOVERD_ERROR}
_configs: dict[tuple[Any, ...], EmsConfig] = {}
_configs_lock = threading.Lock()


def _shared_config(cc: CcConfig_v1, access_id: str | None, access_key: str | None) -> EmsConfig:
    """One ``EmsConfig`` object per distinct config in this process.

    ``Ems`` is process-wide and ``Ems.init`` is a no-op for the config object
    it is connected with; a scheduler and a worker in one process (one GPU,
    no multiprocessing) with equal configs must not reconnect each other.
    """
    key = (repr(cc), access_id, access_key)
    with _configs_lock:
        config = _configs.get(key)
        if config is None:
            config = _configs[key] = EmsConfig(access_id=access_id, access_key=access_key, cc_config=cc)
        return config


class EmsLink:
    """The ``ContextCaching`` of one connector while emsd is usable, else ``None``.

    ``cc()`` never blocks. ``failed(exc)`` marks emsd unusable and starts a
    background thread that calls ``Ems.init`` and ``Ems.check_health`` every
    ``retry_interval`` seconds until both succeed (then ``on_connect(cc)``,
    e.g. registering the KV cache, and the link is usable again). The first
    connection is tried in the constructor (bounded by the SDK's connect and
    health-check timeouts, 2 s and 0.5 s).
    """

    def __init__(self, config: EmsConfig, retry_interval: float, what: str,
                 on_connect: Callable[[ContextCaching], None] | None = None) -> None:
        self._config = config
        self._retry = retry_interval
        self._what = what
        self._on_connect = on_connect
        self._cc: ContextCaching | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._connect():
            log.info("EmsStoreConnector %s: connected to emsd", what)
        elif not self._stop.is_set():
            log.warning("EmsStoreConnector %s: emsd not reachable (socket dir %s); running without "
                        "it, retrying every %.1f s", what, os.environ.get("EMS_SOCKET_DIR", "/dev/shm/ems"),
                        retry_interval)
            self._start_retry()

    def cc(self) -> ContextCaching | None:
        """The SDK object to call, or ``None`` while emsd is unusable."""
        return self._cc

    def failed(self, exc: BaseException) -> None:
        """Mark emsd unusable after ``exc``; calls go back to it once it reconnects."""
        with self._lock:
            if self._cc is None:
                return
            self._cc = None
        log.warning("EmsStoreConnector %s: emsd unusable (%s); recomputing, reconnecting every %.1f s",
                    self._what, exc, self._retry)
        self._start_retry()

    def close(self) -> None:
        """Stop reconnecting; ``cc()`` returns ``None`` from now on."""
        self._stop.set()
        self._cc = None

    def _connect(self) -> bool:
        try:
            Ems.init(self._config)  # a no-op while the old connection looks fine (e.g. after a timeout)
            cc = Ems.get_cc()
            if cc is None:
                raise EmsException(EmsErrorCode.EMS_IO_ERROR, "Ems.get_cc() returned None after init")
            if not Ems.check_health():  # so a hung daemon is not taken back into use
                raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "emsd does not answer PING")
            if self._on_connect is not None:
                self._on_connect(cc)
        except EmsException as exc:
            if exc.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT:  # will not get better
                log.error("EmsStoreConnector %s: emsd refused this configuration (%s); running "
                          "without emsd", self._what, exc.message())
                self.close()
            else:
                log.debug("EmsStoreConnector %s: connecting to emsd failed: %s", self._what, exc)
            return False
        except OSError as exc:
            log.debug("EmsStoreConnector %s: connecting to emsd failed: %s", self._what, exc)
            return False
        if self._stop.is_set():
            return False
        self._cc = cc
        return True

    def _start_retry(self) -> None:
        with self._lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._retry_loop, daemon=True,
                                            name=f"ems-connector-retry-{self._what}")
            self._thread.start()

    def _retry_loop(self) -> None:
        while not self._stop.wait(self._retry):
            if self._connect():
                log.info("EmsStoreConnector %s: connected to emsd", self._what)
                return


def _note_error(link: EmsLink | None, exc: BaseException, what: str) -> None:
    """Log an SDK error; I/O errors and timeouts take emsd out of use until it reconnects."""
    if isinstance(exc, EmsException) and exc.status_code() in _FATAL_FOR_LINK:
        if link is not None:
            link.failed(exc)
    else:
        log.error("EmsStoreConnector: %s failed: %r (treated as a miss)", what, exc)


# ---------------------------------------------------------------------------
# Geometry shared by both sides (needs vLLM objects, duck-typed)
# ---------------------------------------------------------------------------


class UnsupportedConfig(Exception):
    """The engine configuration cannot use this connector; it then does nothing."""


@dataclass(frozen=True)
class Geometry:
    """What both sides agree on: block size, hash ratio, layers, namespace."""

    block_size: int
    ratio: int
    num_blocks: int
    layer_names: tuple[str, ...]
    model_id: str
    kvcache_type: KVCacheType
    tp_size: int
    pp_size: int

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> Geometry:
        """Read the geometry; ``UnsupportedConfig`` says why the connector cannot work."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if len(groups) != 1:
            raise UnsupportedConfig(f"{len(groups)} KV cache groups (one full-attention group is supported)")
        spec = groups[0].kv_cache_spec
        kind = type(spec).__name__
        if kind not in ("FullAttentionSpec", "MLAAttentionSpec"):
            raise UnsupportedConfig(f"KV cache spec {kind} (full attention only)")
        parallel = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(parallel, name, 1) or 1) != 1:
                raise UnsupportedConfig(f"{name} > 1")
        block_size = int(spec.block_size)
        hash_bs = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
        if hash_bs <= 0 or block_size % hash_bs:
            raise UnsupportedConfig(f"hash block size {hash_bs} does not divide block size {block_size}")
        cache = vllm_config.cache_config
        model = vllm_config.model_config
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cache, "kv_cache_layout", None)
        fingerprint = {
            "format": CONNECTOR_FORMAT,
            "vllm": _vllm_minor(),
            "device": str(getattr(vllm_config.device_config, "device_type", "")),
            "layout": layout,
            "spec": kind,
            "block_size": block_size,
            "hash_block_size": hash_bs,
            "hash_algo": getattr(cache, "prefix_caching_hash_algo", None),
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "kv_dtype": str(getattr(spec, "dtype", "")),
            "cache_dtype": str(getattr(cache, "cache_dtype", "")),
            "page_bytes": getattr(spec, "page_size_bytes", None),
            "layers": len(groups[0].layer_names),
            "model_dtype": str(getattr(model, "dtype", "")),
            "quantization": getattr(model, "quantization", None),
            "revision": getattr(model, "revision", None),
        }
        if settings.namespace is not None:
            model_id = settings.namespace
        else:
            served = getattr(model, "served_model_name", None)
            if isinstance(served, list | tuple):
                served = served[0] if served else None
            base = settings.model_id or served or getattr(model, "model", None) or "model"
            model_id = namespace_model_id(str(base), fingerprint)
        return cls(
            block_size=block_size,
            ratio=block_size // hash_bs,
            num_blocks=int(kv_cache_config.num_blocks),
            layer_names=tuple(groups[0].layer_names),
            model_id=model_id,
            kvcache_type=_kvcache_type(model, kind),
            tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
            pp_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
        )

    def cc_config(self, tp_rank: int, pp_rank: int) -> CcConfig_v1:
        """This rank's SDK config (``EMS_INVALID_ARGUMENT`` if ``namespace`` breaks the alphabet)."""
        rank = pp_rank * self.tp_size + tp_rank
        return CcConfig_v1(rank_id=rank, device_id=rank, model_id=self.model_id,
                           tp_world_size=self.tp_size, pp_world_size=self.pp_size,
                           rank_in_tp_group=tp_rank, rank_in_pp_group=pp_rank,
                           llm_engine="vllm", kvcache_type=self.kvcache_type)


def _vllm_minor() -> str:
    try:
        import vllm

        return ".".join(str(vllm.__version__).split(".")[:2])
    except Exception:  # noqa: BLE001 - a version string is informative only
        return "unknown"


def _kvcache_type(model_config: Any, spec_kind: str) -> KVCacheType:
    if spec_kind == "MLAAttentionSpec" or getattr(model_config, "use_mla", False):
        return KVCacheType.MLA
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    heads = getattr(hf, "num_attention_heads", None)
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads:
        return KVCacheType.MHA
    return KVCacheType.MQA if kv_heads == 1 else KVCacheType.GQA


# ---------------------------------------------------------------------------
# Scheduler side
# ---------------------------------------------------------------------------


@dataclass
class _Tracked:
    """Scheduler-side state of one request between allocation and finish."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # blocks before this one were saved (or are known stored)
    present: tuple[int, int] = (0, 0)  # blocks emsd already holds: not saved again
    load: tuple[int, int] | None = None  # blocks to load at the next build_connector_meta
    had_save: bool = False  # a save job went to the workers: free late (request_finished)


@contextlib.contextmanager
def _timed(stats: dict[str, int], key: str) -> Iterator[None]:
    """Add the block's wall time, in microseconds, to ``stats[key]`` (however it ends)."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        stats[key] += (time.perf_counter_ns() - start) // 1000


class SchedulerSide:
    """Lookups and the per-step plan; runs in vLLM's scheduler (engine core) process."""

    def __init__(self, geometry: Geometry, settings: ConnectorSettings, link: EmsLink | None) -> None:
        self.geo = geometry
        self.settings = settings
        self.link = link
        self._min_tokens = settings.min_tokens(geometry.block_size)
        self._lookup_opt = CcKvOption(timeout=settings.lookup_timeout_ms)
        self._lookups: dict[str, tuple[int, int]] = {}  # req_id -> (first block, hits)
        self._tracked: dict[str, _Tracked] = {}
        self.stats = {"lookups": 0, "hit_blocks": 0, "matched_tokens": 0, "lookup_us": 0}

    def _keys(self, request: Any, start: int, stop: int) -> list[bytes]:
        return kv_block_keys(request.block_hashes, self.geo.ratio, start, stop)

    def _hashed(self, request: Any) -> int:
        return len(getattr(request, "block_hashes", None) or ()) // self.geo.ratio

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after ``num_computed_tokens`` that emsd can supply (whole blocks, one token
        fewer when they reach the prompt's end), and False. Its wall time is added to
        ``stats["lookup_us"]``."""
        with _timed(self.stats, "lookup_us"):
            return self._matched(request, num_computed_tokens)

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        cc = self.link.cc() if self.link is not None else None
        if cc is None:
            return 0, False
        bs = self.geo.block_size
        first, stop = lookup_window(request.num_tokens, num_computed_tokens, bs, self._hashed(request))
        if stop == first or (stop - first) * bs < self._min_tokens:
            return 0, False
        keys = self._keys(request, first, stop)
        try:
            hits = int(cc.exists(keys, option=self._lookup_opt).success)
        except EmsException as exc:
            _note_error(self.link, exc, "exists")
            return 0, False
        hits = max(0, min(hits, stop - first))
        self.stats["lookups"] += 1
        self._lookups[req_id] = (first, hits)
        tokens = matched_tokens(hits, bs, self._min_tokens, request.num_tokens - 1 - first * bs)
        if tokens:
            self.stats["hit_blocks"] += hits
            self.stats["matched_tokens"] += tokens
            log.info("EmsStoreConnector: request %s: %d tokens (%d blocks) found in emsd after %d "
                     "computed, of %d", req_id, tokens, hits, num_computed_tokens, request.num_tokens)
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request and, when ``num_external_tokens > 0``, the blocks to load."""
        req_id = request.request_id
        first, hits = self._lookups.pop(req_id, (0, 0))
        old = self._tracked.get(req_id)  # a resumed (preempted) request starts over, but
        t = _Tracked(request=request, present=(first, first + hits),  # the workers still
                     had_save=old is not None and old.had_save)  # expect its finished_sending
        try:
            t.block_ids = list(blocks.get_block_ids()[0])
        except (AttributeError, IndexError, TypeError):
            t.block_ids = []
        if num_external_tokens > 0:
            n = blocks_to_load(num_external_tokens, self.geo.block_size)
            t.load = (first, first + min(n, hits))
        self._tracked[req_id] = t

    def build_connector_meta(self, scheduler_output: Any) -> EmsConnectorMetadata:
        """Loads planned at allocation, saves of blocks that become full in this step."""
        meta = EmsConnectorMetadata()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            t = self._tracked.get(req_id)
            if t is not None:  # its blocks are gone; resumption re-plans from scratch
                t.block_ids, t.load, t.next_save = [], None, 0
        scheduled = scheduler_output.num_scheduled_tokens
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        for new in scheduler_output.scheduled_new_reqs:
            self._plan(meta, new.req_id, new.num_computed_tokens, scheduled, spec, state,
                       list(new.block_ids[0]) if new.block_ids else [], replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            self._plan(meta, req_id, cached.num_computed_tokens[i], scheduled, spec, state,
                       list(new_ids[0]) if new_ids else [], replace=req_id in resumed)
        return meta

    def _plan(self, meta: EmsConnectorMetadata, req_id: str, computed: int, scheduled: Mapping[str, int],
              spec: Mapping[str, Any], state: Any, new_ids: list[int], replace: bool) -> None:
        t = self._tracked.get(req_id)
        if t is None:
            return
        ids = None
        if state is not None:
            try:
                got = state.get_block_ids(req_id)
                ids = list(got[0]) if got else None
            except Exception:  # noqa: BLE001 - fall back to the ids tracked from the diffs
                ids = None
        if ids is None:
            ids = new_ids if replace else t.block_ids + new_ids
        t.block_ids = ids
        request = t.request
        if t.load is not None:
            start, stop = t.load
            t.load = None
            if stop <= len(ids):
                meta.loads.append(BlockJob(req_id, ids[start:stop], self._keys(request, start, stop)))
            else:  # cannot happen (vLLM allocated them); fail what exists so it is recomputed
                log.error("EmsStoreConnector: request %s has %d blocks, load planned for [%d, %d)",
                          req_id, len(ids), start, stop)
                meta.loads.append(BlockJob(req_id, ids[start:], []))
        with_kv = computed + int(scheduled.get(req_id, 0)) - len(spec.get(req_id, ()) or ())
        limit = full_blocks(with_kv, self.geo.block_size, self._hashed(request))
        if not self.settings.save_decode_blocks:
            prompt = int(getattr(request, "num_prompt_tokens", with_kv))
            limit = min(limit, prompt // self.geo.block_size)
        limit = min(limit, len(ids))
        if limit <= t.next_save:
            return
        lo, hi = t.present
        todo = [i for i in range(t.next_save, limit) if not lo <= i < hi]
        t.next_save = limit
        if todo:
            keys = [block_key(request.block_hashes[(i + 1) * self.geo.ratio - 1]) for i in todo]
            meta.saves.append(BlockJob(req_id, [ids[i] for i in todo], keys))
            t.had_save = True

    def reset_cache(self) -> bool:
        """Drop every rank's namespace of this model in emsd (``ContextCaching.clear``, on
        every member of a cluster): vLLM's ``reset_prefix_cache(reset_connector=True)``,
        e.g. after a weight update. True once all were confirmed; False with emsd out
        of use or after a failure (logged), and then stored blocks may still load."""
        cc = self.link.cc() if self.link is not None else None
        if cc is None:
            log.warning("EmsStoreConnector: reset_cache with emsd out of use; nothing dropped")
            return False
        dropped = 0
        try:
            for pp in range(self.geo.pp_size):
                for tp in range(self.geo.tp_size):
                    config = _shared_config(self.geo.cc_config(tp, pp), self.settings.access_id,
                                            self.settings.access_key)
                    rank = ContextCaching(Ems._current_client, config.validate(), config.access_id,
                                          Profiler.from_env())
                    try:
                        dropped += rank.clear(CcKvOption(timeout=self.settings.save_timeout_ms))
                    finally:
                        rank.close()
        except Exception as exc:  # noqa: BLE001 - reported to vLLM as a failed reset
            log.error("EmsStoreConnector: reset_cache failed, stored blocks may still load: %r", exc)
            return False
        log.info("EmsStoreConnector: reset_cache dropped %s (%d ranks, %d blocks on this node)",
                 self.geo.model_id, self.geo.tp_size * self.geo.pp_size, dropped)
        return True

    def fallback_meta(self) -> EmsConnectorMetadata:
        """Metadata after ``build_connector_meta`` failed: no saves, and every planned load
        as a job without keys, which the workers report failed (vLLM recomputes)."""
        meta = EmsConnectorMetadata()
        for req_id, t in self._tracked.items():
            if t.load is not None:
                start, stop = t.load
                t.load = None
                meta.loads.append(BlockJob(req_id, t.block_ids[start:stop], []))
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``(True, None)`` when save jobs were sent for the request: the workers report
        it in ``finished_sending`` once those saves are done, then vLLM frees its blocks."""
        self._lookups.pop(request.request_id, None)
        t = self._tracked.pop(request.request_id, None)
        return (t is not None and t.had_save), None


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


def block_views(tensor: Any, num_blocks: int) -> list[Any]:
    """Views of one layer's KV cache as ``[num_blocks, 1, piece_bytes]`` uint8 tensors.

    ``tensor`` has the blocks in dimension 0 (``num_blocks`` or a multiple:
    kernel blocks), or is ``[2, num_blocks, ...]`` (K and V apart). A block's
    bytes are split at the outermost dimensions after the block dimension
    until every piece is contiguous, so any stride order works; the pieces
    come in index order, identical in every process with the same layout.
    Raises ``UnsupportedConfig`` when a block's innermost dimension is not
    contiguous.
    """
    import torch

    parts = [tensor]
    if tensor.shape[0] % num_blocks:
        if tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] % num_blocks == 0:
            parts = [tensor[0], tensor[1]]
        else:
            raise UnsupportedConfig(f"KV cache tensor of shape {tuple(tensor.shape)} has no "
                                    f"block dimension of {num_blocks}")
    views = []
    for part in parts:
        t = part.unflatten(0, (num_blocks, -1)) if part.shape[0] != num_blocks else part
        if t.dim() == 1:
            t = t.unsqueeze(1)
        shape, stride = list(t.shape[1:]), list(t.stride()[1:])
        elem = t.element_size()
        if _dense(shape, stride):  # a block is one run of memory, in whatever dimension order
            k, expected = 0, 1
            for n in shape:
                expected *= n
        else:
            k = len(shape)  # dims [k:] of a block are dense (C order)
            expected = 1
            while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == expected):
                expected *= shape[k - 1]
                k -= 1
            if k == len(shape):
                raise UnsupportedConfig(f"KV cache tensor of shape {tuple(t.shape)} and strides "
                                        f"{tuple(t.stride())} has no contiguous inner dimension")
        row = expected * elem
        storage = t.untyped_storage()
        outer = [range(n) for n in shape[:k]]
        for idx in _product(outer):
            offset = (t.storage_offset() + sum(i * s for i, s in zip(idx, stride, strict=False))) * elem
            view = torch.empty(0, dtype=torch.uint8, device=t.device)
            view.set_(storage, offset, (num_blocks, 1, row), (t.stride(0) * elem, row, 1))
            views.append(view)
    return views


def _dense(shape: list[int], stride: list[int]) -> bool:
    """Whether dimensions of these sizes and (element) strides tile one gap-free run."""
    expected = 1
    dims = sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz != 1)
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


class WorkerSide:
    """Loads and saves; runs in each vLLM worker process, on its KV cache."""

    def __init__(self, geometry: Geometry, settings: ConnectorSettings,
                 link_factory: Callable[[Callable[[ContextCaching], None]], EmsLink]) -> None:
        self.geo = geometry
        self.settings = settings
        self._link_factory = link_factory
        self.link: EmsLink | None = None
        self._kv: list[list[Any]] | None = None
        self._device = "cpu"
        self._load_opt = CcKvOption(timeout=settings.load_timeout_ms)
        self._save_opt = CcKvOption(timeout=settings.save_timeout_ms)
        self._inflight: dict[str, list[tuple[ContextCaching, CcFuture, int]]] = {}
        self._had_save: set[str] = set()
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        # *_us: wall time in the hooks on the step's path (loads copied, saves only issued)
        self.stats = {"loaded_blocks": 0, "load_failed_blocks": 0, "saved_blocks": 0,
                      "save_failed_blocks": 0, "save_dropped_blocks": 0, "load_us": 0, "save_issue_us": 0}

    # -- registration -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """View every layer's cache per block and register it with the SDK (on each connect)."""
        layers = []
        for name in self.geo.layer_names:
            if name not in kv_caches:
                raise UnsupportedConfig(f"no KV cache tensor for layer {name}")
            layers.append(block_views(kv_caches[name], self.geo.num_blocks))
        self._kv = layers
        self._device = str(layers[0][0].device.type)
        per_block = sum(int(v.shape[2]) for layer in layers for v in layer)
        log.info("EmsStoreConnector worker: %d layers, %d pieces, %d bytes per block, namespace model_id %s",
                 len(layers), sum(len(x) for x in layers), per_block, self.geo.model_id)
        self.link = self._link_factory(self._register)

    def _register(self, cc: ContextCaching) -> None:
        cc.register_kvcache(self._kv)

    # -- loads -----------------------------------------------------------------------

    def start_load_kv(self, meta: EmsConnectorMetadata) -> None:
        """Copy this step's matched blocks into the KV cache; failures go to ``_load_errors``.
        Its wall time is added to ``stats["load_us"]``."""
        if not meta.loads:
            return
        with _timed(self.stats, "load_us"):
            self._load(meta)

    def _load(self, meta: EmsConnectorMetadata) -> None:
        cc = self.link.cc() if self.link is not None else None
        if cc is None:
            for job in meta.loads:
                self._fail_load(job, 0, "emsd unusable")
            return
        pending = []
        for job in meta.loads:
            if not job.keys:
                self._fail_load(job, 0, "no keys planned")
                continue
            try:
                fut = cc.async_load(job.block_ids, hashes=job.keys, offsets=[1] * len(job.keys),
                                    option=self._load_opt)
            except EmsException as exc:
                _note_error(self.link, exc, "async_load")
                self._fail_load(job, 0, str(exc))
                continue
            pending.append((job, fut))
        for job, fut in pending:
            try:
                ok = int(cc.get_result(fut).success)
            except EmsException as exc:
                _note_error(self.link, exc, "load")
                self._fail_load(job, 0, str(exc))
                continue
            self.stats["loaded_blocks"] += ok
            if ok < len(job.keys):
                self._fail_load(job, ok, "missing or of another size in emsd")
            else:
                log.debug("EmsStoreConnector: loaded %d blocks for %s", ok, job.req_id)

    def _fail_load(self, job: BlockJob, ok: int, why: str) -> None:
        failed = job.block_ids[ok:]
        self._load_errors.update(failed)
        self.stats["load_failed_blocks"] += len(failed)
        log.warning("EmsStoreConnector: request %s: loaded %d of %d blocks (%s); vLLM recomputes the rest",
                    job.req_id, ok, len(job.keys), why)

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------

    def wait_for_save(self, meta: EmsConnectorMetadata) -> None:
        """Issue this step's saves (``async_save``); never waits for emsd. Its wall time is
        added to ``stats["save_issue_us"]`` (the copies run after it, on the SDK's thread)."""
        if not meta.saves:
            return
        with _timed(self.stats, "save_issue_us"):
            self._issue_saves(meta)

    def _issue_saves(self, meta: EmsConnectorMetadata) -> None:
        for job in meta.saves:
            self._had_save.add(job.req_id)
        cc = self.link.cc() if self.link is not None else None
        if cc is None:
            self.stats["save_dropped_blocks"] += sum(len(j.keys) for j in meta.saves)
            return
        if self._device == "cuda":  # the forward's kernels must be done before a copy thread reads
            import torch

            torch.cuda.synchronize()
        self._poll()
        for job in meta.saves:
            if self._inflight_count() >= self.settings.max_inflight_saves:
                self.stats["save_dropped_blocks"] += len(job.keys)
                log.debug("EmsStoreConnector: %d saves in flight; dropping %d blocks of %s",
                          self._inflight_count(), len(job.keys), job.req_id)
                continue
            try:
                fut = cc.async_save(job.block_ids, hashes=job.keys, offsets=[1] * len(job.keys),
                                    option=self._save_opt)
            except EmsException as exc:
                _note_error(self.link, exc, "async_save")
                self.stats["save_dropped_blocks"] += len(job.keys)
                continue
            self._inflight.setdefault(job.req_id, []).append((cc, fut, len(job.keys)))

    def _inflight_count(self) -> int:
        return sum(len(v) for v in self._inflight.values())

    def _collect(self, cc: ContextCaching, fut: CcFuture, n: int) -> None:
        try:
            ok = int(cc.get_result(fut).success)
        except EmsException as exc:
            _note_error(self.link, exc, "save")
            ok = 0
        self.stats["saved_blocks"] += ok
        self.stats["save_failed_blocks"] += n - ok

    def _poll(self) -> None:
        """Collect finished saves (``is_ready``; never blocks)."""
        for req_id in list(self._inflight):
            left = []
            for cc, fut, n in self._inflight[req_id]:
                if cc.is_ready(fut):
                    self._collect(cc, fut, n)
                else:
                    left.append((cc, fut, n))
            if left:
                self._inflight[req_id] = left
            else:
                del self._inflight[req_id]

    def drain(self, req_ids: Iterable[str] | None = None) -> None:
        """Wait for the in-flight saves of ``req_ids`` (all when ``None``); each is bounded
        by ``save_timeout_ms``."""
        for req_id in list(self._inflight if req_ids is None else req_ids):
            for cc, fut, n in self._inflight.pop(req_id, []):
                self._collect(cc, fut, n)

    def handle_preemptions(self, meta: EmsConnectorMetadata) -> None:
        """Before a preempted request's blocks are reused, finish reading them."""
        if meta.preempted:
            self.drain(meta.preempted & set(self._inflight))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests that had save jobs, once all their saves are done."""
        self._poll()
        self._finishing |= set(finished_req_ids) & self._had_save
        done = {r for r in self._finishing if r not in self._inflight}
        self._finishing -= done
        self._had_save -= done
        return (done or None), None

    def shutdown(self) -> None:
        """Wait for every save in flight (bounded), stop reconnecting, log the totals."""
        self.drain()
        if self.link is not None:
            self.link.close()
        log.info("EmsStoreConnector worker totals: %s", json.dumps(self.stats, sort_keys=True))


# ---------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------


def _is_scheduler(role: Any) -> bool:
    return str(getattr(role, "name", role)).upper().endswith("SCHEDULER")


def _ranks() -> tuple[int, int]:
    """(rank in the TP group, rank in the PP group) of this worker."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (tests, single process): rank 0
        return 0, 0


class EmsStoreConnector(_ConnectorBase):
    """vLLM v1 KV connector backed by emsd; see the module docstring for the contract."""

    if _HIT_SOURCE is not None:
        _cache_hit_source = _HIT_SOURCE

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        if _VLLM_IMPORT_ERROR is not None:
            raise ImportError("EmsStoreConnector needs vLLM (>= 0.32) installed in this "
                              f"environment: {_VLLM_IMPORT_ERROR}") from _VLLM_IMPORT_ERROR
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._disabled_load_errors: set[int] = set()
        self._is_sched = _is_scheduler(role)
        try:
            geometry = Geometry.from_vllm(vllm_config, kv_cache_config, self._settings)
        except UnsupportedConfig as exc:
            log.warning("EmsStoreConnector disabled: %s; the engine runs without emsd", exc)
            return
        settings = self._settings
        if self._is_sched:
            self._keep_or_set_failure_policy()
            _warn_unstable_hashes(vllm_config)
            config = _shared_config(geometry.cc_config(0, 0), settings.access_id, settings.access_key)
            link = EmsLink(config, settings.retry_interval_s, "scheduler")
            self._scheduler = SchedulerSide(geometry, settings, link)
            log.info("EmsStoreConnector scheduler: namespace model_id %s, block %d tokens, "
                     "min reuse %d tokens", geometry.model_id, geometry.block_size,
                     settings.min_tokens(geometry.block_size))
        else:
            tp_rank, pp_rank = _ranks()
            config = _shared_config(geometry.cc_config(tp_rank, pp_rank), settings.access_id,
                                    settings.access_key)

            def make_link(on_connect: Callable[[ContextCaching], None]) -> EmsLink:
                return EmsLink(config, settings.retry_interval_s, f"worker tp{tp_rank} pp{pp_rank}",
                               on_connect)

            self._worker = WorkerSide(geometry, settings, make_link)

    def _keep_or_set_failure_policy(self) -> None:
        cfg = self._kv_transfer_config
        if getattr(cfg, "kv_load_failure_policy", "recompute") == "recompute":
            return
        if self._settings.keep_kv_load_failure_policy:
            log.warning("EmsStoreConnector: kv_load_failure_policy=%r: a block evicted or lost between "
                        "lookup and load fails its request", cfg.kv_load_failure_policy)
            return
        try:
            cfg.kv_load_failure_policy = "recompute"
            log.info("EmsStoreConnector: kv_load_failure_policy set to 'recompute' (emsd is a cache: "
                     "a failed load is recomputed; keep_kv_load_failure_policy=true keeps 'fail')")
        except Exception as exc:  # noqa: BLE001 - a frozen config: warn instead
            log.warning("EmsStoreConnector: could not set kv_load_failure_policy to 'recompute' (%s); "
                        "pass \"kv_load_failure_policy\":\"recompute\" in --kv-transfer-config", exc)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a later miss, never a lost result."""
        return False

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is None:
            return
        try:
            self._worker.register_kv_caches(kv_caches)
        except UnsupportedConfig as exc:
            log.warning("EmsStoreConnector disabled on this worker: %s", exc)
        except Exception:  # noqa: BLE001 - never stop the engine for the cache
            log.exception("EmsStoreConnector: registering the KV cache failed; worker runs without emsd")

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, EmsConnectorMetadata):
            try:
                self._worker.handle_preemptions(kv_connector_metadata)
            except Exception:  # noqa: BLE001
                log.exception("EmsStoreConnector: handle_preemptions failed")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            meta = self._connector_metadata
            if isinstance(meta, EmsConnectorMetadata) and meta.loads and not self._is_sched:
                self._report_all_loads_failed(meta)
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, EmsConnectorMetadata):
            return
        try:
            self._worker.start_load_kv(meta)
        except Exception:  # noqa: BLE001 - report the loads failed: vLLM recomputes
            log.exception("EmsStoreConnector: start_load_kv failed")
            self._report_all_loads_failed(meta)

    def _report_all_loads_failed(self, meta: EmsConnectorMetadata) -> None:
        if self._worker is not None:
            for job in meta.loads:
                self._worker._fail_load(job, 0, "connector error")
        else:
            for job in meta.loads:
                self._disabled_load_errors.update(job.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are issued per step in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, EmsConnectorMetadata):
            try:
                self._worker.wait_for_save(meta)
            except Exception:  # noqa: BLE001 - a lost save is a later miss
                log.exception("EmsStoreConnector: wait_for_save failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        try:
            return self._worker.get_finished(finished_req_ids)
        except Exception:  # noqa: BLE001 - release the requests rather than hold blocks forever
            log.exception("EmsStoreConnector: get_finished failed")
            done = set(finished_req_ids) & self._worker._had_save
            self._worker._had_save -= done
            return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is not None:
            return self._worker.take_load_errors()
        errors, self._disabled_load_errors = self._disabled_load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception:  # noqa: BLE001
                log.exception("EmsStoreConnector: shutdown failed")
        if self._scheduler is not None:
            totals = json.dumps(self._scheduler.stats, sort_keys=True)
            log.info("EmsStoreConnector scheduler totals: %s", totals)
            if self._scheduler.link is not None:
                self._scheduler.link.close()

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - a miss
            log.exception("EmsStoreConnector: lookup failed")
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001 - the load then fails on the worker: recompute
            log.exception("EmsStoreConnector: update_state_after_alloc failed")

    def build_connector_meta(self, scheduler_output: Any) -> EmsConnectorMetadata:
        if self._scheduler is None:
            return EmsConnectorMetadata()
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001 - nothing saved; planned loads fail: recompute
            log.exception("EmsStoreConnector: build_connector_meta failed")
            return self._scheduler.fallback_meta()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update):
        drop this model's blocks in emsd (``SchedulerSide.reset_cache``); None off the scheduler."""
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any layout: blocks are copied whole, the layout is in the namespace


def _warn_unstable_hashes(vllm_config: Any) -> None:
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        log.warning("EmsStoreConnector: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives "
                    "per-process block hashes: blocks saved by one engine are never found by another. "
                    "Set PYTHONHASHSEED to one value on every engine, or use sha256.", algo)
