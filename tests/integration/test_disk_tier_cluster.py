"""The disk tier in a cluster, against two real daemons and a real ZooKeeper.

- A load through a node, larger than what one of its PINs may bring there (HELLO's
  ``part``, ``PinRequest.bring``), of blocks that both nodes have moved to disk: the node
  reads its own back from its disk (``Promote``) and fetches the other node's, which that
  node reads from its own disk for the GET (``Service.peer_promotion``), PIN after PIN,
  every byte right; with pool checksums on as well.
- A clear through one node removes the namespace from both nodes' disks.
- A node killed with -9 whose DRAM is gone (the pool's shared memory and ledger removed)
  comes back with its disk, and its blocks load again through the other node.
- With two replicas, a node loads the copies on its own disk, also those it holds as a
  replica, with the primary up or killed with -9.
- A drain moves the node's blocks on disk as well as those in DRAM.
- A node that joins is handed its share of the blocks saved before, from the other node's
  disk as well as its DRAM.

The tiers' directories are under /var/tmp (a real file system: /dev/shm is DRAM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

from ems import CcConfig, CcKvOption, Ems, EmsConfig  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]

TOKENS, BATCH, LOADED = 4, 32, 96  # blocks of 4 tokens, 32 KiB each; 32 a save; 96 (3 MiB) a load
POOL = {"size": "16MiB", "page_size": "1MiB"}  # part: 1/16 of it, 1 MiB
PIN_OK = 'op="pin",result="ok"'
TENANT = ("team-a", "A" * 43 + "=")  # access id and key


@pytest.fixture
def nodes(zookeeper: zk.ZooKeeperServer, emsd_factory: Any, tmp_path: Path,
          request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """Two joined daemons of 16 MiB, each with a disk tier of its own (indirect parameter: a
    dict of ``checksum``, ``pool.checksum``, default off; ``replicas``, default 1; ``tenants``,
    default off: then the tenant ``TENANT`` alone, which ``connect`` connects as; ``later``:
    only the first is started, the test starts the second)."""
    param = getattr(request, "param", {})
    pool = {**POOL, "checksum": param.get("checksum", False)}
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    more: dict[str, dict[str, Any]] = {}
    if param.get("tenants"):
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(f'[[tenant]]\naccess_id = "{TENANT[0]}"\naccess_key = "{TENANT[1]}"\n')
        tenants.chmod(0o600)
        more["tenants"] = {"file": str(tenants)}
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    dirs = [Path(tempfile.mkdtemp(prefix="emsd-disk-cluster-", dir=base)) for _ in range(2)]
    ds = [emsd_factory(start=False, pool=pool, disk={"dir": str(d), "size": "256MiB", "extent": "4MiB"},
                       cluster={"name": "t", "zookeeper": zookeeper.hosts,
                                "peer_listen": f"127.0.0.1:{zk.free_port()}",
                                "secret_file": str(secret), "session_timeout": 4,
                                "replicas": param.get("replicas", 1)}, **more) for d in dirs]
    try:
        for d in ds[:1] if param.get("later") else ds:
            d.start()
        if not param.get("later"):
            joined(ds)
        yield ds
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def joined(ds: list[Any]) -> None:
    deadline = time.monotonic() + 90  # joins can be slow on a machine loaded by test workers
    while not all(d.metric("emsd_cluster_members") == 2 for d in ds):
        assert time.monotonic() < deadline, "the two daemons did not see each other"
        time.sleep(0.05)


def batch_kv(batch: int) -> list[list[torch.Tensor]]:
    """The KV of ``BATCH`` blocks saved under batch ``batch``'s keys (2 layers x K, V)."""
    g = torch.Generator().manual_seed(batch)
    return [[torch.randn(BATCH, TOKENS, 16, 32, generator=g) for _ in range(2)] for _ in range(2)]


def keys(batch: int) -> list[int]:
    return [batch * 1000 + k for k in range(BATCH)]


