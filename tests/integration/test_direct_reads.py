"""Reads straight from the owner (ems.direct): a load that keeps no copy asks the owner itself.

Two daemons and a real ZooKeeper (the ``cluster`` fixture of test_cluster): blocks saved at
their owners load through the other node with identical bytes, from the owners' peer ports
(their ``direct_reads`` counters), and a node that does not offer it, or a pass that is not
genuine, costs nothing but the way through the daemon.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402

from ems import CcKvOption  # noqa: E402
from ems.client import DaemonClient  # noqa: E402
from ems.common.exception import EmsException  # noqa: E402
from ems.direct import DirectError, OwnerLink, _recv_frame, _send_frame  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.protocol import readpass  # noqa: E402
from emsd.protocol.local import OwnerAnswer, OwnerRequest, RingAnswer  # noqa: E402
from emsd.transport.frames import Op, PeerOp, Status  # noqa: E402
from tests.integration.test_cluster import BLOCK, BLOCKS, KEYS, SLOTS, kv, stats, use  # noqa: E402

pytestmark = [pytest.mark.skipif(zk.available() is not None, reason=str(zk.available())),
              pytest.mark.usefixtures("reset_sdk")]
NO_COPY = CcKvOption(write_rcache=False)


def served(d: Any) -> int:
    """GETs node ``d`` served to SDK clients' read passes."""
    return int(stats(d)["direct_reads"]["served"])


def ring_of(d: Any) -> RingAnswer:
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        return RingAnswer.decode(*client.call(Op.RING, {}, timeout=5))
    finally:
        client.close()


def saved(cluster: Any, monkeypatch: Any, seed: int,
          **extra: Any) -> tuple[Any, Any, list[list[torch.Tensor]]]:
    """Two nodes; ``KEYS`` saved through a with ``write_rcache`` off: each block at its owner only."""
    a, b = cluster(2, **extra)
    src = kv(seed)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS, option=NO_COPY).success == BLOCKS
    return a, b, src


def owned_by(d: Any, name: str) -> list[int]:
    """The indices into ``KEYS`` of the keys node ``d`` owns (local op OWNER)."""
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        ask = OwnerRequest(name, KeyBatch.from_user(KEYS)).encode()
        owners = OwnerAnswer.decode(*client.call(Op.OWNER, *ask, timeout=5), len(KEYS)).owners
    finally:
        client.close()
    return [i for i, ids in enumerate(owners) if ids[0] == d.sections["node"]["id"]]


def load_through(d: Any, src: list[list[torch.Tensor]], monkeypatch: Any, which: list[int]) -> int:
    """Load the keys ``which`` (indices into ``KEYS``) through ``d`` without a copy into zeroed
    tensors, each into its own block's slots; how many loaded, the bytes of those checked
    against ``src``."""
    cc = use(d, monkeypatch)
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    slots = [i * BLOCK + j for i in which for j in range(BLOCK)]
    hashes = [KEYS[i] for i in which]
    got = cc.load(slots, hashes=hashes, offsets=[BLOCK] * len(which), option=NO_COPY).success
    for i in which[:got]:  # block i of each tensor holds slots i * BLOCK ..
        assert all(torch.equal(x[i], y[i]) for la, lb in zip(src, dst, strict=True)
                   for x, y in zip(la, lb, strict=True))
    return got


