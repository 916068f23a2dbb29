"""The TCP peer transport between two pools, over real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import struct
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from emsd.effects import Promote
from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.service import PEER_PROMOTE_BUDGET, Service
from emsd.tenants import Tenant, Tenants
from emsd.transport.frames import PeerOp
from emsd.transport.peer import PeerConnection, PeerError, PeerServer

POOL = 16 << 20
PAGE = 4 << 20
SECRET = b"cluster-secret-for-tests"


class Node:
    """A pool, its store and its Service: what a daemon gives the transport (the Service is
    the transports' ``BlockOwner``)."""

    def __init__(self, name: str, tenants: Tenants | None = None) -> None:
        self.name = name
        self.mem = bytearray(POOL)
        self.pool = memoryview(self.mem)
        self.store = BlockStore(POOL, PAGE)
        self.service = Service(self.store, name, "test", Metrics(), tenants)

    def ns(self, name: str) -> int:
        return self.service.namespace_id(name)

    def put_local(self, ns: str, keys: list[int], blocks: list[bytes]) -> None:
        batch = KeyBatch.from_user(keys)
        res = self.store.reserve(self.ns(ns), batch, np.array([len(b) for b in blocks], np.uint64))
        for off, block in zip(res.offsets.tolist(), blocks, strict=True):
            self.mem[off : off + len(block)] = block
        self.store.commit(res.handles[res.status == 0])

    def read(self, ns: str, keys: list[int]) -> list[bytes]:
        pinned = self.store.pin(self.ns(ns), KeyBatch.from_user(keys))
        try:
            return [bytes(self.mem[o : o + n]) for o, n in
                    zip(pinned.offsets.tolist(), pinned.lengths.tolist(), strict=True)]
        finally:
            self.store.release(pinned.handles)


def blocks(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


async def drain(sock: socket.socket) -> None:
    """Read until the peer closes (EOF or reset): it must close within 5 s."""
    loop = asyncio.get_running_loop()
    try:
        while await asyncio.wait_for(loop.sock_recv(sock, 4096), 5):
            pass
    except ConnectionResetError:
        pass


async def link(node: Node, port: int) -> PeerConnection:
    """A connected, authenticated link from ``node`` to the server on ``port``."""
    conn = PeerConnection(node.service, node.pool, node.name, SECRET)
    await conn.connect("127.0.0.1", port)
    return conn


async def serve(node: Node, secret: bytes = SECRET) -> tuple[PeerServer, int]:
    server = PeerServer(node.service, node.pool, node.name, secret)
    _, port = await server.start("127.0.0.1", 0)
    return server, port


async def test_get_fetches_leading_blocks_into_the_local_pool() -> None:
    a, b = Node("a"), Node("b")
    data = blocks(5, 300_000, seed=1)
    b.put_local("ns", [1, 2, 3, 5, 6], data)  # 4 is missing
    server, port = await serve(b)
    conn = PeerConnection(a.service, a.pool, "a", SECRET)
    try:
        await conn.connect("127.0.0.1", port)
        assert conn.peer_id == "b"
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3, 4, 5])) == 3
        assert a.read("ns", [1, 2, 3]) == data[:3]
        assert a.store.exists(a.ns("ns"), KeyBatch.from_user([1, 2, 3, 4])) == 3
        # Already local blocks are read off the wire and dropped; the stream stays in step.
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3])) == 3
        assert await conn.get("other", KeyBatch.from_user([1])) == 0
        assert b.store.stats().pinned == 0
    finally:
        conn.close()
        await server.close()


async def test_a_get_of_blocks_on_the_owners_disk_promotes_them_first_as_the_service_plans() -> None:
    """The owner's Service plans the promotion (``peer_promotion``: a ``Promote``, no fetch);
    the server carries it out through its ``promote`` step before it pins; HAS counts the disk."""
    a, b = Node("a"), Node("b")
    data = blocks(3, 300_000, seed=4)
    b.put_local("ns", [1], data[:1])
    on_disk = {2: data[1], 3: data[2]}
    b.service.tiers = SimpleNamespace(  # type: ignore[assignment]  # a disk tier holding 2 and 3
        wanted=lambda _ns, keys, count: count < len(keys) and count + 1 in on_disk,
        exists=lambda _ns, keys, count: len(keys))
    carried: list[tuple[Promote, float]] = []

    async def promote(effect: Promote, deadline: float) -> None:
        carried.append((effect, deadline))
        b.put_local("ns", list(on_disk), list(on_disk.values()))

    server = PeerServer(b.service, b.pool, b.name, SECRET, promote=promote)
    _, port = await server.start("127.0.0.1", 0)
    conn = await link(a, port)
    try:
        assert await conn.exists("ns", KeyBatch.from_user([1, 2, 3])) == 3
        start = asyncio.get_running_loop().time()
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3])) == 3
        assert a.read("ns", [1, 2, 3]) == data
        (effect, deadline), = carried
        assert (effect.ns, effect.count, effect.fetch) == (b.ns("ns"), 1, False)
        end = asyncio.get_running_loop().time()
        assert start + PEER_PROMOTE_BUDGET <= deadline <= end + PEER_PROMOTE_BUDGET  # the plan's budget
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3])) == 3
        assert len(carried) == 1  # all in the pool now: nothing to promote
    finally:
        conn.close()
        await server.close()


