"""Several emsd processes joined through a real ZooKeeper: blocks saved on one node load on another."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

from ems import CcConfig, CcKvOption, Ems, EmsConfig  # noqa: E402
from ems.client import DaemonClient  # noqa: E402
from emsd.transport.frames import Op  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]
BLOCK, BLOCKS = 4, 48


def stats(d: Any) -> dict[str, Any]:
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        return client.call(Op.STATS, {}, timeout=5)[0]
    finally:
        client.close()


def holdings(nodes: Any) -> list[Any]:
    """What each node holds and saw, for an assertion on where blocks live to print when it
    fails: its entries, view, handoff counts and its last log lines about peers."""
    out = []
    for d in nodes:
        st = stats(d)
        peers = [line for line in d.log().splitlines() if "peer" in line.lower()][-4:]
        out.append((st["node"], st["entries"], st["membership"], st["members"], st.get("handoff"), peers))
    return out


def assert_copies_from_handoff(st: Any, why: Any) -> None:
    """Saved with ``write_rcache`` off, a node keeps no copy of what it forwarded; the only
    read-cache copies are those a handoff left when a ring change after the save moved
    blocks a node had kept as an owner to their new owners (emsd.handoff), at most one a
    block moved."""
    copies = sum(x["cached"] for x in st)
    moved = sum((x.get("handoff") or {}).get("moved", 0) for x in st)
    assert copies <= moved, why


def use(d: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point the process-wide SDK at daemon ``d``."""
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    return Ems.get_cc()


def kv(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(BLOCKS, BLOCK, 8, 64, generator=g) for _ in range(2)] for _ in range(2)]


SLOTS = list(range(BLOCKS * BLOCK))
KEYS = [1000 + i for i in range(BLOCKS)]


def load_equal(d: Any, src: list[list[torch.Tensor]], keys: list[int],
               monkeypatch: pytest.MonkeyPatch) -> Any:
    """Load ``keys`` (one block of ``src``'s dim-1 size each) through daemon ``d`` into zeroed
    copies of ``src``: every key must hit and every byte equal ``src``. Returns the SDK
    handle, still pointed at ``d``."""
    n, block = len(keys), src[0][0].shape[1]
    cc = use(d, monkeypatch)
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    res = cc.load(list(range(n * block)), hashes=keys, offsets=[block] * n)
    assert (res.success, res.total) == (n, n)
    pairs = [(x, y) for la, lb in zip(src, dst, strict=True) for x, y in zip(la, lb, strict=True)]
    assert all(torch.equal(x, y) for x, y in pairs)
    return cc


def saved_at_owners(cluster: Any, monkeypatch: Any, seed: int) -> tuple[Any, Any, int]:
    """Two nodes; ``KEYS`` saved through a with ``write_rcache`` off, so each block lives at
    its owner only. Returns (a, b, blocks b holds)."""
    a, b = cluster(2)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(seed))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    return a, b, stats(b)["entries"]


def test_saved_on_one_node_loads_on_another_with_identical_bytes(cluster: Any, monkeypatch: Any) -> None:
    a, b = cluster(2)
    src = kv(1)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS

    cc = load_equal(b, src, KEYS, monkeypatch)
    # What b fetched stays as a read cache: now it is there even for read_local_only.
    local = cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(read_local_only=True))
    assert local.success == BLOCKS
    # Copies of blocks owned elsewhere are marked so that eviction takes them first.
    sa, sb = stats(a), stats(b)
    assert sa["cached"] > 0 and sb["cached"] > 0
    assert sa["cached"] + sb["cached"] == BLOCKS  # each block is a copy on exactly one of the two
    # What an operator sees: membership, transport, and the blocks that crossed, per peer.
    assert b.http("/readyz") == (200, b"ready\n")
    assert b.metric("emsd_cluster_members") == 2
    assert b.metric("emsd_cluster_membership_state", 'state="joined"') == 1
    assert b.metric("emsd_peer_blocks_total", f'op="get",peer="{a.sections["node"]["id"]}"') == sb["cached"]
    assert a.metric("emsd_peer_blocks_total", f'op="put",peer="{b.sections["node"]["id"]}"') > 0
    assert b.metric("emsd_peer_bytes_total", f'direction="in",peer="{a.sections["node"]["id"]}"') > 0
    ids = {a.sections["node"]["id"], b.sections["node"]["id"]}
    assert sa["transport"] == "tcp" and set(sa["share"]) == ids