def test_a_load_without_a_copy_reads_from_the_owner(cluster: Any, monkeypatch: Any) -> None:
    a, b, src = saved(cluster, monkeypatch, 11)
    mine = owned_by(a, use(b, monkeypatch)._namespace)
    assert mine
    before_a, entries_b = served(a), stats(b)["entries"]
    assert load_through(b, src, monkeypatch, mine) == len(mine)
    assert load_through(b, src, monkeypatch, mine[:1]) == 1  # one block a call
    assert served(a) == before_a + 2  # b's client asked a itself, a GET a load
    assert a.metric("emsd_direct_read_requests_total") == served(a)
    assert stats(b)["entries"] == entries_b  # and b fetched nothing, kept nothing
    ring = ring_of(b)
    assert ring.me == b.sections["node"]["id"] and len(ring.members) == 2 and ring.ttl == readpass.PASS_TTL
    # A load whose first key b owns goes through b, as before, whatever follows.
    assert load_through(b, src, monkeypatch, list(range(BLOCKS))) == BLOCKS
    assert served(a) == before_a + 2

    monkeypatch.setenv("EMS_DIRECT_READS", "0")  # the way through the daemon, for comparison
    assert load_through(b, src, monkeypatch, mine) == len(mine)
    assert served(a) == before_a + 2


def test_a_node_that_does_not_offer_them_loads_as_before(cluster: Any, monkeypatch: Any) -> None:
    a, b, src = saved(cluster, monkeypatch, 12, direct_reads=False)
    mine = owned_by(a, use(b, monkeypatch)._namespace)
    client = DaemonClient(b.socket_dir / "emsd.sock")
    client.connect({})
    try:
        with pytest.raises(EmsException, match="does not offer"):
            client.call(Op.RING, {}, timeout=5)
    finally:
        client.close()
    assert load_through(b, src, monkeypatch, mine) == len(mine)
    assert served(a) == served(b) == 0


def _peer_address(d: Any) -> str:
    return str(d.sections["cluster"]["peer_listen"])


def test_a_pass_reads_only_its_tenant_and_only_gets(cluster: Any, monkeypatch: Any) -> None:
    a, b, src = saved(cluster, monkeypatch, 13)
    ring = ring_of(b)
    name = use(b, monkeypatch)._namespace
    mine = owned_by(a, name)
    keys = KeyBatch.from_user([KEYS[i] for i in mine])

    link = OwnerLink(_peer_address(a), ring.read_pass)  # the default tenant's pass
    into = memoryview(bytearray(BLOCKS * (1 << 20)))
    assert link.get(name, keys, into, 5.0).size == len(mine)
    # Another tenant's name is qualified under the pass's tenant: nothing is found, nothing made.
    assert link.get("tenant:team-b/" + name, keys, into, 5.0).size == 0
    link.close()

    # A forged pass (another secret), an expired one and garbage are refused; the node stays up.
    for bad in (readpass.issue(b"x" * 32, "", int(time.time()) + 60),
                readpass.issue(b"a-cluster-secret-of-some-length", "", int(time.time()) - 1), b"junk"):
        with pytest.raises(DirectError, match="refused"):
            OwnerLink(_peer_address(a), bad)

    # A reader that asks for anything but GET is answered once and hung up on.
    host, _, port = _peer_address(a).rpartition(":")
    with socket.create_connection((host, int(port)), 5) as sock:
        _recv_frame(sock)
        _send_frame(sock, {"id": 0, "op": int(PeerOp.READ), "pass": ring.read_pass})
        assert _recv_frame(sock)[0]["st"] == Status.OK
        _send_frame(sock, {"id": 1, "op": int(PeerOp.DROP), "ns": name})
        answer, _ = _recv_frame(sock)
        assert answer["st"] == Status.INVALID_ARGUMENT and "only GET" in answer["msg"]
        assert sock.recv(1) == b""
    assert load_through(b, src, monkeypatch, mine) == len(mine)  # the blocks are all still there


def test_an_owner_killed_costs_its_blocks_not_the_call(cluster: Any, monkeypatch: Any) -> None:
    a, b, src = saved(cluster, monkeypatch, 14)
    mine = owned_by(a, use(b, monkeypatch)._namespace)
    assert load_through(b, src, monkeypatch, mine) == len(mine)  # links to a are open now
    a.kill9()
    t0 = time.monotonic()
    assert load_through(b, src, monkeypatch, mine) == 0  # a miss, through b, as without direct reads
    assert time.monotonic() - t0 < 10
