"""``CcConfig_v1``: who this process is inside one inference instance.

A context-caching config names the model (``model_id``), the engine, the
KV-cache type and this rank's place in the instance's tensor-parallel (TP)
and pipeline-parallel (PP) grid. The namespace that keeps blocks of different
models, engines and shards apart is derived from it (``ems.namespace``).

A config is a plain mutable settings object, as published code uses it: the
vllm-ascend connector builds one and then sets
``cc_config_v1.kvcache_type = KVCacheType.MLA``. Each field is checked when it
is assigned (in the constructor too): a bad value raises
``EmsException(EMS_INVALID_ARGUMENT)`` whose message names the field and the
rule. Rules that tie two fields together (``rank_in_tp_group <
tp_world_size``, ``rank_in_pp_group < pp_world_size``) are checked by
``validate()``, which the constructor and ``Ems.init`` call, so that fields can
be assigned in any order. ``Ems.init`` reads the config once: changing it
afterwards changes nothing until the next ``Ems.init`` with it.

Interpretations where the published API is silent:

- ``rank_id`` is the process's global rank and ``device_id`` its device on
  this node: both any int ``>= 0``. Neither is checked against
  ``tp_world_size * pp_world_size``: with data parallelism an instance has
  more ranks than one TP x PP group (the reference's own first example is
  ``CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")``), and the
  ranks on this node cannot be known from the config.
- Integer fields take ``int`` or numpy integers, never ``bool``.
- ``kvcache_type`` takes a ``KVCacheType`` or its exact string value
  (``"MHA"``, ``"GQA"``, ``"MQA"``, ``"MLA"``; case-sensitive).
- ``llm_engine``: the reference sets no rule but "a string"; the published
  vllm-ascend connector passes ``"vllm@<last two parts of the model path>"``,
  upper case included. Any printable string of 1-256 characters is accepted
  (the bound keeps the namespace name within the daemon's limit).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Generic, TypeVar, cast, overload

import numpy as np

from ems.common.exception import invalid

MAX_MODEL_ID = 512
MAX_ENGINE = 256  # with model_id and access_id, the namespace stays under emsd's 4096
_NAME_RE = re.compile(r"[0-9a-z._@-]+")
T = TypeVar("T")


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


def _check_kvcache_type(value: Any) -> KVCacheType:
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


def _check_model_id(value: Any) -> str:
    return check_name(value, "CcConfig_v1", "model_id", MAX_MODEL_ID)


def _check_llm_engine(value: Any) -> str:
    """Any printable str of 1-``MAX_ENGINE`` characters (the reference sets no alphabet)."""
    rule = f"a printable str of 1-{MAX_ENGINE} characters"
    if not isinstance(value, str):
        raise invalid(f"CcConfig_v1: llm_engine must be {rule}, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_ENGINE or not value.isprintable():
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise invalid(f"CcConfig_v1: llm_engine must be {rule}, got {shown!r} "
                      f"({len(value)} characters)")
    return value


class _Field(Generic[T]):
    """A field over the slot ``_<name>``: reads it, stores ``check(value)`` on assignment."""

    def __init__(self, check: Callable[[Any], T]) -> None:
        self._check = check
        self._slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name
        self.__doc__ = f"``{name}``, checked on assignment."

    @overload
    def __get__(self, obj: None, owner: type) -> _Field[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> _Field[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(obj, self._slot))

    def __set__(self, obj: object, value: Any) -> None:
        setattr(obj, self._slot, self._check(value))


def _at_least(name: str, minimum: int) -> Callable[[Any], int]:
    return lambda value: _int_field(value, name, minimum)


class CcConfig_v1:  # the published name
    """This rank's identity for context caching; mutable, each field checked on assignment.

    ``CcConfig_v1(rank_id, device_id, model_id, tp_world_size=1, pp_world_size=1,
    rank_in_tp_group=0, rank_in_pp_group=0, llm_engine="vllm",
    kvcache_type=KVCacheType.MHA)``

    Rules (each violation raises ``EMS_INVALID_ARGUMENT`` naming the field):

    - ``rank_id``, ``device_id``: ints >= 0 (global rank; device on this node);
    - ``tp_world_size``, ``pp_world_size``: ints >= 1;
    - ``rank_in_tp_group`` in ``[0, tp_world_size)``, ``rank_in_pp_group`` in
      ``[0, pp_world_size)`` (the upper bounds by ``validate()``);
    - ``model_id``: 1-512 characters of ``[0-9a-z._@-]``;
    - ``llm_engine``: a printable str of 1-256 characters;
    - ``kvcache_type``: a ``KVCacheType`` or its string value (read back as a
      ``KVCacheType``).
    """

    __slots__ = ("_device_id", "_kvcache_type", "_llm_engine", "_model_id", "_pp_world_size",
                 "_rank_id", "_rank_in_pp_group", "_rank_in_tp_group", "_tp_world_size")

    _rank_id: int
    _device_id: int
    _model_id: str
    _tp_world_size: int
    _pp_world_size: int
    _rank_in_tp_group: int
    _rank_in_pp_group: int
    _llm_engine: str
    _kvcache_type: KVCacheType

    rank_id = _Field(_at_least("rank_id", 0))
    device_id = _Field(_at_least("device_id", 0))
    model_id = _Field(_check_model_id)
    tp_world_size = _Field(_at_least("tp_world_size", 1))
    pp_world_size = _Field(_at_least("pp_world_size", 1))
    rank_in_tp_group = _Field(_at_least("rank_in_tp_group", 0))
    rank_in_pp_group = _Field(_at_least("rank_in_pp_group", 0))
    llm_engine = _Field(_check_llm_engine)
    kvcache_type = _Field(_check_kvcache_type)

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
        self.tp_world_size = tp_world_size
        self.pp_world_size = pp_world_size
        self.rank_in_tp_group = rank_in_tp_group
        self.rank_in_pp_group = rank_in_pp_group
        self.rank_id = rank_id
        self.device_id = device_id
        self.model_id = model_id
        self.llm_engine = llm_engine
        self.kvcache_type = kvcache_type
        self.validate()

    def validate(self) -> CcConfig_v1:
        """``self`` once the rules between fields hold; else ``EMS_INVALID_ARGUMENT``.

        Each field was checked alone when it was assigned; this checks the
        group ranks against the world sizes.
        """
        if self._rank_in_tp_group >= self._tp_world_size:
            raise invalid(f"CcConfig_v1: rank_in_tp_group must be < tp_world_size "
                          f"({self._tp_world_size}), got {self._rank_in_tp_group}")
        if self._rank_in_pp_group >= self._pp_world_size:
            raise invalid(f"CcConfig_v1: rank_in_pp_group must be < pp_world_size "
                          f"({self._pp_world_size}), got {self._rank_in_pp_group}")
        return self

    def copy(self) -> CcConfig_v1:
        """An independent config with the same fields (what ``Ems.init`` keeps)."""
        other = object.__new__(CcConfig_v1)
        for slot in CcConfig_v1.__slots__:
            setattr(other, slot, getattr(self, slot))
        return other

    # -- value semantics ----------------------------------------------------------

    def _fields(self) -> tuple[Any, ...]:
        return (self._rank_id, self._device_id, self._model_id, self._tp_world_size,
                self._pp_world_size, self._rank_in_tp_group, self._rank_in_pp_group,
                self._llm_engine, self._kvcache_type)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcConfig_v1):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable settings: equal by value, not hashable

    def __repr__(self) -> str:
        return (f"CcConfig_v1(rank_id={self._rank_id}, device_id={self._device_id}, "
                f"model_id={self._model_id!r}, tp_world_size={self._tp_world_size}, "
                f"pp_world_size={self._pp_world_size}, "
                f"rank_in_tp_group={self._rank_in_tp_group}, "
                f"rank_in_pp_group={self._rank_in_pp_group}, "
                f"llm_engine={self._llm_engine!r}, kvcache_type={self._kvcache_type.value!r})")


CcConfig = CcConfig_v1