def test_each_node_holds_its_share_and_read_local_only_stays_home(cluster: Any, monkeypatch: Any) -> None:
    a, b = cluster(2)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(2))
    res = cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(write_rcache=False))
    assert res.success == BLOCKS
    sa, sb = stats(a), stats(b)
    held_a, held_b = sa["entries"] - sa["cached"], sb["entries"] - sb["cached"]
    assert held_a + held_b == BLOCKS, holdings((a, b))  # each block is owned once, at its owner
    assert_copies_from_handoff((sa, sb), holdings((a, b)))
    assert 0.2 * BLOCKS <= held_b <= 0.8 * BLOCKS  # about half each (consistent hashing, 2 nodes)

    cc = use(b, monkeypatch)
    cc.register_kvcache(kv(3))
    only_b = cc.exists(KEYS, option=CcKvOption(read_local_only=True)).success
    local = cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(read_local_only=True))
    assert local.success == only_b < BLOCKS
    # Without read_local_only, exists asks the owners (a scheduler's lookup sees the whole
    # cluster), and moves nothing.
    assert cc.exists(KEYS).success == BLOCKS
    assert cc.exists([*KEYS[:3], 999_999, *KEYS[3:]]).success == 3  # leading hits only
    assert stats(b)["entries"] == held_b  # nothing was fetched


def test_a_killed_owner_costs_only_its_share_and_calls_stay_bounded(cluster: Any, monkeypatch: Any) -> None:
    import threading

    a, b = cluster(2)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(4))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    held_a = stats(a)["entries"]  # each block lives at its owner only
    one = list(range(BLOCK))
    slowest, stop = [0.0], threading.Event()

    def load_loop() -> None:  # the load the kill lands in
        while not stop.is_set():
            t0 = time.monotonic()
            cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                    option=CcKvOption(timeout=1000, write_rcache=False))  # keeps no copies of b's blocks
            slowest[0] = max(slowest[0], time.monotonic() - t0)

    loader = threading.Thread(target=load_loop)
    loader.start()
    try:
        time.sleep(0.3)
        b.kill9()
        time.sleep(1.0)
    finally:
        stop.set()
        loader.join(10)
    assert not loader.is_alive() and slowest[0] < 2.0  # every call answered within its timeout
    hits = [cc.load(one, hashes=[k], offsets=[BLOCK],
                    option=CcKvOption(timeout=1000, write_rcache=False)).success for k in KEYS]
    assert sum(hits) == held_a  # a's own blocks all load; b's share, and only it, misses
    assert a.alive()


def test_clear_drops_the_namespace_on_every_member_and_names_a_dead_one(cluster: Any,
                                                                          monkeypatch: Any) -> None:
    from ems import EmsErrorCode, EmsException

    a, b, held_b = saved_at_owners(cluster, monkeypatch, 7)
    assert 0 < held_b < BLOCKS  # each block at its owner only
    cc = use(b, monkeypatch)
    cc.register_kvcache(kv(8))
    assert cc.exists(KEYS).success == BLOCKS
    assert cc.clear() == held_b  # b evicts its share; a, asked over the peer link, its own
    assert stats(a)["entries"] == 0 and stats(b)["entries"] == 0
    assert cc.exists(KEYS).success == 0
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(9))
    assert cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == 0
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS  # afresh
    b.kill9()  # still in a's view until its ZooKeeper session expires
    with pytest.raises(EmsException) as err:
        cc.clear()
    assert err.value.status_code() == EmsErrorCode.EMS_IO_ERROR and "1 cluster member" in str(err.value)
    assert cc.exists(KEYS, option=CcKvOption(read_local_only=True)).success == 0  # a's part is gone
    assert a.alive()


