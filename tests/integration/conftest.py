"""Fixtures of the integration tests that start several daemons."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

from tests.waiting import wait_for  # noqa: E402


@pytest.fixture
def cluster(zookeeper: zk.ZooKeeperServer, emsd_factory: Any, tmp_path: Path) -> Callable[..., list[Any]]:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)

    def start(n: int, pool: dict[str, Any] | None = None, tenants: dict[str, Any] | None = None,
              **extra: Any) -> list[Any]:
        """``n`` joined daemons (``tenants``: their ``[tenants]`` table, none by default)."""
        more = {"tenants": tenants} if tenants else {}
        nodes = [emsd_factory(start=False, pool=pool or {}, cluster={
            "name": "t", "zookeeper": zookeeper.hosts, "peer_listen": f"127.0.0.1:{zk.free_port()}",
            "secret_file": str(secret), "session_timeout": 4, **extra}, **more) for _ in range(n)]
        for d in nodes:
            d.start()
        # the view on /metrics (STATS would need a tenant's credentials with a tenants file);
        # on a machine loaded by several test workers, joins can take ZooKeeper well over 30 s
        wait_for(lambda: all(d.metric("emsd_cluster_members") == n for d in nodes), timeout=90)
        return nodes

    return start
