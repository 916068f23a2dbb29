"""Tenants in a cluster: a quota holds on every node that stores the tenant's bytes.

Two emsd processes joined through a real ZooKeeper, with the same tenants
file. A save through one node stores blocks on their owners too (a
forwarded save), and a load through the other fetches copies: each of
these paths counts against the tenant's quota on the node that holds the
bytes, so a tenant over its quota evicts only its own blocks, anywhere.
(The fetch path alone, with real sockets in one process: tests/integration/
test_peer.py.)
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
from tenant_sdk import as_tenant  # noqa: E402

from ems import CcKvOption, EmsErrorCode, EmsException  # noqa: E402
from ems.client import DaemonClient  # noqa: E402
from emsd.ctl import Control, CtlError  # noqa: E402
from emsd.transport.frames import Op  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]

KEY_A = "A" * 43 + "="
KEY_B = "b" * 40 + "/+=="
QUOTA_B = 4 << 20
BLOCK, BLOCKS = 4, 16


@pytest.fixture
def nodes(zookeeper: zk.ZooKeeperServer, emsd_factory: Any, tmp_path: Path) -> list[Any]:
    """Two joined daemons, tenant team-a without a quota and team-b with 4 MiB."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\naccess_id = "team-a"\naccess_key = "{KEY_A}"\n\n'
                       f'[[tenant]]\naccess_id = "team-b"\naccess_key = "{KEY_B}"\nquota = "4MiB"\n')
    tenants.chmod(0o600)
    started = [emsd_factory(start=False, tenants={"file": str(tenants)}, cluster={
        "name": "t", "zookeeper": zookeeper.hosts, "peer_listen": f"127.0.0.1:{zk.free_port()}",
        "secret_file": str(secret), "session_timeout": 4}) for _ in range(2)]
    for d in started:
        d.start()
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in started))
    return started


def stats(d: Any) -> dict[str, Any]:
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({"access_id": "team-a", "access_key": KEY_A})
    try:
        return client.call(Op.STATS, {}, timeout=5)[0]
    finally:
        client.close()


def kv(value: float, heads: int) -> list[list[torch.Tensor]]:
    """One layer, K and V: ``BLOCKS`` blocks of ``BLOCK`` tokens, 512 B a token per head."""
    return [[torch.full((BLOCKS, BLOCK, heads, 32), value) for _ in range(2)]]


SLOTS = list(range(BLOCKS * BLOCK))


def test_a_tenant_over_its_quota_saving_through_another_node_evicts_only_its_own(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = nodes
    a_keys = [500 + i for i in range(BLOCKS)]
    cc = as_tenant(x, "team-a", KEY_A, monkeypatch)
    cc.register_kvcache(kv(1.0, 8))
    assert cc.save(SLOTS, hashes=a_keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    # team-b saves 120 MiB through y, 2 MiB a batch; about half of it is owned by x.
    cc = as_tenant(y, "team-b", KEY_B, monkeypatch)
    cc.register_kvcache(kv(2.0, 128))
    for r in range(60):
        keys = [100_000 * (r + 1) + i for i in range(BLOCKS)]
        assert cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    # The owner applied team-b's quota to the forwarded saves: it evicted team-b's own blocks.
    assert x.metric("emsd_pool_evictions_total", 'reason="quota"') > 0
    assert x.metric("emsd_pool_evictions_total", 'reason="lru"') == 0
    assert stats(x)["bytes_used"] <= QUOTA_B + 2 * (1 << 20)  # team-b's 4 MiB and team-a's blocks

    for d in (x, y):  # team-a's blocks are all still there, through either node
        cc = as_tenant(d, "team-a", KEY_A, monkeypatch)
        assert cc.exists(a_keys).success == BLOCKS
    local = cc.exists(a_keys, option=CcKvOption(read_local_only=True))  # x kept every one it saved
    assert as_tenant(x, "team-a", KEY_A, monkeypatch).exists(
        a_keys, option=CcKvOption(read_local_only=True)).success == BLOCKS
    assert local.success < BLOCKS  # y holds only its share: the rest was found at x above
    assert x.alive() and y.alive()


def test_a_tenant_may_not_drain_a_node_or_change_the_placement(nodes: list[Any]) -> None:
    """DRAIN and PLACEMENT change the cluster for every tenant: a tenant's connection is refused
    both, whatever its user, and the node stays in the ring with the record unchanged."""
    x, _ = nodes
    before = {k: stats(x)[k] for k in ("placement_record", "vnodes", "replicas")}
    client = DaemonClient(x.socket_dir / "emsd.sock")
    client.connect({"access_id": "team-a", "access_key": KEY_A})
    try:
        for op, fields in ((Op.DRAIN, {"to": 2000}), (Op.PLACEMENT, {"vnodes": 64, "replicas": 2})):
            with pytest.raises(EmsException) as err:
                client.call(op, fields, timeout=10)
            assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
            assert "is the operator's" in err.value.message()
    finally:
        client.close()
    assert all(len(stats(d)["members"]) == 2 for d in nodes)
    assert not stats(x)["draining"]
    assert {k: stats(x)[k] for k in before} == before


def test_emsctl_without_an_access_id_runs_operator_commands_only(nodes: list[Any]) -> None:
    """On a node of tenants only (no ``allow_default``), a connection without an access id from
    root or the daemon's user is the operator's: it is given no pool memory, may read STATS and
    drain the node, and may not open a namespace."""
    x, y = nodes
    ctl = Control(x.socket_dir)
    try:
        assert ctl.call(Op.STATS, {})["node"] == x.sections["node"]["id"]
        with pytest.raises(CtlError, match="only run operator commands"):
            ctl.call(Op.NAMESPACE, {"name": "m"})
    finally:
        ctl.sock.close()
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(x.socket_dir), "drain"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: stats(y)["members"] == [y.sections["node"]["id"]])
