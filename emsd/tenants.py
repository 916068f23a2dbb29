"""Tenants: who may use the pool, with which key, and how much of it.

With ``[tenants] file`` set, the daemon reads a TOML file of tenants::

    [[tenant]]
    access_id = "team-a"            # 1-512 of [0-9a-z._@-], as the SDK's EmsConfig.access_id
    access_key = "...32-256 of [0-9A-Za-z+/=]..."
    quota = "8GiB"                  # optional: committed bytes this tenant may hold

The file must be readable by the daemon's user only (``config.check_private``:
it holds secrets): the daemon refuses to start otherwise, naming the file. A client's HELLO must
carry a known ``access_id`` and its ``access_key`` (compared in constant
time); a client without one is the default tenant, admitted only with
``allow_default``. Every namespace a tenant opens is qualified by its id on
the daemon, whatever name the client sends, so keys of different tenants
never meet. With no file, one default tenant serves everyone (the embedded
default).
"""

from __future__ import annotations

import hmac
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from emsd.config import ConfigError, check_private, parse_size

if TYPE_CHECKING:
    import numpy as np

    from emsd.pool.keys import KeyBatch

_ID = re.compile(r"[0-9a-z._@-]{1,512}")
_KEY = re.compile(r"[0-9A-Za-z+/=]{32,256}")
DEFAULT = ""  # the default tenant's id
PREFIX = "tenant:"  # daemon-side namespace names of a tenant: "tenant:<id>/<name as sent>"


class Quota(Protocol):
    """Tenants' quotas as a path that stores bytes without a client session needs them (the
    disk tier's promotions; blocks from peers go through ``Service.reserve_arriving``, which
    uses the same two): ``emsd.service.Service`` is one."""

    def fit_quota(self, ns: int, keys: KeyBatch, sizes: np.ndarray) -> int:
        """How many leading blocks fit namespace ``ns``'s tenant's quota (evicting its own)."""
        ...

    def hold_quota(self, ns: int, nbytes: int) -> None:
        """``ns``'s tenant holds ``nbytes`` more (negative: fewer) bytes reserved, uncommitted."""
        ...


@dataclass(frozen=True)
class Tenant:
    access_id: str
    access_key: str
    quota: int | None  # committed bytes, None: no limit

    def __repr__(self) -> str:  # never print the key
        return f"Tenant({self.access_id!r}, quota={self.quota})"


class Tenants:
    """The configured tenants; empty means one default tenant for everyone."""

    def __init__(self, tenants: list[Tenant], allow_default: bool = True) -> None:
        self.by_id = {t.access_id: t for t in tenants}
        self.allow_default = allow_default or not tenants

    @property
    def enabled(self) -> bool:
        return bool(self.by_id)

    def authenticate(self, access_id: Any, access_key: Any) -> str | None:
        """The tenant id a HELLO's credentials prove, or None (refuse the client)."""
        if not self.enabled or access_id in (None, ""):
            return DEFAULT if self.allow_default else None
        tenant = self.by_id.get(access_id) if isinstance(access_id, str) else None
        key = access_key.encode() if isinstance(access_key, str) else b""
        expected = tenant.access_key.encode() if tenant is not None else b"\0" * 32
        ok = hmac.compare_digest(key, expected)  # as long for an unknown id as for a wrong key
        return tenant.access_id if tenant is not None and ok else None

    def quota(self, tenant: str) -> int | None:
        t = self.by_id.get(tenant)
        return None if t is None else t.quota

    @staticmethod
    def qualify(tenant: str, name: str) -> str:
        """The daemon's name of a tenant's namespace (the default tenant's names are kept as sent)."""
        return name if tenant == DEFAULT else f"{PREFIX}{tenant}/{name}"

    @staticmethod
    def tenant_of(qualified: str) -> str:
        """The tenant a daemon-side namespace name belongs to."""
        if qualified.startswith(PREFIX):
            return qualified[len(PREFIX):].split("/", 1)[0]
        return DEFAULT


def load(path: Path, allow_default: bool) -> Tenants:
    """Read and check the tenants file; raises ``ConfigError`` naming the file and the rule."""
    where = f"tenants.file ({path})"
    try:
        st = os.stat(path)
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(where, f"cannot read: {exc.strerror or exc}") from None
    check_private(where, st)
    try:
        doc = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(where, f"not valid TOML: {exc}") from None
    entries = doc.get("tenant", [])
    if set(doc) - {"tenant"} or not isinstance(entries, list):
        raise ConfigError(where, "must hold only [[tenant]] tables")
    tenants = [_tenant(where, i, t) for i, t in enumerate(entries)]
    ids = [t.access_id for t in tenants]
    if len(set(ids)) != len(ids):
        raise ConfigError(where, "an access_id appears twice")
    return Tenants(tenants, allow_default)


def _tenant(where: str, i: int, t: Any) -> Tenant:
    at = f"{where} tenant #{i + 1}"
    if not isinstance(t, dict) or set(t) - {"access_id", "access_key", "quota"}:
        raise ConfigError(at, "keys are access_id, access_key and quota")
    access_id, key = t.get("access_id"), t.get("access_key")
    if not isinstance(access_id, str) or not _ID.fullmatch(access_id):
        raise ConfigError(f"{at}.access_id", "must be 1-512 characters of [0-9a-z._@-]")
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ConfigError(f"{at}.access_key", "must be 32-256 characters of [0-9A-Za-z+/=]")
    quota = parse_size(f"{at}.quota", t["quota"]) if "quota" in t else None
    if quota is not None and quota <= 0:
        raise ConfigError(f"{at}.quota", "must be positive")
    return Tenant(access_id, key, quota)
