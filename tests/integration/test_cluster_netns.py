"""Two emsd nodes on two hosts of their own (network namespaces), ZooKeeper on a third address.

Each daemon runs inside its own namespace with its own address, peers with
the other over a real (virtual) link and reaches ZooKeeper over it; the test
process drives them through their Unix sockets, which cross namespaces.
Skipped with the reason where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import netns  # noqa: E402
import zk  # noqa: E402
from test_cluster import BLOCK, BLOCKS, SLOTS, kv, load_equal, stats, use, wait_for  # noqa: E402

from ems import CcKvOption  # noqa: E402

_why = zk.available() or netns.available()
pytestmark = [pytest.mark.skipif(_why is not None, reason=str(_why)),
              pytest.mark.usefixtures("reset_sdk")]


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    h = netns.Hosts(2).create()
    yield h
    h.destroy()


def test_nodes_on_separate_hosts_share_blocks_and_survive_a_cut_link(
        hosts: netns.Hosts, emsd_factory: Any, tmp_path: Path, monkeypatch: Any) -> None:
    server = zk.ZooKeeperServer(tmp_path / "zk", host=hosts.gateway).start()
    try:
        secret = tmp_path / "secret"
        secret.write_text("netns-cluster-secret\n")
        secret.chmod(0o600)
        nodes = []
        for i, addr in enumerate(hosts.addresses):
            d = emsd_factory(start=False, metrics={"listen": f"{addr}:9400"}, cluster={
                "name": "ns", "zookeeper": server.hosts, "peer_listen": f"{addr}:11000",
                "secret_file": str(secret), "session_timeout": 4})
            d.prefix = hosts.prefix(i)
            nodes.append(d.start())
        a, b = nodes
        wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in nodes))

        src = kv(20)
        keys = [5000 + i for i in range(BLOCKS)]
        cc = use(a, monkeypatch)
        cc.register_kvcache(src)
        opt = CcKvOption(write_rcache=False)
        assert cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS, option=opt).success == BLOCKS
        later = [k + 100_000 for k in keys]
        assert cc.save(SLOTS, hashes=later, offsets=[BLOCK] * BLOCKS, option=opt).success == BLOCKS
        held_b = stats(b)["entries"]
        assert 0 < held_b < 2 * BLOCKS  # b owns a share: those blocks crossed the link

        cc = load_equal(b, src, keys, monkeypatch)

        hosts.cut(0)  # a's link down: no RST, no answer, just silence
        t0 = time.monotonic()
        res = cc.load(SLOTS, hashes=later, offsets=[BLOCK] * BLOCKS, option=CcKvOption(timeout=1500))
        assert time.monotonic() - t0 < 4.0  # the call's timeout bounds the peer work
        assert res.success < BLOCKS  # a's share is a miss
        assert b.alive()

        hosts.heal(0)  # a comes back (its session may have expired: it re-registers)
        wait_for(lambda: len(stats(b)["members"]) == 2 and stats(a)["membership"] == "joined", 60)
        wait_for(lambda: cc.load(SLOTS, hashes=later, offsets=[BLOCK] * BLOCKS,
                                 option=CcKvOption(timeout=3000)).success == BLOCKS, 30)
    finally:
        server.stop()