def connect(node: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The SDK on ``node`` (as ``TENANT`` where the node has tenants)."""
    monkeypatch.setenv("EMS_SOCKET_DIR", str(node.socket_dir))
    Ems._reset()
    access_id, access_key = TENANT if "tenants" in node.sections else (None, None)
    Ems.init(EmsConfig(access_id=access_id, access_key=access_key,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="disk-cluster")))
    return Ems.get_cc()


def fill(cc: Any, nodes: list[Any]) -> None:
    """40 MiB through two pools of 16: each node's own blocks go to its disk."""
    slots = list(range(BATCH * TOKENS))
    for batch in range(1, 41):
        cc.register_kvcache(batch_kv(batch))
        once = CcKvOption(write_rcache=False)  # each block at its owner only
        assert cc.save(slots, hashes=keys(batch), offsets=[TOKENS] * BATCH, option=once).success == BATCH
    assert all(d.disk_settled() > 0 for d in nodes), [d.log() for d in nodes]


def filled(nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """``fill`` through the second node: (first node, second node, the SDK on the second)."""
    a, b = nodes
    cc = connect(b, monkeypatch)
    fill(cc, nodes)
    return a, b, cc


def load_first_three(cc: Any, first: int = 1) -> int:
    """Load batches ``first`` to ``first + 2`` (saved among the first: on disk by now) in one
    call; how many blocks loaded (the leading ones), each checked byte for byte."""
    batches = (first, first + 1, first + 2)
    want = [batch_kv(batch) for batch in batches]
    dst = [[torch.zeros(LOADED, TOKENS, 16, 32) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(dst)
    got = int(cc.load(list(range(LOADED * TOKENS)), hashes=[k for b in batches for k in keys(b)],
                      offsets=[TOKENS] * LOADED).success)
    for layer in range(2):
        for kv in range(2):
            src = torch.cat([w[layer][kv] for w in want])
            assert torch.equal(dst[layer][kv][:got], src[:got])  # every byte
    return got


@pytest.mark.parametrize("nodes", [{}, {"checksum": True}], indirect=True, ids=["plain", "checksums"])
def test_a_load_larger_than_a_pin_brings_reads_both_nodes_disks_with_every_byte_right(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, cc = filled(nodes, monkeypatch)
    assert cc.exists(keys(1) + keys(2) + keys(3)).success == LOADED  # on either disk: counted
    pins = b.metric("emsd_ops_total", PIN_OK)
    reads_a, reads_b = a.metric("emsd_disk_reads_total"), b.metric("emsd_disk_reads_total")
    assert load_first_three(cc) == LOADED, (a.log(), b.log())
    assert b.metric("emsd_ops_total", PIN_OK) >= pins + 3  # at most 1 MiB brought a PIN: 3 MiB, 3 PINs
    assert b.metric("emsd_disk_reads_total") > reads_b  # its own blocks, from its disk
    assert a.metric("emsd_disk_reads_total") > reads_a  # the other node's, from that node's disk
    assert a.alive() and b.alive()


def test_a_clear_through_one_node_removes_the_namespace_from_both_disks(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, cc = filled(nodes, monkeypatch)
    cc.clear()
    deadline = time.monotonic() + 30  # the DROP reaches the other member after the answer
    while a.metric("emsd_disk_blocks") + b.metric("emsd_disk_blocks") > 0:
        assert time.monotonic() < deadline, (a.log(), b.log())
        time.sleep(0.05)
    assert cc.exists(keys(1) + keys(2) + keys(3)).success == 0
    assert connect(a, monkeypatch).exists(keys(1)).success == 0  # nor through the other node
    assert a.alive() and b.alive()


def test_a_node_killed_with_its_dram_gone_serves_its_disk_blocks_again(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, cc = filled(nodes, monkeypatch)
    Ems._reset()
    a.kill9()
    for f in Path(a.sections["pool"]["state_dir"]).iterdir():  # its pool and ledger: DRAM is gone
        f.unlink()
    a.start()
    assert "index attached" in a.log(), a.log()
    joined(nodes)
    cc = connect(b, monkeypatch)
    deadline = time.monotonic() + 30  # until b's client sees a again (placement agreed)
    while (got := load_first_three(cc)) < LOADED and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got == LOADED, (a.log(), b.log())
    assert a.metric("emsd_disk_reads_total") > 0  # a's blocks came from a's disk


@pytest.mark.parametrize("nodes", [{"replicas": 2}], indirect=True, ids=["replicas"])
def test_with_two_replicas_a_node_loads_its_own_disk_copies_also_with_the_primary_dead(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block is on both nodes; a load through one reads its own copies from its disk,
    those it holds as a replica too, whether the primary is up or killed with -9."""
    a, b, cc = filled(nodes, monkeypatch)
    fetched = f'peer="{a.sections["node"]["id"]}",op="get"'
    gets = b.metric("emsd_peer_blocks_total", fetched)
    assert load_first_three(cc, 1) == LOADED, (a.log(), b.log())
    assert b.metric("emsd_peer_blocks_total", fetched) == gets  # nothing fetched from the other node
    a.kill9()
    assert load_first_three(cc, 4) == LOADED, b.log()
    assert b.alive()


@pytest.mark.parametrize("nodes", [{}, {"tenants": True}], indirect=True, ids=["plain", "tenants"])
def test_a_drain_moves_the_blocks_on_the_nodes_disk_too(nodes: list[Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``emsctl drain`` of a node whose share is mostly on its disk: every block it owns, in
    DRAM or on disk, reaches the other node, and after it stops every block loads there (a
    tenant's too: read back into its own pages, counted against it on the owner)."""
    a, b, cc = filled(nodes, monkeypatch)
    Ems._reset()
    out = subprocess.run([sys.executable, "-m", "emsd.ctl", "--socket-dir", str(a.socket_dir), "drain"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout, out.stderr, a.log())
    moved = int(out.stdout.split("drained: ")[1].split()[0])
    assert moved > 16 << 5, out.stdout  # more than a's 16 MiB pool holds of 32 KiB blocks
    assert a.terminate() == 0
    cc = connect(b, monkeypatch)
    loaded = sum(load_first_three(cc, first) for first in range(1, 40, 3))  # batches 1-39
    assert loaded == 13 * LOADED, (out.stderr, b.log())
    assert b.alive()


def _stats(node: Any) -> dict[str, Any]:
    from ems.client import DaemonClient
    from emsd.transport.frames import Op

    client = DaemonClient(node.socket_dir / "emsd.sock")
    client.connect({"access_id": TENANT[0], "access_key": TENANT[1]} if "tenants" in node.sections else {})
    try:
        return client.call(Op.STATS, {}, timeout=10)[0]
    finally:
        client.close()


@pytest.mark.parametrize("nodes", [{"later": True}, {"later": True, "tenants": True}], indirect=True,
                         ids=["plain", "tenants"])
def test_a_joining_node_is_handed_its_share_from_the_other_nodes_disk_too(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """40 MiB saved while the first node was alone, most of it on its disk by then: the node
    that joins is handed its share of both (``emsd.handoff``), and with the first killed
    with -9 every block of that share loads through the newcomer, byte for byte (a tenant's
    too: read back into its own pages, stored in its own pages on the newcomer)."""
    a, b = nodes
    fill(connect(a, monkeypatch), [a])
    b.start()
    joined(nodes)
    deadline = time.monotonic() + 120
    while _stats(a)["handoff"]["passes"] < 1:
        assert time.monotonic() < deadline, a.log()
        time.sleep(0.1)
    handed = _stats(a)["handoff"]
    assert handed["kept"] == 0 and handed["moved"] > 16 << 5, handed  # more than a's pool holds
    a.kill9()
    while b.metric("emsd_cluster_members") != 1:
        time.sleep(0.05)
    cc = connect(b, monkeypatch)
    dst = [[torch.zeros(1, TOKENS, 16, 32) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(dst)
    found = 0
    for batch in range(1, 41):
        want = batch_kv(batch)
        for i, key in enumerate(keys(batch)):
            if cc.load(list(range(TOKENS)), hashes=[key], offsets=[TOKENS]).success:
                found += 1
                assert all(torch.equal(dst[la][kv][0], want[la][kv][i]) for la in range(2) for kv in range(2))
    assert found == handed["moved"], (found, handed, b.log())
    assert b.alive()
