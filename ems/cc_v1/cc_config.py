"""``CcConfig_v1``: who this process is inside one inference instance.

A context-caching config names the model (``model_id``), the engine, the
KV-cache type and this rank's place in the instance's tensor-parallel (TP)
and pipeline-parallel (PP) grid. The namespace that keeps blocks of different
models, engines and shards apart is derived from it (``ems.namespace``).

Every field is checked in the constructor; a bad value raises
``EmsException(EMS_INVALID_ARGUMENT)`` whose message names the field and the
rule. A config is immutable once built: its fields are read-only properties,
so a namespace computed from it can never go stale.

Interpretations where the published API is silent:

- "ranks of the instance" is ``tp_world_size * pp_world_size``: one inference
  instance spans one TP x PP grid (data-parallel replicas are separate
  instances), so ``rank_id`` must lie in ``[0, tp_world_size *
  pp_world_size)``. ``rank_id`` is not required to equal any particular
  combination of ``rank_in_tp_group`` and ``rank_in_pp_group``: engines number
  their ranks differently.
- ``device_id`` must be ``>= 0``; its upper bound (the ranks on this node)
  cannot be known from the config, so it is not checked here.
- Integer fields take ``int`` or numpy integers, never ``bool``.
- ``kvcache_type`` takes a ``KVCacheType`` or its exact string value
  (``"MHA"``, ``"GQA"``, ``"MQA"``, ``"MLA"``; case-sensitive).
- ``llm_engine`` follows the ``model_id`` alphabet, ``[0-9a-z._@-]``, 1-64
  characters (``"vllm"``, ``"sglang"``, ``"mindie"``...).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

import numpy as np

from ems.common.exception import invalid

MAX_MODEL_ID = 512
MAX_ENGINE = 64
_NAME_RE = re.compile(r"[0-9a-z._@-]+")


class KVCacheType(StrEnum):
    """How the model lays out its KV cache (attention variant); a ``str`` subclass."""

    MHA = "MHA"  # multi-head attention: K and V per head
    GQA = "GQA"  # grouped-query attention: K and V per group of heads
    MQA = "MQA"  # multi-query attention: one K and V shared by all heads
    MLA = "MLA"  # multi-head latent attention: a compressed latent (1 or 2 tensors)


def _int_field(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else EMS_INVALID_ARGUMENT naming ``name``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise invalid(f"CcConfig_v1: {name} must be an int >= {minimum}, "
                      f"got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise invalid(f"CcConfig_v1: {name} must be an int >= {minimum}, got {value}")
    return value


def check_name(value: Any, owner: str, name: str, max_len: int) -> str:
    """``value`` as a 1..``max_len`` string of ``[0-9a-z._@-]``, else EMS_INVALID_ARGUMENT.

    ``owner`` prefixes the message (the class the field belongs to). The value
    is quoted in the message, so do not use this for secrets.
    """
    if not isinstance(value, str):
        raise invalid(f"{owner}: {name} must be a str of 1-{max_len} characters of "
                      f"[0-9a-z._@-], got {type(value).__name__}")
    if not 1 <= len(value) <= max_len or _NAME_RE.fullmatch(value) is None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise invalid(f"{owner}: {name} must be 1-{max_len} characters of [0-9a-z._@-] "
                      f"(lowercase), got {shown!r} ({len(value)} characters)")
    return value


def _kvcache_type(value: Any) -> KVCacheType:
    if isinstance(value, KVCacheType):
        return value
    if isinstance(value, str):
        try:
            return KVCacheType(value)
        except ValueError:
            pass
    allowed = ", ".join(repr(t.value) for t in KVCacheType)
    raise invalid(f"CcConfig_v1: kvcache_type must be a KVCacheType or one of {allowed}, "
                  f"got {value!r}")


class CcConfig_v1:  # the published name
    """This rank's identity for context caching; immutable, validated on construction.

    ``CcConfig_v1(rank_id, device_id, model_id, tp_world_size=1, pp_world_size=1,
    rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm",
    kvcache_type=KVCacheType.MHA)``

    Rules (each violation raises ``EMS_INVALID_ARGUMENT`` naming the field):

    - ``tp_world_size``, ``pp_world_size``: ints >= 1;
    - ``rank_in_tp_group`` in ``[0, tp_world_size)``, ``rank_in_pp_group`` in
      ``[0, pp_world_size)``;
    - ``rank_id`` in ``[0, tp_world_size * pp_world_size)`` (the ranks of one
      instance, see the module docstring);
    - ``device_id`` >= 0 (the ranks on this node are not known here);
    - ``model_id``: 1-512 characters of ``[0-9a-z._@-]``;
    - ``llm_engine``: 1-64 characters of ``[0-9a-z._@-]``;
    - ``kvcache_type``: a ``KVCacheType`` or its string value.
    """

    __slots__ = ("_device_id", "_kvcache_type", "_llm_engine", "_model_id", "_pp_world_size",
                 "_rank_id", "_rank_in_pp_group", "_rank_in_tp_group", "_tp_world_size")

    def __init__(
        self,
        rank_id: int,
        device_id: int,
        model_id: str,
        tp_world_size: int = 1,
        pp_world_size: int = 1,
        rank_in_tp_group: int = 0,
        rank_in_pp_group: int = 0,
        llm_engine: str = "vllm",
        kvcache_type: KVCacheType | str = KVCacheType.MHA,
    ) -> None:
        tp = _int_field(tp_world_size, "tp_world_size", 1)
        pp = _int_field(pp_world_size, "pp_world_size", 1)
        rank_tp = _int_field(rank_in_tp_group, "rank_in_tp_group", 0)
        if rank_tp >= tp:
            raise invalid(f"CcConfig_v1: rank_in_tp_group must be < tp_world_size ({tp}), "
                          f"got {rank_tp}")
        rank_pp = _int_field(rank_in_pp_group, "rank_in_pp_group", 0)
        if rank_pp >= pp:
            raise invalid(f"CcConfig_v1: rank_in_pp_group must be < pp_world_size ({pp}), "
                          f"got {rank_pp}")
        rank = _int_field(rank_id, "rank_id", 0)
        if rank >= tp * pp:
            raise invalid(f"CcConfig_v1: rank_id must be < tp_world_size * pp_world_size "
                          f"({tp} * {pp} = {tp * pp}, the ranks of the instance), got {rank}")
        self._rank_id = rank
        self._device_id = _int_field(device_id, "device_id", 0)
        self._model_id = check_name(model_id, "CcConfig_v1", "model_id", MAX_MODEL_ID)
        self._tp_world_size = tp
        self._pp_world_size = pp
        self._rank_in_tp_group = rank_tp
        self._rank_in_pp_group = rank_pp
        self._llm_engine = check_name(llm_engine, "CcConfig_v1", "llm_engine", MAX_ENGINE)
        self._kvcache_type = _kvcache_type(kvcache_type)

    # -- read-only fields ---------------------------------------------------------

    @property
    def rank_id(self) -> int:
        return self._rank_id

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def tp_world_size(self) -> int:
        return self._tp_world_size

    @property
    def pp_world_size(self) -> int:
        return self._pp_world_size

    @property
    def rank_in_tp_group(self) -> int:
        return self._rank_in_tp_group

    @property
    def rank_in_pp_group(self) -> int:
        return self._rank_in_pp_group

    @property
    def llm_engine(self) -> str:
        return self._llm_engine

    @property
    def kvcache_type(self) -> KVCacheType:
        return self._kvcache_type

    # -- value semantics ----------------------------------------------------------

    def _fields(self) -> tuple[Any, ...]:
        return (self._rank_id, self._device_id, self._model_id, self._tp_world_size,
                self._pp_world_size, self._rank_in_tp_group, self._rank_in_pp_group,
                self._llm_engine, self._kvcache_type)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcConfig_v1):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (f"CcConfig_v1(rank_id={self._rank_id}, device_id={self._device_id}, "
                f"model_id={self._model_id!r}, tp_world_size={self._tp_world_size}, "
                f"pp_world_size={self._pp_world_size}, "
                f"rank_in_tp_group={self._rank_in_tp_group}, "
                f"rank_in_pp_group={self._rank_in_pp_group}, "
                f"llm_engine={self._llm_engine!r}, kvcache_type={self._kvcache_type.value!r})")


CcConfig = CcConfig_v1