async def test_put_stores_blocks_on_the_peer() -> None:
    a, b = Node("a"), Node("b")
    data = blocks(4, 1 << 20, seed=2)
    a.put_local("ns", [10, 11, 12, 13], data)
    b.put_local("ns", [11], [data[1]])  # already there: skipped, not an error
    server, port = await serve(b)
    conn = PeerConnection(a.service, a.pool, "a", SECRET)
    try:
        await conn.connect("127.0.0.1", port)
        pinned = a.store.pin(a.ns("ns"), KeyBatch.from_user([10, 11, 12, 13]))
        stored = await conn.put("ns", KeyBatch.from_user([10, 11, 12, 13]), pinned.offsets, pinned.lengths)
        a.store.release(pinned.handles)
        assert stored == 4
        assert b.read("ns", [10, 11, 12, 13]) == data
        assert b.store.stats().pending == 0
    finally:
        conn.close()
        await server.close()


async def test_blocks_from_a_peer_count_against_their_tenants_quota_both_ways() -> None:
    """A fetched copy (GET) and a forwarded save (PUT served) store a tenant's bytes on this
    node: both fit the tenant's quota here, evicting only that tenant's own blocks."""
    a = Node("a", Tenants([Tenant("team-b", "k" * 32, quota=1 << 20)]))
    b = Node("b")
    mine, theirs = "tenant:team-b/m", "tenant:team-a/m"
    other = blocks(1, 512 << 10, seed=5)
    a.put_local(theirs, [1], other)  # another tenant's block, on the node with the quota
    data = blocks(8, 512 << 10, seed=6)
    b.put_local(mine, list(range(10, 18)), data)
    server_b, port_b = await serve(b)
    server_a, port_a = await serve(a)
    get, put = await link(a, port_b), await link(b, port_a)
    try:
        assert await get.get(mine, KeyBatch.from_user(list(range(10, 14)))) == 2  # 1 MiB: two fit
        assert a.read(mine, [10, 11]) == data[:2]
        pinned = b.store.pin(b.ns(mine), KeyBatch.from_user(list(range(14, 18))))
        try:
            stored = await put.put(mine, KeyBatch.from_user(list(range(14, 18))), pinned.offsets,
                                   pinned.lengths)
        finally:
            b.store.release(pinned.handles)
        assert stored == 2  # the two fetched copies made room: team-b's own, oldest first
        assert a.read(mine, [14, 15]) == data[4:6]
        assert a.store.exists(a.ns(mine), KeyBatch.from_user([10])) == 0
        assert a.store.ns_bytes(a.ns(mine)) <= 1 << 20
        assert a.read(theirs, [1]) == other  # never touched by team-b's quota
        assert a.store.stats().pending == 0
        # every hold on the quota ended with its transfer
        assert a.service.quotas.held("team-b") == a.store.ns_bytes(a.ns(mine))
    finally:
        get.close()
        put.close()
        await server_a.close()
        await server_b.close()


async def test_a_wrong_secret_is_refused_both_ways() -> None:
    a, b = Node("a"), Node("b")
    b.put_local("ns", [1], blocks(1, 1000, seed=3))
    server, port = await serve(b)
    try:
        intruder = PeerConnection(a.service, a.pool, "a", b"wrong-secret")
        with pytest.raises(PeerError, match="authentication failed|refused"):
            await intruder.connect("127.0.0.1", port)
        assert server.refused == 1
        # A server without the secret cannot pass itself off as a peer either.
        fake, fake_port = await serve(Node("fake"), secret=b"other")
        try:
            with pytest.raises(PeerError):
                await PeerConnection(a.service, a.pool, "a", SECRET).connect("127.0.0.1", fake_port)
        finally:
            await fake.close()
        good = await link(a, port)
        assert await good.get("ns", KeyBatch.from_user([1])) == 1
        good.close()
    finally:
        await server.close()