def test_zookeeper_down_keeps_serving_and_the_cluster_rejoins(cluster: Any, zookeeper: Any,
                                                               monkeypatch: Any) -> None:
    a, b = cluster(2)
    src = kv(5)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    zookeeper.stop()
    wait_for(lambda: stats(a)["membership"] in ("suspended", "lost"))
    cc = use(b, monkeypatch)  # the last view still routes to a
    cc.register_kvcache(kv(6))
    assert cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    zookeeper.start()
    # joined again, then the views converge: each sees the other once its children watch fires
    wait_for(lambda: all(stats(d)["membership"] == "joined" and len(stats(d)["members"]) == 2
                         for d in (a, b)))
    assert a.alive() and b.alive()


def test_a_peer_with_the_wrong_secret_is_refused_and_the_daemon_stays_up(cluster: Any) -> None:
    import asyncio

    from emsd.metrics import Metrics
    from emsd.pool.store import BlockStore
    from emsd.service import Service
    from emsd.transport.peer import PeerConnection, PeerError

    (a,) = cluster(1)
    port = int(a.sections["cluster"]["peer_listen"].rsplit(":", 1)[1])
    owner = Service(BlockStore(8 << 20, 1 << 20), "intruder", "test", Metrics())
    pool = memoryview(bytearray(8 << 20))

    async def intrude() -> None:
        with pytest.raises(PeerError):
            intruder = PeerConnection(owner, pool, "intruder", b"not-the-cluster-secret")
            await intruder.connect("127.0.0.1", port)

    asyncio.run(intrude())
    assert a.alive() and stats(a)["membership"] == "joined"


def test_a_second_daemon_with_a_taken_node_id_exits_and_the_first_stays_in_the_view(
        cluster: Any, emsd_factory: Any) -> None:
    a, b = cluster(2)
    cfg = dict(a.sections["cluster"])
    cfg["peer_listen"] = f"127.0.0.1:{zk.free_port()}"
    twin = emsd_factory(start=False, node={"id": a.sections["node"]["id"]}, cluster=cfg)
    twin.start(wait=False)
    assert twin.proc.wait(60) == 2
    assert "already registered" in twin.log()
    time.sleep(1.0)  # had the twin deleted a's registration on its way out, b would see it go
    assert sorted(stats(b)["members"]) == sorted([a.sections["node"]["id"], b.sections["node"]["id"]])
    assert a.alive() and stats(a)["membership"] == "joined"


def test_a_node_whose_vnodes_differ_adopts_the_cluster_record_and_loads_hit(
        cluster: Any, emsd_factory: Any, monkeypatch: Any) -> None:
    """b's config says vnodes=160, the cluster's record (written by a, the first node) 512: b
    places keys by the record, so everything saved through a loads through b (with its own ring,
    b looked for some blocks at the wrong owner and missed), and b says so."""
    (a,) = cluster(1)
    cfg = dict(a.sections["cluster"])
    b = emsd_factory(cluster={**cfg, "peer_listen": f"127.0.0.1:{zk.free_port()}", "vnodes": 160})
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
    src = kv(11)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    load_equal(b, src, KEYS, monkeypatch)

    sb = stats(b)
    assert (sb["vnodes"], sb["replicas"], sb["placement_record"]) == (512, 1, 1)
    assert sb["placement_config"] == {"vnodes": 160, "replicas": 1} and sb["placement_config_differs"]
    assert sb["placement_differs"] == {} and stats(a)["placement_differs"] == {}
    assert not stats(a)["placement_config_differs"]
    assert ("this node's config says vnodes=160 replicas=1, the cluster's record vnodes=512 replicas=1"
            in b.log())
    assert [d.metric("emsd_cluster_placement_differs") for d in (a, b)] == [0, 1]
    shown = emsctl(b, "status")
    assert "PLACEMENT   this node's config vnodes=160 replicas=1 differs from the cluster's record " \
           "vnodes=512" in shown.stdout, shown.stdout + shown.stderr


def emsctl(d: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(d.socket_dir), *args],
                          capture_output=True, text=True, timeout=60)


def placement(d: Any) -> tuple[int, int, int]:
    """(vnodes, replicas, record version) daemon ``d`` places keys by."""
    st = stats(d)
    return st["vnodes"], st["replicas"], st["placement_record"]


