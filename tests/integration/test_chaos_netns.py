"""Chaos with a cut network: three nodes on hosts of their own, links taken down under load.

Each daemon runs in its own network namespace (``tests/netns.py``), with
ZooKeeper on the bridge's address; the load is the writer-reader of
``test_chaos`` (every byte encodes its key), one process per node, talking
to its daemon over the Unix socket (which crosses namespaces). A seeded
schedule takes one node's link down for longer than the session timeout
(the others drop it from their view; it keeps serving its own clients) and
another's for a moment (connections stall, no RST), then heals both.

Asserted: no wrong byte loaded, no call slower than its timeout allows, a
bounded miss rate; afterwards every node is back in the view, nothing is
pinned or pending, and each daemon's private memory (``tests/memory.py``)
is within ``test_chaos.RSS_BOUND`` of its baseline taken before the load. Skipped with
the reason where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import memory  # noqa: E402
import netns  # noqa: E402
import zk  # noqa: E402
from test_chaos import assert_settled, assert_workers_ok, start_workers, stop_workers  # noqa: E402
from test_cluster import stats, wait_for  # noqa: E402

_why = zk.available() or netns.available()
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))
SEED = int(os.environ.get("EMS_CHAOS_SEED", "11"))
RUN_SECONDS = 22.0
LONG_CUT, SHORT_CUT = 6.0, 1.5  # seconds; the session timeout is 3


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    h = netns.Hosts(3).create()
    yield h
    h.destroy()


def test_cut_links_under_load_never_yield_wrong_bytes_or_hung_calls_and_memory_returns(
        hosts: netns.Hosts, emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(SEED)
    memory.measurable(monkeypatch)
    server = zk.ZooKeeperServer(tmp_path / "zk", host=hosts.gateway).start()
    workers: list[subprocess.Popen[str]] = []
    try:
        secret = tmp_path / "secret"
        secret.write_text("netns-chaos-cluster-secret\n")
        secret.chmod(0o600)
        nodes = []
        for i, addr in enumerate(hosts.addresses):
            cluster = {"name": "cut", "zookeeper": server.hosts, "peer_listen": f"{addr}:11000",
                       "secret_file": str(secret), "replicas": 2, "session_timeout": 3}
            d = emsd_factory(start=False, pool={"size": "128MiB"}, metrics={"listen": f"{addr}:9400"},
                             cluster=cluster)
            d.prefix = hosts.prefix(i)
            nodes.append(d.start())
        wait_for(lambda: all(len(stats(d)["members"]) == 3 for d in nodes))
        baseline = [memory.private_rss(d.pid) for d in nodes]

        start_workers(workers, nodes, RUN_SECONDS)
        start = time.monotonic()
        events = []
        long_victim, short_victim = rng.sample(range(3), 2)
        time.sleep(4.0)
        for victim, seconds in ((long_victim, LONG_CUT), (short_victim, SHORT_CUT)):
            hosts.cut(victim)
            events.append(f"cut {nodes[victim].sections['node']['id']} at {time.monotonic() - start:.1f}s "
                          f"for {seconds}s")
            time.sleep(seconds)
            hosts.heal(victim)
            time.sleep(3.0)
        where = assert_workers_ok(workers, RUN_SECONDS, SEED, events)

        wait_for(lambda: all(stats(d)["membership"] == "joined" and len(stats(d)["members"]) == 3
                             for d in nodes), 60)
        assert_settled(nodes, baseline, where)
    finally:
        stop_workers(workers)
        server.stop()
