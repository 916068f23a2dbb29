"""Saves in one round trip (``pool.grants``): a real daemon, the SDK, real bytes.

After its first save of a block size, a connection holds chunks of that size
granted ahead of time, and its next saves copy into them and send one PUT.
What is checked: the bytes that load back, ``success`` for new, present and
refused keys, what the daemon holds for a connection and gives back when it
goes, MLA namespaces (every TP rank saves the same keys) keeping RESERVE, and
a PUT on a node that does not own the blocks forwarding them to their owner.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

from ems import CcConfig, CcKvOption, Ems, EmsConfig  # noqa: E402
from ems.cc_v1.cc_config import KVCacheType  # noqa: E402
from ems.client import DaemonClient  # noqa: E402
from emsd.transport.frames import Op  # noqa: E402

pytestmark = pytest.mark.usefixtures("reset_sdk")
BLOCK, BLOCKS = 4, 32


def use(d: Any, monkeypatch: pytest.MonkeyPatch, kvcache_type: KVCacheType = KVCacheType.MHA) -> Any:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="g", kvcache_type=kvcache_type)))
    return Ems.get_cc()


def kv(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(BLOCKS, BLOCK, 8, 64, generator=g) for _ in range(2)] for _ in range(2)]


def ops(d: Any, op: str) -> float:
    return d.metric("emsd_ops_total", f'op="{op}",result="ok"')


def granted(d: Any) -> int:
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        return int(client.call(Op.STATS, {}, timeout=5)[0]["granted"])
    finally:
        client.close()


def save(cc: Any, keys: list[int], first_block: int = 0, option: CcKvOption | None = None) -> Any:
    slots = list(range(first_block * BLOCK, (first_block + len(keys)) * BLOCK))
    return cc.save(slots, hashes=keys, offsets=[BLOCK] * len(keys), option=option)


def loads_equal(cc: Any, src: list[list[torch.Tensor]], keys: list[int]) -> bool:
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    try:
        hits = cc.load(list(range(len(keys) * BLOCK)), hashes=keys, offsets=[BLOCK] * len(keys)).success
        n = len(keys)
        return hits == n and all(torch.equal(x[:n], y[:n]) for la, lb in zip(src, dst, strict=True)
                                 for x, y in zip(la, lb, strict=True))
    finally:
        cc.register_kvcache(src)


def started(emsd_factory: Any, monkeypatch: Any, seed: int, **pool: Any) -> tuple[Any, Any, Any]:
    """A daemon with grants on (and ``pool`` settings), the SDK on it, ``kv(seed)`` registered."""
    d = emsd_factory(pool={"grants": True, **pool})
    cc = use(d, monkeypatch)
    src = kv(seed)
    cc.register_kvcache(src)
    return d, cc, src


def test_saves_after_the_first_go_into_granted_chunks_with_one_put(emsd_factory: Any,
                                                                   monkeypatch: Any) -> None:
    d, cc, src = started(emsd_factory, monkeypatch, 1)
    assert save(cc, list(range(8))).success == 8  # RESERVE + COMMIT, then it asks for chunks
    assert (ops(d, "reserve"), ops(d, "put")) == (1, 0)
    for i in range(1, 4):
        assert save(cc, list(range(8 * i, 8 * i + 8)), 8 * i).success == 8
    assert (ops(d, "reserve"), ops(d, "commit"), ops(d, "put")) == (1, 1, 3)
    assert loads_equal(cc, src, list(range(BLOCKS)))
    block_bytes = 2 * 2 * BLOCK * 8 * 64 * 4
    assert d.metric("emsd_op_bytes_total", 'op="put"') == 24 * block_bytes
    # What the connection holds for its next save; it all goes back when it closes.
    assert granted(d) >= 8 * block_bytes
    Ems._reset()
    assert granted(d) == 0


def test_a_put_of_present_keys_succeeds_without_storing_them_again(emsd_factory: Any,
                                                                   monkeypatch: Any) -> None:
    d, cc, src = started(emsd_factory, monkeypatch, 2)
    assert save(cc, list(range(8))).success == 8
    entries = d.metric("emsd_pool_entries")
    assert save(cc, [3, 4, 100, 101, 5], 3).success == 5  # three present, two new
    assert ops(d, "put") == 1 and d.metric("emsd_pool_entries") == entries + 2
    assert loads_equal(cc, src, list(range(8)))


def test_a_put_cut_by_admission_keeps_its_chunks_for_the_next_save(emsd_factory: Any,
                                                                   monkeypatch: Any) -> None:
    d, cc, src = started(emsd_factory, monkeypatch, 3, admit_after=2)
    assert save(cc, list(range(8))).success == 0  # RESERVE: first sightings, nothing admitted
    assert save(cc, list(range(8))).success == 8  # PUT: seen twice, admitted
    assert save(cc, [8, 9, 10], 8).success == 0  # PUT: first sightings, cut at the first
    held = granted(d)
    assert save(cc, [8, 9, 10], 8).success == 3  # PUT again, into the chunks the cut kept
    assert ops(d, "put") == 3 and granted(d) <= held
    assert loads_equal(cc, src, list(range(11)))


def test_mla_namespaces_save_with_reserve_and_hold_no_chunks(emsd_factory: Any, monkeypatch: Any) -> None:
    d = emsd_factory(pool={"grants": True})
    cc = use(d, monkeypatch, KVCacheType.MLA)
    cc.register_kvcache(kv(4))
    for i in range(3):
        assert save(cc, list(range(8 * i, 8 * i + 8)), 8 * i).success == 8
    assert (ops(d, "reserve"), ops(d, "put"), ops(d, "grant")) == (3, 0, 0) and granted(d) == 0


def test_grants_off_saves_with_reserve_and_never_asks(emsd_factory: Any, monkeypatch: Any) -> None:
    d = emsd_factory(pool={"grants": False})
    cc = use(d, monkeypatch)
    cc.register_kvcache(kv(5))
    for i in range(3):
        assert save(cc, list(range(8 * i, 8 * i + 8)), 8 * i).success == 8
    assert (ops(d, "reserve"), ops(d, "put")) == (3, 0)
    assert d.metric("emsd_ops_total", 'op="grant",result="error"') == 0


@pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))
def test_a_put_on_a_node_that_does_not_own_the_blocks_forwards_them(zookeeper: zk.ZooKeeperServer,
                                                                   emsd_factory: Any, monkeypatch: Any,
                                                                   tmp_path: Path) -> None:
    import os
    import time

    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    nodes = [emsd_factory(start=False, pool={"grants": True}, cluster={
        "name": "g", "zookeeper": zookeeper.hosts, "peer_listen": f"127.0.0.1:{zk.free_port()}",
        "secret_file": str(secret), "session_timeout": 4}) for _ in range(2)]
    for n in nodes:
        n.start()
    a, b = nodes
    deadline = time.monotonic() + 30
    while not all(n.metric("emsd_cluster_members") == 2 for n in nodes):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cc = use(a, monkeypatch)
    src = kv(6)
    cc.register_kvcache(src)
    off = CcKvOption(write_rcache=False)
    for first in range(0, BLOCKS, 8):  # the first by RESERVE and COMMIT, the rest by PUT
        assert save(cc, list(range(first, first + 8)), first, option=off).success == 8
    assert ops(a, "put") == BLOCKS // 8 - 1
    held = [int(n.metric("emsd_pool_entries")) for n in nodes]
    assert sum(held) == BLOCKS and 0 < held[1] < BLOCKS  # each block once, at its owner
    assert loads_equal(use(b, monkeypatch), src, list(range(BLOCKS)))