def test_emsctl_placement_set_changes_every_nodes_ring_at_once(
        cluster: Any, emsd_factory: Any, monkeypatch: Any) -> None:
    """One command through a: both nodes place by vnodes=64 replicas=2 (so each holds every new
    block), a node joining later adopts it over its own config, bad values are refused."""
    a, b = cluster(2)
    bad = emsctl(a, "placement", "set", "--vnodes", "0", "--replicas", "1")
    assert bad.returncode == 1 and "vnodes must be an integer in 1..4096" in bad.stderr, bad.stderr
    done = emsctl(a, "placement", "set", "--vnodes", "64", "--replicas", "2")
    assert done.returncode == 0, done.stderr
    assert "placement record version 2: vnodes=64 replicas=2 on every node" in done.stdout
    wait_for(lambda: all(placement(d) == (64, 2, 2) for d in (a, b)))
    assert all(stats(d)["placement_config_differs"] for d in (a, b))  # their files still say 512, 1
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(5))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    wait_for(lambda: (stats(a)["entries"], stats(b)["entries"]) == (BLOCKS, BLOCKS))  # two owners each

    c = emsd_factory(cluster={**a.sections["cluster"], "peer_listen": f"127.0.0.1:{zk.free_port()}"})
    wait_for(lambda: len(stats(c)["members"]) == 3)
    assert placement(c) == (64, 2, 2)
    assert a.alive() and b.alive()


def test_placement_set_without_zookeeper_fails_at_once_and_changes_nothing(
        cluster: Any, zookeeper: zk.ZooKeeperServer) -> None:
    (a,) = cluster(1)
    zookeeper.stop()
    wait_for(lambda: stats(a)["membership"] != "joined")
    out = emsctl(a, "placement", "set", "--vnodes", "64", "--replicas", "1")
    assert out.returncode == 1 and "the placement record was not written" in out.stderr, out.stderr
    zookeeper.start()
    wait_for(lambda: stats(a)["membership"] == "joined")
    assert placement(a) == (512, 1, 1)  # not queued and written later


def test_a_joining_node_takes_new_saves_for_its_share(cluster: Any, emsd_factory: Any,
                                                      monkeypatch: Any) -> None:
    (a,) = cluster(1)
    cfg = dict(a.sections["cluster"])
    cfg["peer_listen"] = f"127.0.0.1:{zk.free_port()}"
    b = emsd_factory(cluster=cfg)
    wait_for(lambda: len(stats(a)["members"]) == 2)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(7))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    assert 0 < stats(b)["entries"] < BLOCKS  # the newcomer owns part of the new saves
    b.terminate()
    wait_for(lambda: len(stats(a)["members"]) == 1)
    assert cc.save(SLOTS, hashes=[k + 10_000 for k in KEYS], offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    assert cc.exists([k + 10_000 for k in KEYS]).success == BLOCKS  # all local again


def serves_its_share_alone(a: Any, b: Any, src: list[list[torch.Tensor]], monkeypatch: Any) -> int:
    """Kill ``a`` with -9, then load each of ``KEYS`` (one block of ``src`` each) through ``b``
    alone: how many hit, each hit checked byte for byte."""
    a.kill9()
    wait_for(lambda: len(stats(b)["members"]) == 1)
    cc = use(b, monkeypatch)
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    hits = [i for i, key in enumerate(KEYS)
            if cc.load(list(range(i * BLOCK, (i + 1) * BLOCK)), hashes=[key], offsets=[BLOCK]).success]
    pairs = [(x, y) for la, lb in zip(src, dst, strict=True) for x, y in zip(la, lb, strict=True)]
    assert all(torch.equal(x[i], y[i]) for i in hits for x, y in pairs)
    return len(hits)


def test_a_joining_node_is_handed_its_share_of_the_blocks_saved_before(cluster: Any, emsd_factory: Any,
                                                                      monkeypatch: Any) -> None:
    """A node that joins gets the blocks of its share saved before it came (``emsd.handoff``):
    with the node that held them killed with -9, that share loads through the newcomer, byte
    for byte, and only that share misses. The old holder keeps them as read-cache copies."""
    (a,) = cluster(1)
    src = kv(12)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS  # a owns all
    cfg = dict(a.sections["cluster"])
    cfg["peer_listen"] = f"127.0.0.1:{zk.free_port()}"
    b = emsd_factory(cluster=cfg)
    wait_for(lambda: stats(a)["handoff"]["passes"] >= 1, timeout=60)
    handed, share = stats(a)["handoff"], stats(b)["entries"]
    assert 0 < share < BLOCKS and handed["moved"] == share and handed["kept"] == 0
    assert a.metric("emsd_handoff_blocks_total", 'result="moved"') == share
    assert a.metric("emsd_handoff_passes_total") == handed["passes"]
    status = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(a.socket_dir), "status"],
                            capture_output=True, text=True, timeout=30)
    assert f"handoff     {share} blocks moved to new owners, 0 kept" in status.stdout, status
    assert stats(a)["entries"] == BLOCKS  # a still holds every block, b's share as copies
    assert serves_its_share_alone(a, b, src, monkeypatch) == share


