"""``EmsConfig`` (credentials and the context-caching config) and ``CcKvOption``.

Both are plain mutable settings objects, as published code uses them (the
reference's retry example sets ``option.timeout = 1000`` on an option already
used). Each field is checked when it is assigned, in the constructor too
(types, lengths, alphabets, ranges), so that a call only has to see that its
option is a ``CcKvOption``: the per-call cost of validation is one
``isinstance``. Rules between fields are checked by ``EmsConfig.validate()``,
which ``Ems.init`` calls: it requires a ``CcConfig_v1`` (a config without one
can be built, published samples construct it in steps, but not used) and an
``access_id`` with any ``access_key``.

Decisions where the published API is silent:

- ``cc_config=`` and ``cc_config_v1=`` are synonyms (published samples use
  both): one field under two names. Giving both to the constructor is accepted
  only when they are the same config (the same object or equal values);
  otherwise it is ambiguous and refused.
- ``access_key=""`` means no key, as ``None``: the published vllm-ascend
  connector passes ``os.environ.get("ACCELERATE_KEY", "")``.
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
    """The key, checked; messages never contain the key itself. ``""`` is no key (``None``)."""
    if value is None or value == "":
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
    """Credentials and the context-caching config for ``Ems.init``; mutable settings.

    ``EmsConfig(access_id=None, access_key=None, cc_config=None, cc_config_v1=None)``

    - ``access_id``: ``None`` (default tenant) or 1-512 characters of
      ``[0-9a-z._@-]``;
    - ``access_key``: ``None`` or 32-256 characters of ``[0-9A-Za-z+/=]``;
      requires ``access_id`` (checked by ``validate()``);
    - ``cc_config`` / ``cc_config_v1``: a ``CcConfig_v1`` (two names of one
      field).

    The constructor and each assignment raise ``EMS_INVALID_ARGUMENT`` for a
    bad field; ``validate()`` also for a missing ``CcConfig_v1`` or a key
    without an id.
    """

    __slots__ = ("_access_id", "_access_key", "_cc")

    def __init__(
        self,
        access_id: str | None = None,
        access_key: str | None = None,
        cc_config: CcConfig_v1 | None = None,
        cc_config_v1: CcConfig_v1 | None = None,
    ) -> None:
        self.access_id = access_id
        self.access_key = access_key
        _check_key_has_id(self._access_id, self._access_key)
        self._cc = _cc(cc_config, cc_config_v1)

    @property
    def access_id(self) -> str | None:
        return self._access_id

    @access_id.setter
    def access_id(self, value: str | None) -> None:
        self._access_id = _access_id(value)

    @property
    def access_key(self) -> str | None:
        return self._access_key

    @access_key.setter
    def access_key(self, value: str | None) -> None:
        self._access_key = _access_key(value)

    @property
    def cc_config(self) -> CcConfig_v1 | None:
        return self._cc

    @cc_config.setter
    def cc_config(self, value: CcConfig_v1 | None) -> None:
        self._cc = _cc(value, None)

    @property
    def cc_config_v1(self) -> CcConfig_v1 | None:
        return self._cc

    @cc_config_v1.setter
    def cc_config_v1(self, value: CcConfig_v1 | None) -> None:
        self._cc = _cc(None, value)

    def validate(self) -> CcConfig_v1:
        """The ``CcConfig_v1``; ``EMS_INVALID_ARGUMENT`` if this config cannot init the SDK."""
        _check_key_has_id(self._access_id, self._access_key)
        if self._cc is None:
            raise invalid("EmsConfig: cc_config (or cc_config_v1) is required: "
                          "give a CcConfig_v1 naming the model and this rank")
        return self._cc.validate()

    def copy(self) -> EmsConfig:
        """An independent config with the same fields, its ``CcConfig_v1`` copied too."""
        other = object.__new__(EmsConfig)
        other._access_id, other._access_key = self._access_id, self._access_key
        other._cc = None if self._cc is None else self._cc.copy()
        return other

    def same(self, other: EmsConfig) -> bool:
        """True when ``other`` holds the same values (the key compared, never shown)."""
        return (self._access_id, self._access_key, self._cc) == (
            other._access_id, other._access_key, other._cc)

    def __repr__(self) -> str:
        key = "None" if self._access_key is None else "'***'"
        return f"EmsConfig(access_id={self._access_id!r}, access_key={key}, cc_config={self._cc!r})"


def _check_key_has_id(access_id: str | None, access_key: str | None) -> None:
    if access_key is not None and access_id is None:
        raise invalid("EmsConfig: access_key was given without access_id; "
                      "a key authenticates a named tenant")


def _bool_field(value: Any, name: str) -> bool:
    if value is True or value is False:  # the usual case first: options are built per call
        return value
    if not isinstance(value, bool | np.bool_):
        raise invalid(f"CcKvOption: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _timeout(value: Any) -> int:
    if type(value) is int and 0 <= value <= MAX_TIMEOUT_MS:  # the usual case first
        return value
    rule = f"an int number of milliseconds in [0, {MAX_TIMEOUT_MS}] (0 = no limit)"
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise invalid(f"CcKvOption: timeout must be {rule}, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= MAX_TIMEOUT_MS:
        raise invalid(f"CcKvOption: timeout must be {rule}, got {int(value)}")
    return int(value)


class CcKvOption:
    """Per-call options; mutable settings, each field checked on assignment.

    ``CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)``

    - ``write_rcache`` (bool): also keep what the call writes or fetches as a
      read cache on the local node;
    - ``read_local_only`` (bool): never go to another node;
    - ``timeout`` (int ms, ``0 <= timeout <= 2**31 - 1``): for the whole call;
      ``0`` means no limit. A call that runs out raises ``EMS_IO_TIMEOUT``.

    Booleans must be ``bool`` (not ``0``/``1``); ``timeout`` must be an int
    (not a bool or a float). A bad value raises ``EMS_INVALID_ARGUMENT`` where
    it is assigned, so an option can never hold one: calls use it unchecked.
    An async call keeps a copy taken when it is issued, so changing the option
    afterwards (to retry with a longer timeout) affects only later calls.
    """

    __slots__ = ("_read_local_only", "_timeout", "_write_rcache")

    def __init__(self, write_rcache: bool = True, read_local_only: bool = False,
                 timeout: int = DEFAULT_TIMEOUT_MS) -> None:
        self.write_rcache = write_rcache
        self.read_local_only = read_local_only
        self.timeout = timeout

    @property
    def write_rcache(self) -> bool:
        return self._write_rcache

    @write_rcache.setter
    def write_rcache(self, value: bool) -> None:
        self._write_rcache = _bool_field(value, "write_rcache")

    @property
    def read_local_only(self) -> bool:
        return self._read_local_only

    @read_local_only.setter
    def read_local_only(self, value: bool) -> None:
        self._read_local_only = _bool_field(value, "read_local_only")

    @property
    def timeout(self) -> int:
        return self._timeout

    @timeout.setter
    def timeout(self, value: int) -> None:
        self._timeout = _timeout(value)

    def timeout_seconds(self) -> float | None:
        """The timeout in seconds, or ``None`` for no limit (``timeout == 0``)."""
        return None if self._timeout == 0 else self._timeout / 1000.0

    def copy(self) -> CcKvOption:
        """An independent option with the same fields (what an async call keeps)."""
        other = object.__new__(CcKvOption)
        other._write_rcache, other._read_local_only = self._write_rcache, self._read_local_only
        other._timeout = self._timeout
        return other

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcKvOption):
            return NotImplemented
        return (self._write_rcache, self._read_local_only, self._timeout) == (
            other._write_rcache, other._read_local_only, other._timeout)

    __hash__ = None  # type: ignore[assignment]  # mutable settings: equal by value, not hashable

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
