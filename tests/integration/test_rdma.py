"""Peer transport selection with real daemon processes and a real ZooKeeper.

- Two daemons over RDMA: runs only where ``pyverbs.device.get_device_list()``
  finds a device (an RDMA NIC, or soft RoCE: ``rdma link add rxe0 type rxe
  netdev eth0``); skipped with that reason otherwise. It has not run in this
  project's CI, whose machines have no RDMA device (docs/transports.md).
- The fallback, which runs everywhere without a device: ``auto`` moves data
  over TCP and says so and why (log, metrics, STATS); ``rdma`` refuses to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from test_cluster import load_equal, stats, use, wait_for  # noqa: E402

from emsd.transport.verbs import probe  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]
DEVICES, NO_DEVICE_WHY = probe()
needs_device = pytest.mark.skipif(not DEVICES, reason=f"needs an RDMA device: {NO_DEVICE_WHY}")
needs_no_device = pytest.mark.skipif(bool(DEVICES), reason=f"this machine has RDMA devices {DEVICES}")
BLOCK, BLOCKS = 4, 24
SLOTS = list(range(BLOCKS * BLOCK))
KEYS = [5000 + i for i in range(BLOCKS)]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(path, 0o600)
    return path


def node(emsd_factory: Any, zookeeper: zk.ZooKeeperServer, secret: Path, transport: str) -> Any:
    return emsd_factory(start=False, cluster={
        "name": "t", "zookeeper": zookeeper.hosts, "peer_listen": f"127.0.0.1:{zk.free_port()}",
        "secret_file": str(secret), "session_timeout": 4, "transport": transport})


def save_on_a_load_on_b(a: Any, b: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks saved through ``a`` load through ``b`` with identical bytes (some cross the peers)."""
    g = torch.Generator().manual_seed(7)
    src = [[torch.randn(BLOCKS, BLOCK, 8, 64, generator=g) for _ in range(2)] for _ in range(2)]
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    load_equal(b, src, KEYS, monkeypatch)


def peer_id(d: Any) -> str:
    return str(d.sections["node"]["id"])


@needs_no_device
def test_auto_without_a_device_moves_blocks_over_tcp_and_says_why(
        emsd_factory: Any, zookeeper: zk.ZooKeeperServer, secret: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = node(emsd_factory, zookeeper, secret, "auto"), node(emsd_factory, zookeeper, secret, "auto")
    for d in (a, b):
        d.start()
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
    save_on_a_load_on_b(a, b, monkeypatch)
    sa, sb = stats(a), stats(b)
    assert sa["transport"] == "tcp" and sb["transport"] == "tcp"
    seen = sb["peer_transports"][peer_id(a)]  # b fetched from a
    assert seen["transport"] == "tcp"
    assert seen["reason"] == NO_DEVICE_WHY  # the same probe, in the daemon: no device, or no pyverbs
    assert b.metric("emsd_peer_transport", f'peer="{peer_id(a)}",transport="tcp"') == 1
    assert b.metric("emsd_peer_transport", f'peer="{peer_id(a)}",transport="rdma"') == 0
    fallback = f'peer="{peer_id(a)}",reason="no_local_device"'
    assert b.metric("emsd_peer_transport_fallbacks_total", fallback) == 1
    assert b.metric("emsd_peer_blocks_total", f'op="get",peer="{peer_id(a)}"') > 0
    log = b.log()
    assert "transport: TCP only (" in log and f"peer {peer_id(a)}: transport tcp (" in log
    assert log.count(f"peer {peer_id(a)}: transport tcp") == 1  # once, not per request
    assert "transport tcp (" in log.split("ready:")[1].splitlines()[0]  # the start-up summary
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(b.socket_dir), "status"],
                         capture_output=True, text=True, timeout=120).stdout
    row = next(line for line in out.splitlines() if line.startswith(peer_id(a) + " "))
    assert row.endswith(f"tcp ({NO_DEVICE_WHY})")


def test_tcp_mode_never_counts_a_fallback(emsd_factory: Any, zookeeper: zk.ZooKeeperServer, secret: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = node(emsd_factory, zookeeper, secret, "tcp"), node(emsd_factory, zookeeper, secret, "tcp")
    for d in (a, b):
        d.start()
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
    save_on_a_load_on_b(a, b, monkeypatch)
    assert stats(b)["peer_transports"][peer_id(a)]["reason"] == 'cluster.transport is "tcp"'
    assert b.metric("emsd_peer_transport", f'peer="{peer_id(a)}",transport="tcp"') == 1
    assert "emsd_peer_transport_fallbacks_total{" not in b.http("/metrics")[1].decode()


@needs_no_device
def test_rdma_mode_without_a_device_exits_2_with_a_clear_message(
        emsd_factory: Any, zookeeper: zk.ZooKeeperServer, secret: Path) -> None:
    d = node(emsd_factory, zookeeper, secret, "rdma")
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(30) == 2
    assert 'emsd: cannot start: cluster.transport: "rdma" needs an RDMA device, but: ' in d.log()
    assert "Traceback" not in d.log()


@needs_device
def test_two_daemons_move_blocks_over_rdma(emsd_factory: Any, zookeeper: zk.ZooKeeperServer, secret: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = node(emsd_factory, zookeeper, secret, "rdma"), node(emsd_factory, zookeeper, secret, "rdma")
    for d in (a, b):
        d.start()
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
    save_on_a_load_on_b(a, b, monkeypatch)
    sa, sb = stats(a), stats(b)
    assert sa["transport"] == "rdma" and sb["transport"] == "rdma"
    assert sb["peer_transports"][peer_id(a)] == {"transport": "rdma", "state": "rdma", "reason": ""}
    assert b.metric("emsd_peer_transport", f'peer="{peer_id(a)}",transport="rdma"') == 1
    assert "emsd_peer_transport_fallbacks_total{" not in b.http("/metrics")[1].decode()
    assert b.metric("emsd_peer_blocks_total", f'op="get",peer="{peer_id(a)}"') > 0