def test_saves_of_a_restarting_nodes_share_are_handed_back_when_it_returns(cluster: Any,
                                                                          monkeypatch: Any) -> None:
    """A rolling update: b restarts (warm); what a saved of b's share meanwhile goes to b once
    b is back, so that with a killed with -9 it all loads through b, byte for byte."""
    a, b = cluster(2)
    b.terminate()
    wait_for(lambda: len(stats(a)["members"]) == 1)
    src = kv(14)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS  # a owns all now
    b.start()
    wait_for(lambda: stats(a)["handoff"]["moved"] > 0, timeout=60)  # counted as a pass ends
    share = stats(b)["entries"]
    assert 0 < share < BLOCKS and stats(a)["handoff"]["moved"] == share
    assert serves_its_share_alone(a, b, src, monkeypatch) == share


def test_with_handoff_off_a_joining_node_gets_nothing_saved_before(cluster: Any, emsd_factory: Any,
                                                                   monkeypatch: Any) -> None:
    """``cluster.handoff = false``: the blocks stay where they were saved, as owned blocks."""
    from emsd.handoff import SETTLE

    (a,) = cluster(1, handoff=False)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(13))
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    cfg = dict(a.sections["cluster"])
    cfg["peer_listen"] = f"127.0.0.1:{zk.free_port()}"
    b = emsd_factory(cluster=cfg)
    wait_for(lambda: len(stats(a)["members"]) == 2)
    time.sleep(2 * SETTLE + 1.0)  # what a handoff would take to start and end here
    assert stats(b)["entries"] == 0
    assert stats(a)["handoff"]["passes"] == 0 and stats(a)["cached"] == 0


def test_with_two_replicas_a_killed_owner_costs_nothing(cluster: Any, monkeypatch: Any) -> None:
    a, b, c = cluster(3, replicas=2)
    src = kv(8)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False)).success == BLOCKS
    st = [stats(d) for d in (a, b, c)]
    held = [x["entries"] - x["cached"] for x in st]
    assert sum(held) == 2 * BLOCKS, holdings((a, b, c))  # every block owned at both of its owners
    assert_copies_from_handoff(st, holdings((a, b, c)))
    assert all(0 < h < 2 * BLOCKS for h in held)

    b.kill9()  # still in the ring until its session expires: its keys fall to their other owner
    cc = use(c, monkeypatch)
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    res = cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(timeout=5000))
    assert res.success == BLOCKS
    pairs = [(x, y) for la, lb in zip(src, dst, strict=True) for x, y in zip(la, lb, strict=True)]
    assert all(torch.equal(x, y) for x, y in pairs)


def test_single_block_saves_and_loads_succeed_wherever_the_owner_is(cluster: Any, monkeypatch: Any) -> None:
    a, b = cluster(2)
    cc = use(a, monkeypatch)
    cc.register_kvcache(kv(9))
    one = list(range(BLOCK))
    for key in KEYS[:12]:  # some owned by a (nothing to forward), some by b
        assert cc.save(one, hashes=[key], offsets=[BLOCK]).success == 1
    cc = use(b, monkeypatch)
    cc.register_kvcache(kv(10))
    for key in KEYS[:12]:
        assert cc.load(one, hashes=[key], offsets=[BLOCK]).success == 1
    assert a.alive() and b.alive()


