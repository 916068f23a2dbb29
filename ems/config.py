"""``EmsConfig`` (credentials and the context-caching config) and ``CcKvOption``.

``EmsConfig`` is what ``Ems.init`` takes. Its constructor checks every field
it is given (types, lengths, alphabets); ``validate()``, which ``Ems.init``
calls, additionally requires a ``CcConfig_v1``: a config without one can be
built (published samples construct it in steps) but not used.

Decisions where the published API is silent:

- ``cc_config=`` and ``cc_config_v1=`` are synonyms (published samples use
  both). Giving both is accepted only when they are the same config (the same
  object or equal values); otherwise it is ambiguous and refused.
- ``access_id=None`` is the default tenant. An ``access_key`` without an
  ``access_id`` is refused: a key authenticates a named tenant. An
  ``access_id`` without a key is accepted here; the daemon refuses it if the
  tenant requires a key.
- The ``access_key`` is a secret: it never appears in ``repr``/``str`` or in
  any error message (only its length may).

``CcKvOption`` holds per-call options. ``timeout`` is in milliseconds for the
whole call; ``0`` means no time limit (the call waits as long as it takes),
the only useful reading of "0 ms" for an operation that always needs a round
trip. ``resolve_option`` maps ``None`` to the default option.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ems.cc_v1.cc_config import CcConfig_v1, check_name
from ems.common.exception import invalid

MAX_ACCESS_ID = 512
MIN_ACCESS_KEY = 32
MAX_ACCESS_KEY = 256
MAX_TIMEOUT_MS = 2**31 - 1  # ~24.8 days; a limit on everything
DEFAULT_TIMEOUT_MS = 5000
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]+")


def _access_id(value: Any) -> str | None:
    if value is None:
        return None
    return check_name(value, "EmsConfig", "access_id", MAX_ACCESS_ID)


def _access_key(value: Any) -> str | None:
    """The key, checked; messages never contain the key itself."""
    if value is None:
        return None
    rule = f"{MIN_ACCESS_KEY}-{MAX_ACCESS_KEY} characters of [0-9A-Za-z+/=]"
    if not isinstance(value, str):
        raise invalid(f"EmsConfig: access_key must be a str of {rule}, got {type(value).__name__}")
    if not MIN_ACCESS_KEY <= len(value) <= MAX_ACCESS_KEY or _KEY_RE.fullmatch(value) is None:
        raise invalid(f"EmsConfig: access_key must be {rule} "
                      f"(the given key has {len(value)} characters; not shown)")
    return value


def _cc(cc_config: Any, cc_config_v1: Any) -> CcConfig_v1 | None:
    if cc_config is not None and cc_config_v1 is not None and not (
        cc_config is cc_config_v1 or cc_config == cc_config_v1
    ):
        raise invalid("EmsConfig: cc_config and cc_config_v1 are synonyms; "
                      "give one of them (or the same config to both)")
    cc = cc_config if cc_config is not None else cc_config_v1
    if cc is not None and not isinstance(cc, CcConfig_v1):
        name = "cc_config" if cc_config is not None else "cc_config_v1"
        raise invalid(f"EmsConfig: {name} must be a CcConfig_v1, got {type(cc).__name__}")
    return cc


class EmsConfig:
    """Credentials and the context-caching config for ``Ems.init``.

    ``EmsConfig(access_id=None, access_key=None, cc_config=None, cc_config_v1=None)``

    - ``access_id``: ``None`` (default tenant) or 1-512 characters of
      ``[0-9a-z._@-]``;
    - ``access_key``: ``None`` or 32-256 characters of ``[0-9A-Za-z+/=]``;
      requires ``access_id``;
    - ``cc_config`` / ``cc_config_v1``: a ``CcConfig_v1`` (synonyms).

    The constructor raises ``EMS_INVALID_ARGUMENT`` for a bad field;
    ``validate()`` also for a missing ``CcConfig_v1``.
    """

    __slots__ = ("_access_id", "_access_key", "_cc")

    def __init__(
        self,
        access_id: str | None = None,
        access_key: str | None = None,
        cc_config: CcConfig_v1 | None = None,
        cc_config_v1: CcConfig_v1 | None = None,
    ) -> None:
        self._access_id = _access_id(access_id)
        self._access_key = _access_key(access_key)
        if self._access_key is not None and self._access_id is None:
            raise invalid("EmsConfig: access_key was given without access_id; "
                          "a key authenticates a named tenant")
        self._cc = _cc(cc_config, cc_config_v1)

    @property
    def access_id(self) -> str | None:
        return self._access_id

    @property
    def access_key(self) -> str | None:
        return self._access_key

    @property
    def cc_config(self) -> CcConfig_v1 | None:
        return self._cc

    @property
    def cc_config_v1(self) -> CcConfig_v1 | None:
        return self._cc

    def validate(self) -> CcConfig_v1:
        """The ``CcConfig_v1``; ``EMS_INVALID_ARGUMENT`` if this config cannot init the SDK."""
        if self._cc is None:
            raise invalid("EmsConfig: cc_config (or cc_config_v1) is required: "
                          "give a CcConfig_v1 naming the model and this rank")
        return self._cc

    def __repr__(self) -> str:
        key = "None" if self._access_key is None else "'***'"
        return f"EmsConfig(access_id={self._access_id!r}, access_key={key}, cc_config={self._cc!r})"


def _bool_field(value: Any, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise invalid(f"CcKvOption: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _timeout(value: Any) -> int:
    rule = f"an int number of milliseconds in [0, {MAX_TIMEOUT_MS}] (0 = no limit)"
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise invalid(f"CcKvOption: timeout must be {rule}, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= MAX_TIMEOUT_MS:
        raise invalid(f"CcKvOption: timeout must be {rule}, got {int(value)}")
    return int(value)


class CcKvOption:
    """Per-call options, validated on construction and immutable.

    ``CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)``

    - ``write_rcache`` (bool): also keep what the call writes or fetches as a
      read cache on the local node;
    - ``read_local_only`` (bool): never go to another node;
    - ``timeout`` (int ms, ``0 <= timeout <= 2**31 - 1``): for the whole call;
      ``0`` means no limit. A call that runs out raises ``EMS_IO_TIMEOUT``.

    Booleans must be ``bool`` (not ``0``/``1``); ``timeout`` must be an int
    (not a bool or a float).
    """

    __slots__ = ("_read_local_only", "_timeout", "_write_rcache")

    def __init__(self, write_rcache: bool = True, read_local_only: bool = False,
                 timeout: int = DEFAULT_TIMEOUT_MS) -> None:
        self._write_rcache = _bool_field(write_rcache, "write_rcache")
        self._read_local_only = _bool_field(read_local_only, "read_local_only")
        self._timeout = _timeout(timeout)

    @property
    def write_rcache(self) -> bool:
        return self._write_rcache

    @property
    def read_local_only(self) -> bool:
        return self._read_local_only

    @property
    def timeout(self) -> int:
        return self._timeout

    def timeout_seconds(self) -> float | None:
        """The timeout in seconds, or ``None`` for no limit (``timeout == 0``)."""
        return None if self._timeout == 0 else self._timeout / 1000.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcKvOption):
            return NotImplemented
        return (self._write_rcache, self._read_local_only, self._timeout) == (
            other._write_rcache, other._read_local_only, other._timeout)

    def __hash__(self) -> int:
        return hash((self._write_rcache, self._read_local_only, self._timeout))

    def __repr__(self) -> str:
        return (f"CcKvOption(write_rcache={self._write_rcache}, "
                f"read_local_only={self._read_local_only}, timeout={self._timeout})")


_DEFAULT_OPTION = CcKvOption()


def resolve_option(option: Any) -> CcKvOption:
    """``option`` itself, or the default ``CcKvOption()`` for ``None``.

    Raises ``EMS_INVALID_ARGUMENT`` if ``option`` is neither.
    """
    if option is None:
        return _DEFAULT_OPTION
    if not isinstance(option, CcKvOption):
        raise invalid(f"option must be a CcKvOption or None, got {type(option).__name__}")
    return option
