"""The disk tier in a cluster, against two real daemons and a real ZooKeeper.

A load through a node, larger than what one of its PINs may bring there (HELLO's ``part``,
``PinRequest.bring``), of blocks that both nodes have moved to disk: the node reads its own
back from its disk (``Promote``) and fetches the other node's, which that node reads from its
own disk for the GET (``Service.peer_promotion``), PIN after PIN, every byte right.

The tiers' directories are under /var/tmp (a real file system: /dev/shm is DRAM).
"""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture
def nodes(zookeeper: zk.ZooKeeperServer, emsd_factory: Any, tmp_path: Path) -> Iterator[list[Any]]:
    """Two joined daemons of 16 MiB, each with a disk tier of its own."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    base = os.environ.get("EMSD_TEST_DISK_DIR", "/var/tmp")
    dirs = [Path(tempfile.mkdtemp(prefix="emsd-disk-cluster-", dir=base)) for _ in range(2)]
    ds = [emsd_factory(start=False, pool=POOL, disk={"dir": str(d), "size": "256MiB", "extent": "4MiB"},
                       cluster={"name": "t", "zookeeper": zookeeper.hosts,
                                "peer_listen": f"127.0.0.1:{zk.free_port()}",
                                "secret_file": str(secret), "session_timeout": 4}) for d in dirs]
    try:
        for d in ds:
            d.start()
        deadline = time.monotonic() + 90  # joins can be slow on a machine loaded by test workers
        while not all(d.metric("emsd_cluster_members") == 2 for d in ds):
            assert time.monotonic() < deadline, "the two daemons did not see each other"
            time.sleep(0.05)
        yield ds
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def batch_kv(batch: int) -> list[list[torch.Tensor]]:
    """The KV of ``BATCH`` blocks saved under batch ``batch``'s keys (2 layers x K, V)."""
    g = torch.Generator().manual_seed(batch)
    return [[torch.randn(BATCH, TOKENS, 16, 32, generator=g) for _ in range(2)] for _ in range(2)]


def keys(batch: int) -> list[int]:
    return [batch * 1000 + k for k in range(BATCH)]


def test_a_load_larger_than_a_pin_brings_reads_both_nodes_disks_with_every_byte_right(
        nodes: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    monkeypatch.setenv("EMS_SOCKET_DIR", str(b.socket_dir))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="disk-cluster")))
    cc = Ems.get_cc()
    slots = list(range(BATCH * TOKENS))
    for batch in range(1, 41):  # 40 MiB through two pools of 16: each node's own blocks go to its disk
        cc.register_kvcache(batch_kv(batch))
        once = CcKvOption(write_rcache=False)  # each block at its owner only
        assert cc.save(slots, hashes=keys(batch), offsets=[TOKENS] * BATCH, option=once).success == BATCH
    assert a.disk_settled() > 0 and b.disk_settled() > 0, (a.log(), b.log())
    want = [batch_kv(batch) for batch in (1, 2, 3)]  # saved first: on disk by now
    dst = [[torch.zeros(LOADED, TOKENS, 16, 32) for _ in range(2)] for _ in range(2)]
    cc.register_kvcache(dst)
    assert cc.exists(keys(1) + keys(2) + keys(3)).success == LOADED  # on either disk: counted
    pins = b.metric("emsd_ops_total", PIN_OK)
    reads_a, reads_b = a.metric("emsd_disk_reads_total"), b.metric("emsd_disk_reads_total")
    res = cc.load(list(range(LOADED * TOKENS)), hashes=keys(1) + keys(2) + keys(3), offsets=[TOKENS] * LOADED)
    assert res.success == LOADED, (a.log(), b.log())
    for i, src in enumerate(want):
        for layer, got in zip(src, dst, strict=True):
            for s, t in zip(layer, got, strict=True):
                assert torch.equal(t[i * BATCH : (i + 1) * BATCH], s)  # every byte
    assert b.metric("emsd_ops_total", PIN_OK) >= pins + 3  # at most 1 MiB brought a PIN: 3 MiB, 3 PINs
    assert b.metric("emsd_disk_reads_total") > reads_b  # its own blocks, from its disk
    assert a.metric("emsd_disk_reads_total") > reads_a  # the other node's, from that node's disk
    assert a.alive() and b.alive()