def test_a_save_of_blocks_held_as_copies_gives_them_back_to_an_owner_that_lost_them(
        cluster: Any, monkeypatch: Any) -> None:
    a, b = cluster(2)
    src = kv(21)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    copies = stats(a)["cached"]
    assert copies > 0  # a keeps what it forwarded to b as read-cache copies
    b.terminate()  # b comes back cold (its pool and ledger removed): its share is gone
    for f in Path(b.sections["pool"]["state_dir"]).iterdir():
        f.unlink()
    b.start()
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in (a, b)))
    assert stats(b)["entries"] == 0
    assert use(b, monkeypatch).exists(KEYS).success < BLOCKS

    cc = use(a, monkeypatch)  # the same prompt saved again through a: the copies are PRESENT...
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert stats(b)["entries"] == copies  # ...and a gave b back the blocks it had lost
    load_equal(b, src, KEYS, monkeypatch)
    cc = use(a, monkeypatch)  # once the owner has them, a save again moves no block
    cc.register_kvcache(src)
    sent = a.metric("emsd_peer_blocks_total", f'op="put",peer="{b.sections["node"]["id"]}"')
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert a.metric("emsd_peer_blocks_total", f'op="put",peer="{b.sections["node"]["id"]}"') == sent


def test_a_save_of_copies_whose_owner_is_stopped_answers_within_its_timeout(
        cluster: Any, monkeypatch: Any) -> None:
    """A save through RESERVE (grants off) of keys held here as copies asks their owner whether
    it still holds them before answering: within the call's budget, so a stopped owner costs
    the save its time, never a failure past its timeout."""
    a, b = cluster(2, pool={"grants": False})
    src = kv(23)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert stats(a)["cached"] > 0  # copies of b's blocks
    os.kill(b.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        res = cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(timeout=1000))
        took = time.monotonic() - t0
    finally:
        os.kill(b.pid, signal.SIGCONT)
    assert took < 1.5
    assert res.success == BLOCKS  # every block is here, and its owner held it before it stopped
    assert a.alive()


def test_reads_through_a_full_node_cost_its_own_blocks_at_most_its_read_cache_share(
        cluster: Any, monkeypatch: Any) -> None:
    """Loads through a node whose pool is full of blocks it owns fetch copies of the other
    node's blocks; the copies take at most pool.read_cache_share of the pool (4 MiB of 64
    here) from the node's own blocks, which the cluster finds only there, and beyond that
    evict only other copies. Before, one large load with write_rcache off took as much as it
    fetched. A load larger than that room loads whole all the same: each PIN brings at most
    that room (``Service.load_part``, ``PinRequest.bring``), released before the next."""
    a, b = cluster(2, pool={"page_size": "1MiB"})
    cc = use(b, monkeypatch)
    cc.register_kvcache(kv(31))
    batches = [[100_000 * (r + 1) + i for i in range(BLOCKS)] for r in range(100)]
    for keys in batches:  # 150 MiB saved, each block only at its owner: both pools fill up
        assert cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS,
                       option=CcKvOption(write_rcache=False)).success == BLOCKS
    st = stats(b)
    assert st["bytes_used"] > 0.9 * st["capacity"] and st["cached"] == 0
    block, owned = st["bytes_used"] // st["entries"], st["entries"]

    def lost() -> int:
        """Bytes of b's own blocks gone since the saves."""
        now = stats(b)
        return (owned - (now["entries"] - now["cached"])) * block

    big = [k for keys in batches[-10:] for k in keys]  # 15 MiB in one load, half of it a's
    g = torch.Generator().manual_seed(3)
    cc.register_kvcache([[torch.randn(len(big), BLOCK, 8, 64, generator=g) for _ in range(2)]
                         for _ in range(2)])
    res = cc.load(list(range(len(big) * BLOCK)), hashes=big, offsets=[BLOCK] * len(big),
                  option=CcKvOption(write_rcache=False))
    assert res.success == len(big)  # 4 MiB (HELLO's part) brought a PIN: every copy finds room
    assert lost() <= 4 << 20  # not the 7.5 MiB it fetched
    cc.register_kvcache(kv(32))
    for keys in batches[-25:]:  # 37 MiB of loads, copies kept
        assert cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    assert stats(b)["cached"] > 0  # a read cache, in the room the first load left free...
    assert lost() <= 4 << 20  # ...and no more of b's own blocks
    assert a.alive() and b.alive()


