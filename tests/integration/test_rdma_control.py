"""The RDMA link's control protocol and fallback, over real loopback TCP with a FAKE verbs engine.

``tests/fake_verbs.FakeEngine`` carries out READ/WRITE work requests with
memmove inside this process: this checks the control messages (PIN, UNPIN,
RESERVE, COMMIT, QP exchange), what each side reserves, commits and releases,
and the fallback to TCP. It is not RDMA; tests/integration/test_rdma.py is.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_verbs import FakeEngine, FakeFabric  # noqa: E402
from test_peer import SECRET, blocks  # noqa: E402
from test_peer import Node as TcpNode  # noqa: E402

from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.protocol.rdma import CommitRequest, PinAnswer, PinRequest, ReserveAnswer, ReserveRequest  # noqa: E402
from emsd.transport.peer import PeerConnection, PeerError, PeerServer  # noqa: E402
from emsd.transport.rdma import RdmaEndpoint, SelectingLink  # noqa: E402
from emsd.transport.selection import PeerPath, PeerTransports  # noqa: E402

CHUNK = 3 << 20  # test_peer's 16 MiB pool in 6 regions: blocks cross region boundaries


class Node(TcpNode):
    """test_peer's pool and store, plus a fake verbs engine and the pool registered with it."""

    def __init__(self, name: str, fabric: FakeFabric, **engine: object) -> None:
        super().__init__(name)
        self.engine = FakeEngine(fabric, name, **engine)  # type: ignore[arg-type]
        self.endpoint = RdmaEndpoint.register(self.engine, memoryview(self.mem), CHUNK)


class Setup:
    def __init__(self, serve_rdma: bool = True, **engine: object) -> None:
        fabric = FakeFabric()
        self.a, self.b = Node("a", fabric, **engine), Node("b", fabric)
        control = (lambda: self.b.endpoint.serving(self.b.service)) if serve_rdma else None
        self.server = PeerServer(self.b.service, self.b.pool, "b", SECRET, control=control)
        self.transports = PeerTransports("auto", "")
        self.reports: list[str] = []

    async def link(self, endpoint: bool = True) -> SelectingLink:
        _, port = await self.server.start("127.0.0.1", 0)
        tcp = PeerConnection(self.a.service, self.a.pool, "a", SECRET)
        link = SelectingLink(tcp, self.a.endpoint if endpoint else None, self.transports,
                             lambda peer: (self.b.endpoint.descriptor, ""), self.reports.append)
        await link.connect("127.0.0.1", port)
        return link


async def test_get_reads_blocks_over_rdma_into_the_local_pool() -> None:
    s = Setup()
    data = blocks(6, 1_500_000, seed=1)  # 1.5 MB blocks in 4 MiB regions: some straddle two
    s.b.put_local("ns", [1, 2, 3, 5, 6, 7], data)  # 4 missing
    link = await s.link()
    try:
        assert s.transports.uses_rdma("b") and s.reports == ["b"]
        assert await link.get("ns", KeyBatch.from_user([1, 2, 3, 4, 5])) == 3
        assert s.a.read("ns", [1, 2, 3]) == data[:3]
        assert s.a.engine.posted > 0 and link.last_bytes == 3 * 1_500_000
        assert await link.get("ns", KeyBatch.from_user([1, 2, 5])) == 3  # 1, 2 already local
        assert s.a.read("ns", [5]) == [data[3]]
        assert s.b.store.stats().pinned == 0 and s.a.store.stats().pending == 0
    finally:
        link.close()
        await s.server.close()


async def test_put_writes_blocks_into_slabs_the_owner_reserved() -> None:
    s = Setup()
    data = blocks(5, 1_200_000, seed=2)
    s.a.put_local("ns", [10, 11, 12, 13, 14], data)
    s.b.put_local("ns", [11], [data[1]])  # already there: skipped
    link = await s.link()
    try:
        pinned = s.a.store.pin(s.a.ns("ns"), KeyBatch.from_user([10, 11, 12, 13, 14]))
        keys = KeyBatch.from_user([10, 11, 12, 13, 14])
        stored = await link.put("ns", keys, pinned.offsets, pinned.lengths)
        s.a.store.release(pinned.handles)
        assert stored == 5 and s.a.engine.posted > 0
        assert s.b.read("ns", [10, 11, 12, 13, 14]) == data
        assert s.b.store.stats().pending == 0
    finally:
        link.close()
        await s.server.close()


