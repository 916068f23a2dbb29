"""The SDK as one tenant of a test daemon (tests of tenants, standalone and in a cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from ems import CcConfig, Ems, EmsConfig


def as_tenant(d: Any, access_id: str, key: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh SDK connection of tenant ``access_id`` to daemon ``d``: its ContextCaching
    (model "m", rank 0)."""
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(access_id=access_id, access_key=key,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    return Ems.get_cc()
