"""Fixtures for the engine integration tests: the SDK pointed at a real emsd."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def ems_env(emsd_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A started emsd; the SDK's process-wide state is reset before and after."""
    from ems.ems import Ems

    daemon = emsd_factory()
    monkeypatch.setenv("EMS_SOCKET_DIR", str(daemon.socket_dir))
    monkeypatch.setenv("EMS_SDK_LOG", str(daemon.workdir / "sdk-log"))
    Ems._reset()
    yield daemon
    Ems._reset()