async def test_a_failure_mid_transfer_falls_back_to_tcp_and_still_delivers() -> None:
    s = Setup(fail=lambda wr: True)
    data = blocks(3, 700_000, seed=3)
    s.b.put_local("ns", [1, 2, 3], data)
    s.a.put_local("ns", [20], [data[0]])
    link = await s.link()
    try:
        assert await link.get("ns", KeyBatch.from_user([1, 2, 3])) == 3  # RDMA failed, TCP delivered
        assert s.a.read("ns", [1, 2, 3]) == data
        st = s.transports.state("b")
        assert st.path is PeerPath.FELL_BACK and st.kind == "transfer" and "injected" in st.reason
        assert s.reports == ["b", "b"]  # connected, then fell back: one report each
        posted = s.a.engine.posted
        pinned = s.a.store.pin(s.a.ns("ns"), KeyBatch.from_user([20]))
        assert await link.put("ns", KeyBatch.from_user([20]), pinned.offsets, pinned.lengths) == 1
        s.a.store.release(pinned.handles)
        assert s.a.engine.posted == posted  # TCP from now on
        assert s.b.read("ns", [20]) == [data[0]] and s.reports == ["b", "b"]
        assert s.b.store.stats().pinned == 0 and s.b.store.stats().pending == 0
        assert s.a.store.stats().pending == 0
    finally:
        link.close()
        await s.server.close()


async def test_a_failed_write_aborts_the_owners_reservation_then_goes_over_tcp() -> None:
    s = Setup(fail=lambda wr: wr.wr_id > 1)
    data = blocks(4, 900_000, seed=4)
    s.a.put_local("ns", [1, 2, 3, 4], data)
    link = await s.link()
    try:
        pinned = s.a.store.pin(s.a.ns("ns"), KeyBatch.from_user([1, 2, 3, 4]))
        assert await link.put("ns", KeyBatch.from_user([1, 2, 3, 4]), pinned.offsets, pinned.lengths) == 4
        s.a.store.release(pinned.handles)
        assert s.b.read("ns", [1, 2, 3, 4]) == data and s.b.store.stats().pending == 0
        assert s.transports.state("b").kind == "transfer"
    finally:
        link.close()
        await s.server.close()


async def test_a_peer_that_serves_tcp_only_gets_a_tcp_link() -> None:
    s = Setup(serve_rdma=False)
    data = blocks(2, 100_000, seed=5)
    s.b.put_local("ns", [1, 2], data)
    link = await s.link()
    try:
        st = s.transports.state("b")
        assert st.path is PeerPath.TCP and st.kind == "connect" and "TCP only" in st.reason
        assert await link.get("ns", KeyBatch.from_user([1, 2])) == 2
        assert s.a.read("ns", [1, 2]) == data and s.a.engine.posted == 0
    finally:
        link.close()
        await s.server.close()


async def test_no_local_endpoint_means_tcp_without_asking_the_peer() -> None:
    s = Setup()
    s.transports = PeerTransports("auto", "no RDMA device")
    s.b.put_local("ns", [1], blocks(1, 1000, seed=6))
    link = await s.link(endpoint=False)
    try:
        assert s.transports.state("b").kind == "no_local_device"
        assert await link.get("ns", KeyBatch.from_user([1])) == 1 and s.a.engine.posted == 0
    finally:
        link.close()
        await s.server.close()


async def test_pins_held_by_a_connection_are_released_when_it_closes() -> None:
    s = Setup()
    s.b.put_local("ns", [1, 2], blocks(2, 1000, seed=7))
    link = await s.link()
    try:
        header, body = await link.tcp.request(PinRequest("ns", KeyBatch.from_user([1, 2])).encode())
        assert PinAnswer.decode(header, body, 2).count == 2 and s.b.store.stats().pinned == 2
        link.close()  # a client that dies between PIN and UNPIN
        for _ in range(200):
            if s.b.store.stats().pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert s.b.store.stats().pinned == 0
    finally:
        link.close()
        await s.server.close()


async def test_a_malformed_commit_closes_the_link_and_aborts_the_reservation() -> None:
    s = Setup()
    link = await s.link()
    try:
        keys, lengths = KeyBatch.from_user([5, 6]), np.array([1000, 1000], dtype=np.uint64)
        header, body = await link.tcp.request(ReserveRequest("ns", keys, lengths).encode())
        tok = ReserveAnswer.decode(header, body, 2).tok
        assert s.b.store.stats().pending == 2
        bad = {**CommitRequest(tok, True).encode()[0], "ok": 1}  # commit or abort is a bool
        with pytest.raises(PeerError):
            await link.tcp.request((bad, []))
        for _ in range(200):  # the owner drops the connection and what it held
            if s.b.store.stats().pending == 0:
                break
            await asyncio.sleep(0.01)
        assert s.b.store.stats().pending == 0 and s.b.store.exists(s.b.ns("ns"), keys) == 0
        again = PeerConnection(s.a.service, s.a.pool, "a", SECRET)  # the owner still serves
        await again.connect(*s.server._listener.getsockname()[:2])
        assert await again.get("ns", keys) == 0
        again.close()
    finally:
        link.close()
        await s.server.close()