async def test_garbage_from_a_peer_closes_only_that_connection() -> None:
    a, b = Node("a"), Node("b")
    b.put_local("ns", [1], blocks(1, 1000, seed=4))
    server, port = await serve(b)
    loop = asyncio.get_running_loop()
    try:
        for junk in [b"\xff" * 64, struct.pack("<II", 5, 0) + b"\x00" * 5,
                     struct.pack("<II", 1 << 30, 0)]:
            raw = socket.socket()
            try:
                raw.setblocking(False)
                await loop.sock_connect(raw, ("127.0.0.1", port))
                await loop.sock_sendall(raw, junk)
                await drain(raw)
            finally:
                raw.close()
        # An authenticated peer that then sends a bad request is answered and dropped.
        conn = await link(a, port)
        assert conn.sock is not None
        head = msgpack.packb({"v": 1, "id": 9, "op": 103, "ns": 5, "n": 1, "kt": 0})
        await loop.sock_sendall(conn.sock, struct.pack("<II", len(head), 0) + head)
        await drain(conn.sock)
        conn.close()
        good = await link(a, port)
        assert await good.get("ns", KeyBatch.from_user([1])) == 1
        good.close()
    finally:
        await server.close()


@pytest.mark.parametrize("block", [1 << 20, 64 << 10], ids=["bulk-threads", "event-loop"])
@pytest.mark.parametrize("silent", [False, True], ids=["dies", "stalls"])
async def test_a_peer_that_dies_or_stalls_mid_transfer_leaves_nothing_reserved(
        block: int, silent: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PUT whose sender goes away (or falls silent past BULK_STALL) half-way through its
    blocks, moved by a bulk thread or on the event loop: the server drops the connection
    and keeps none of them."""
    import emsd.transport.stream as stream

    monkeypatch.setattr(stream, "BULK_STALL", 1)  # seconds: the loop's bound and the kernel's timeouts
    a, b = Node("a"), Node("b")
    server, port = await serve(b)
    loop = asyncio.get_running_loop()
    try:
        conn = await link(a, port)
        assert conn.sock is not None
        keys = KeyBatch.from_user([1, 2])
        kt, raw = keys.to_wire()
        lengths = np.array([block, block], "<u8").tobytes()
        head = msgpack.packb({"v": 1, "id": 1, "op": 104, "ns": "ns", "n": 2, "kt": kt, "bulk": 2 * block})
        payload = raw + lengths
        await loop.sock_sendall(conn.sock, struct.pack("<II", len(head), len(payload)) + head + payload)
        await loop.sock_sendall(conn.sock, b"\x01" * (block // 2))  # half of the first block, then gone
        if not silent:
            conn.close()
        for _ in range(500):
            if not server._conns:
                break
            await asyncio.sleep(0.01)
        assert not server._conns
        stats = b.store.stats()
        assert stats.pending == 0 and stats.entries == 0
        conn.close()
    finally:
        await server.close()


@pytest.mark.parametrize("block", [1 << 20, 64 << 10], ids=["bulk-threads", "event-loop"])
async def test_a_get_cancelled_mid_transfer_leaves_nothing_reserved_and_drops_the_connection(
        block: int) -> None:
    """An owner that stalls half-way: the caller's deadline ends the GET cleanly, whether the
    blocks move in a bulk thread or (small, up to LOOP_BULK) on the event loop."""
    import os

    from emsd.transport.frames import PeerOp
    from emsd.transport.peer import _mac
    from emsd.transport.stream import PlainStream

    a = Node("a")
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    stalled = asyncio.Event()

    async def stalling_owner() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await stall(conn)

    async def stall(conn: socket.socket) -> None:
        conn.setblocking(False)
        stream = PlainStream(conn)
        nonce = os.urandom(32)
        await stream.send_frame({"op": PeerOp.CHALLENGE, "nonce": nonce})
        auth, _ = await stream.recv_frame()
        assert auth["op"] == PeerOp.AUTH
        await stream.send_frame({"st": 0, "node": "b", "mac": _mac(SECRET, b"s", auth["nonce"], nonce, b"b")})
        req, _ = await stream.recv_frame()
        lengths = np.array([block, block], "<u8")
        await stream.send_frame({"id": req["id"], "st": 0, "count": 2, "bulk": 2 * block}, lengths.tobytes())
        await loop.sock_sendall(conn, b"\x07" * (block // 2))  # half a block, then silence
        stalled.set()
        await asyncio.sleep(30)

    owner = asyncio.ensure_future(stalling_owner())
    conn = PeerConnection(a.service, a.pool, "a", SECRET)
    try:
        await conn.connect("127.0.0.1", listener.getsockname()[1])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.get("ns", KeyBatch.from_user([1, 2])), 1.0)
        assert stalled.is_set()
        stats = a.store.stats()
        assert stats.pending == 0 and stats.entries == 0  # the half-written chunks went back
        assert conn.sock is None  # out of step: closed, never reused
        with pytest.raises(PeerError):
            await conn.get("ns", KeyBatch.from_user([1]))
    finally:
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)
        listener.close()


async def test_drop_reaches_the_peer_and_a_bad_or_refused_drop_harms_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Node("a"), Node("b")
    b.put_local("ns", [1, 2], blocks(2, 1000, seed=7))
    asked: list[str] = []
    monkeypatch.setattr(b.service, "drop_namespace", lambda name: asked.append(name) or 2)
    server, port = await serve(b)
    loop = asyncio.get_running_loop()
    try:
        conn = await link(a, port)
        assert await conn.drop("ns") == 1 and asked == ["ns"]
        assert await conn.exists("ns", KeyBatch.from_user([1])) == 1  # the stream stays in step
        conn.close()
        bad = await link(a, port)
        assert bad.sock is not None
        head = msgpack.packb({"v": 1, "id": 9, "op": 111, "ns": 5})  # a DROP without a name
        await loop.sock_sendall(bad.sock, struct.pack("<II", len(head), 0) + head)
        await drain(bad.sock)  # answered and dropped
        bad.close()
        # a node of a version without DROP refuses it (an unknown op); the link stays usable
        monkeypatch.delitem(PeerServer._serving, PeerOp.DROP)
        refused = await link(a, port)
        assert await refused.drop("ns") == 0
        assert not refused.closed
        assert await refused.exists("ns", KeyBatch.from_user([1, 2])) == 2
        assert asked == ["ns"]
        refused.close()
    finally:
        await server.close()


async def test_an_unknown_op_is_refused_and_the_link_stays_up_unless_bulk_bytes_follow() -> None:
    """A newer peer's op (a rolling upgrade): an error answer, not a dropped link; with bulk
    bytes of unknown meaning after it, the stream cannot stay in step, so it is closed."""
    from emsd.transport.peer import PeerRefused

    a, b = Node("a"), Node("b")
    b.put_local("ns", [1], blocks(1, 1000, seed=5))
    server, port = await serve(b)
    loop = asyncio.get_running_loop()
    try:
        conn = await link(a, port)
        with pytest.raises(PeerRefused, match="unknown peer op 250"):
            await conn.call(250, {"ns": "ns"}, b"payload")
        assert not conn.closed
        assert await conn.get("ns", KeyBatch.from_user([1])) == 1  # the stream is in step
        assert conn.sock is not None
        head = msgpack.packb({"v": 1, "id": 77, "op": 250, "bulk": 4096})
        await loop.sock_sendall(conn.sock, struct.pack("<II", len(head), 0) + head + b"\x00" * 4096)
        await drain(conn.sock)  # answered and closed
        conn.close()
        assert b.read("ns", [1]) == blocks(1, 1000, seed=5)
        again = await link(a, port)
        assert await again.exists("ns", KeyBatch.from_user([1])) == 1
        again.close()
    finally:
        await server.close()


async def test_both_ends_of_a_link_use_the_configured_socket_buffer() -> None:
    a, b = Node("a"), Node("b")
    server = PeerServer(b.service, b.pool, b.name, SECRET, socket_buffer=96 << 10)
    _, port = await server.start("127.0.0.1", 0)
    conn = PeerConnection(a.service, a.pool, a.name, SECRET, socket_buffer=80 << 10)
    try:
        await conn.connect("127.0.0.1", port)
        assert conn.sock is not None
        (accepted,) = server._conns
        # Linux reports twice what was asked (both sizes are far below any rmem_max/wmem_max).
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 160 << 10
        assert accepted.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 192 << 10
        a.put_local("ns", [1], blocks(1, 4096, 1))
        pinned = a.store.pin(0, KeyBatch.from_user([1]))
        assert await conn.put("ns", KeyBatch.from_user([1]), pinned.offsets, pinned.lengths) == 1
        a.store.release(pinned.handles)
        assert b.read("ns", [1]) == a.read("ns", [1])
    finally:
        conn.close()
        await server.close()
