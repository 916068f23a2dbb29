"""ZooKeeper as it runs in production: a 3-server quorum whose leader is killed under load.

The chaos run's load (``test_chaos``: one saving and loading process per
node, every byte checked) runs against three nodes that know all three
ZooKeeper servers. Mid-run the quorum's leader is killed with -9: the
two followers elect a new one and clients of the dead server move to
another. Asserted: emsd changes nothing but speed (no wrong byte, every
call within its timeout, every saved block loads), and no node leaves the
view or re-registers: each node's znode keeps the session it was created
by (a re-registration would be a new session), an observer never sees
fewer than three members, and no node logs a lost session.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memory  # noqa: E402
import zk  # noqa: E402
from test_chaos import assert_settled, assert_workers_ok, start_workers, stop_workers  # noqa: E402
from test_cluster import stats, wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))
RUN_SECONDS = 16.0
SESSION_TIMEOUT = 6


def owners(client: KazooClient, path: str) -> dict[str, int]:
    """node id -> the session that owns its ephemeral znode."""
    return {child: client.exists(f"{path}/{child}").ephemeralOwner for child in client.get_children(path)}


def prefaulted(d: Any) -> bool:
    """Whether daemon ``d``'s background prefault is done."""
    total = d.metric("emsd_pool_prefault_bytes", 'state="total"')
    return total > 0 and d.metric("emsd_pool_prefault_bytes", 'state="done"') >= total


@pytest.mark.timeout(240)
def test_killing_the_zookeeper_leader_under_load_changes_nothing_but_speed(
        emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory.measurable(monkeypatch)
    ensemble = zk.ZooKeeperEnsemble(tmp_path / "zk").start()
    observer = KazooClient(hosts=ensemble.hosts, timeout=SESSION_TIMEOUT)
    workers: list[Any] = []
    try:
        secret = tmp_path / "secret"
        secret.write_text("ensemble-cluster-secret\n")
        secret.chmod(0o600)
        # pools large enough that nothing is evicted in the run: then every load must hit
        nodes = [emsd_factory(start=False, pool={"size": "1GiB"}, cluster={
            "name": "quorum", "zookeeper": ensemble.hosts, "secret_file": str(secret), "replicas": 2,
            "peer_listen": f"127.0.0.1:{zk.free_port()}", "session_timeout": SESSION_TIMEOUT})
            for _ in range(3)]
        for d in nodes:
            d.start()
        wait_for(lambda: all(len(stats(d)["members"]) == 3 for d in nodes))
        # The background prefault of three 1 GiB pools runs at 0.15 GB/s on a slow 2-core
        # machine, and calls made while it runs waited up to 2 s: this test is about ZooKeeper,
        # so the load starts once every pool is faulted in (start-up has tests of its own).
        wait_for(lambda: all(prefaulted(d) for d in nodes), 120)
        observer.start(timeout=30)
        path = "/emsd/quorum/nodes"
        before = owners(observer, path)
        seen: list[int] = []
        lock = threading.Lock()

        def on_children(children: list[str]) -> None:
            with lock:
                seen.append(len(children))

        observer.ChildrenWatch(path, on_children)
        baseline = [memory.private_rss(d.pid) for d in nodes]
        start_workers(workers, nodes, RUN_SECONDS)
        start = time.monotonic()
        time.sleep(4.0)
        leader = ensemble.leader()
        assert leader is not None, [z.mode() for z in ensemble.servers]
        leader.kill9()
        events = [f"killed the leader (myid {leader.myid}) at {time.monotonic() - start:.1f}s"]
        wait_for(lambda: ensemble.leader() is not None, 60)
        events.append(f"a new leader at {time.monotonic() - start:.1f}s")

        where = assert_workers_ok(workers, RUN_SECONDS, 0, events, lossless=True)
        assert owners(observer, path) == before, (before, where)  # same sessions: nobody re-registered
        with lock:
            assert seen and min(seen) == 3, (seen, where)  # nobody left the view
        for d in nodes:
            assert stats(d)["membership"] == "joined" and stats(d)["evictions"]["lru"] == 0
            assert "connection suspended" in d.log()  # the kill reached it: followers drop clients too
            assert "session lost" not in d.log(), d.log()[-2000:]
        assert_settled(nodes, baseline, where)
    finally:
        stop_workers(workers)
        observer.stop()
        observer.close()
        ensemble.stop()