def test_a_load_that_ends_at_a_miss_costs_one_pin(cluster: Any, monkeypatch: Any) -> None:
    """A load whose tail is nowhere stops at the first missing block: one PIN, which fetches
    what the other node holds. The PIN's answer says ``more`` only when fetched blocks found
    no room (the parts of a load larger than that room, above); before, the SDK pinned the
    rest once more after every short part, asking the owners again for what they lack."""
    a, b, _ = saved_at_owners(cluster, monkeypatch, 13)
    cc = use(b, monkeypatch)
    cc.register_kvcache(kv(14))
    keys = KEYS[:-2] + [9_000_001, 9_000_002]  # the last two saved nowhere
    pins = b.metric("emsd_ops_total", 'op="pin",result="ok"')
    res = cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS, option=CcKvOption(write_rcache=False))
    assert res.success == BLOCKS - 2
    assert b.metric("emsd_ops_total", 'op="pin",result="ok"') == pins + 1
    for field in ("more", "bring"):  # as from an emsd whose answers never say more
        cc._connected().info.pop(field)
    res = cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS, option=CcKvOption(write_rcache=False))
    assert res.success == BLOCKS - 2
    assert b.metric("emsd_ops_total", 'op="pin",result="ok"') == pins + 3  # the rest asked for again
    assert a.alive() and b.alive()


def test_a_load_with_write_rcache_off_keeps_no_copy(cluster: Any, monkeypatch: Any) -> None:
    a, b, held_b = saved_at_owners(cluster, monkeypatch, 11)
    cc = use(b, monkeypatch)
    src, dst = kv(11), kv(12)
    cc.register_kvcache(dst)
    res = cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=CcKvOption(write_rcache=False))
    assert res.success == BLOCKS
    pairs = [(x, y) for la, lb in zip(src, dst, strict=True) for x, y in zip(la, lb, strict=True)]
    assert all(torch.equal(x, y) for x, y in pairs)  # the bytes arrived...
    st = stats(b)
    assert st["entries"] == held_b and st["pinned"] == 0  # ...and the copies went with the release
    assert cc.load(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS  # default: kept
    assert stats(b)["entries"] == BLOCKS


def test_injected_peer_and_pool_faults_cost_hits_never_bytes(cluster: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("EMSD_FAULTS", "peer.get=error:0.3,peer.put=drop:0.2,peer.serve=delay:0.3:0.05,"
                                      "pool.reserve=error:0.1,seed=11")
    a, b = cluster(2)
    src = kv(13)
    saved = []
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    for r in range(12):
        keys = [70_000 + 100 * r + i for i in range(BLOCKS)]
        if cc.save(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS,
                   option=CcKvOption(write_rcache=False, timeout=2000)).success == BLOCKS:
            saved.append(keys)
    cc = use(b, monkeypatch)
    hits = 0
    for keys in saved:
        dst = [[torch.zeros_like(t) for t in layer] for layer in src]
        cc.register_kvcache(dst)
        res = cc.load(SLOTS, hashes=keys, offsets=[BLOCK] * BLOCKS,
                      option=CcKvOption(write_rcache=False, timeout=2000))
        hits += res.success
        for la, lb in zip(src, dst, strict=True):  # what loads is exactly what was saved
            for x, y in zip(la, lb, strict=True):
                assert torch.equal(x[: res.success], y[: res.success])
    assert 0 < len(saved) < 12  # the injected pool faults failed some saves...
    assert 0 < hits < len(saved) * BLOCKS  # ...and the peer faults cost some hits
    assert a.metric("emsd_peer_errors_total", f'op="put",peer="{b.sections["node"]["id"]}"') > 0
    assert a.alive() and b.alive()
    assert "fault injection ON" in a.log()
