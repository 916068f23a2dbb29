"""Mutual TLS on the peer transport: blocks move inside it; wrong certificates and plain peers are refused.

Certificates are made for each test module by the ``openssl`` command
(``tests/certs.py``): one cluster CA with a certificate per node, and a
foreign CA whose certificates the cluster must not accept.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import certs  # noqa: E402
import zk  # noqa: E402
from test_cluster import BLOCK, BLOCKS, KEYS, SLOTS, kv, load_equal, stats, use, wait_for  # noqa: E402
from test_peer import SECRET, Node, blocks  # noqa: E402

from emsd.pool.keys import KeyBatch  # noqa: E402
from emsd.transport.peer import PeerConnection, PeerError, PeerServer  # noqa: E402
from emsd.transport.tls import PeerTls  # noqa: E402

pytestmark = [pytest.mark.skipif(certs.available() is not None, reason=str(certs.available())),
              pytest.mark.usefixtures("reset_sdk")]


class Pki:
    """The cluster CA with certificates for nodes a and b, and a foreign CA with one for mallory."""

    def __init__(self, directory: Path) -> None:
        self.ca = certs.Authority(directory, "cluster").create()
        self.foreign = certs.Authority(directory, "foreign").create()
        self.files = {n: self.ca.issue(n) for n in ("a", "b")}
        self.files["mallory"] = self.foreign.issue("mallory")

    def tls(self, node: str, ca: certs.Authority | None = None) -> PeerTls:
        cert, key = self.files[node]
        return PeerTls.load(str(cert), str(key), str((ca or self.ca).cert))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


async def tls_server(node: Node, tls: PeerTls | None) -> tuple[PeerServer, int]:
    server = PeerServer(node.service, node.pool, node.name, SECRET, tls=tls)
    _, port = await server.start("127.0.0.1", 0)
    return server, port


async def test_blocks_move_both_ways_over_mutual_tls(pki: Pki) -> None:
    a, b = Node("a"), Node("b")
    there, here = blocks(3, 1 << 20, seed=1), blocks(3, 700_000, seed=2)
    b.put_local("ns", [1, 2, 3], there)
    a.put_local("ns", [7, 8, 9], here)
    server, port = await tls_server(b, pki.tls("b"))
    conn = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
    try:
        await conn.connect("127.0.0.1", port)
        assert conn.peer_id == "b"
        assert await conn.exists("ns", KeyBatch.from_user([1, 2, 3, 4])) == 3
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3, 4])) == 3
        assert a.read("ns", [1, 2, 3]) == there
        pinned = a.store.pin(a.ns("ns"), KeyBatch.from_user([7, 8, 9]))
        try:
            assert await conn.put("ns", KeyBatch.from_user([7, 8, 9]), pinned.offsets, pinned.lengths) == 3
        finally:
            a.store.release(pinned.handles)
        assert b.read("ns", [7, 8, 9]) == here
        # Many small requests on one connection: frames stay in step through the TLS records.
        for _ in range(20):
            assert await conn.get("ns", KeyBatch.from_user([1, 2])) == 2
        assert server.refused == 0
        # The owner releases a GET's pins once its bulk thread has sent the last byte, which
        # the fetcher may have received before that thread hands back: wait for it, briefly.
        for _ in range(200):
            if b.store.stats().pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert b.store.stats().pinned == 0 and b.store.stats().pending == 0
    finally:
        conn.close()
        await server.close()


async def test_a_certificate_from_another_ca_is_refused(pki: Pki) -> None:
    a, b = Node("a"), Node("b")
    server, port = await tls_server(b, pki.tls("b"))
    try:
        # mallory trusts the cluster CA but holds a foreign certificate: the server refuses her.
        intruder = PeerConnection(a.service, a.pool, "mallory", SECRET, pki.tls("mallory"))
        with pytest.raises(PeerError, match="cannot connect"):
            await intruder.connect("127.0.0.1", port, timeout=3.0)
        wait = 0
        while server.refused == 0 and wait < 100:  # the server's handshake ends on its own thread
            await asyncio.sleep(0.02)
            wait += 1
        assert server.refused == 1
        # A server with a foreign certificate is refused by a cluster client in turn.
        rogue, rogue_port = await tls_server(Node("mallory"), pki.tls("mallory", ca=pki.ca))
        try:
            client = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
            with pytest.raises(PeerError, match="certificate verify failed"):
                await client.connect("127.0.0.1", rogue_port, timeout=3.0)
        finally:
            await rogue.close()
    finally:
        await server.close()


async def test_a_plain_peer_cannot_talk_to_a_tls_peer(pki: Pki) -> None:
    a, b = Node("a"), Node("b")
    b.put_local("ns", [1], blocks(1, 1000, seed=3))
    tls_side, tls_port = await tls_server(b, pki.tls("b"))
    plain_side, plain_port = await tls_server(b, None)
    try:
        plain = PeerConnection(a.service, a.pool, "a", SECRET)  # right secret, no TLS
        with pytest.raises(PeerError, match="cannot connect"):
            await plain.connect("127.0.0.1", tls_port, timeout=1.0)
        with_tls = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
        with pytest.raises(PeerError, match="cannot connect"):
            await with_tls.connect("127.0.0.1", plain_port, timeout=3.0)
        assert a.store.exists(a.ns("ns"), KeyBatch.from_user([1])) == 0  # nothing moved
    finally:
        await tls_side.close()
        await plain_side.close()


def test_bad_tls_files_are_named(pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.files["a"]
    with pytest.raises(ValueError, match="tls_cert/tls_key.*missing.pem"):
        PeerTls.load(str(tmp_path / "missing.pem"), str(key), str(pki.ca.cert))
    with pytest.raises(ValueError, match="tls_ca"):
        PeerTls.load(str(cert), str(key), str(key))  # a key is no CA certificate


# -- two real daemons ------------------------------------------------------------------


def test_two_daemons_move_blocks_over_mutual_tls(pki: Pki, zookeeper: zk.ZooKeeperServer, emsd_factory: Any,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    secret.chmod(0o600)
    nodes = []
    for name in ("a", "b"):
        cert, key = pki.files[name]
        nodes.append(emsd_factory(cluster={
            "name": "tls", "zookeeper": zookeeper.hosts, "peer_listen": f"127.0.0.1:{zk.free_port()}",
            "secret_file": str(secret), "session_timeout": 4,
            "tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(pki.ca.cert)}))
    a, b = nodes
    wait_for(lambda: all(len(stats(d)["members"]) == 2 for d in nodes))
    assert "mutual TLS" in a.log()

    src = kv(11)
    cc = use(a, monkeypatch)
    cc.register_kvcache(src)
    assert cc.save(SLOTS, hashes=KEYS, offsets=[BLOCK] * BLOCKS).success == BLOCKS
    load_equal(b, src, KEYS, monkeypatch)
    # Blocks crossed in both directions: a pushed b's share, b fetched a's.
    assert stats(a)["cached"] > 0 and stats(b)["cached"] > 0


@pytest.mark.parametrize(("tls", "key"), [
    ({"tls_cert": "/c.pem"}, "cluster.tls_key"),
    ({"tls_cert": "/c.pem", "tls_key": "/k.pem"}, "cluster.tls_ca"),
    ({"tls_cert": "c.pem", "tls_key": "/k.pem", "tls_ca": "/ca.pem"}, "cluster.tls_cert"),
])
def test_tls_config_needs_three_absolute_paths(tls: dict[str, str], key: str) -> None:
    from emsd.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=key):
        config_from_dict({"cluster": tls})


def test_a_daemon_with_an_unloadable_certificate_stops_naming_it(pki: Pki, emsd_factory: Any,
                                                                 tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    secret.chmod(0o600)
    _, key = pki.files["a"]
    d = emsd_factory(start=False, cluster={
        "zookeeper": "127.0.0.1:1", "secret_file": str(secret), "peer_listen": f"127.0.0.1:{zk.free_port()}",
        "tls_cert": str(tmp_path / "absent.pem"), "tls_key": str(key), "tls_ca": str(pki.ca.cert)})
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(30) != 0
    assert "cluster.tls_cert" in d.log() and "absent.pem" in d.log()


async def test_a_tls_get_cancelled_mid_transfer_leaves_nothing_reserved(pki: Pki) -> None:
    """An owner that stalls half-way inside TLS: the deadline wakes the worker thread and ends the GET."""
    import os
    import socket

    import numpy as np

    from emsd.transport.frames import PeerOp
    from emsd.transport.peer import _mac
    from emsd.transport.stream import TlsStream

    a = Node("a")
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    stalled = asyncio.Event()
    server_tls = pki.tls("b").server

    async def stalling_owner() -> None:
        raw, _ = await loop.sock_accept(listener)
        conn = TlsStream(server_tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False))
        with conn.sock:
            await conn.handshake(10)
            nonce = os.urandom(32)
            await conn.send_frame({"op": PeerOp.CHALLENGE, "nonce": nonce})
            auth, _ = await conn.recv_frame()
            assert auth["op"] == PeerOp.AUTH
            mac = _mac(SECRET, b"s", auth["nonce"], nonce, b"b")
            await conn.send_frame({"st": 0, "node": "b", "mac": mac})
            req, _ = await conn.recv_frame()
            lengths = np.array([1 << 20, 1 << 20], "<u8")
            answer = {"id": req["id"], "st": 0, "count": 2, "bulk": 2 << 20}
            await conn.send_frame(answer, lengths.tobytes())
            await conn.send_bulk([memoryview(b"\x07" * (1 << 19))])  # half a block
            stalled.set()
            await asyncio.sleep(30)

    owner = asyncio.ensure_future(stalling_owner())
    conn = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
    try:
        await conn.connect("127.0.0.1", listener.getsockname()[1])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.get("ns", KeyBatch.from_user([1, 2])), 1.5)
        assert stalled.is_set()
        stats = a.store.stats()
        assert stats.pending == 0 and stats.entries == 0  # the half-written chunks went back
        assert conn.sock is None
        with pytest.raises(PeerError):
            await conn.get("ns", KeyBatch.from_user([1]))
    finally:
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)
        listener.close()


async def test_stalled_handshakes_do_not_hold_up_an_established_connection(
        pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who can reach the port can stall handshakes; blocks keep moving on established links."""
    import socket

    from emsd.transport import peer

    monkeypatch.setattr(peer, "AUTH_TIMEOUT", 1.0)
    a, b = Node("a"), Node("b")
    data = blocks(4, 1 << 20, seed=5)
    b.put_local("ns", [1, 2, 3, 4], data)
    server, port = await tls_server(b, pki.tls("b"))
    conn = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
    loop = asyncio.get_running_loop()
    silent = []
    try:
        await conn.connect("127.0.0.1", port)
        for _ in range(peer.MAX_UNAUTHENTICATED_PER_ADDRESS + 1):  # the last is refused at once
            raw = socket.socket()
            raw.setblocking(False)
            await loop.sock_connect(raw, ("127.0.0.1", port))
            silent.append(raw)
        assert await conn.get("ns", KeyBatch.from_user([1, 2, 3, 4])) == 4
        assert a.read("ns", [1, 2, 3, 4]) == data
        assert server.refused == 0  # the GET finished while every stalled handshake was still waiting
        assert server.refused_busy == 1  # one past the cap for an address: closed unanswered
        for _ in range(2000):  # then each handshake times out and is refused
            if server.refused == len(silent) - 1:
                break
            await asyncio.sleep(0.02)
        assert server.refused == len(silent) - 1
    finally:
        for raw in silent:
            raw.close()
        conn.close()
        await server.close()


async def test_silent_connections_do_not_delay_a_new_handshake(pki: Pki,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger's silent TCP connections cost descriptors, not handshake time: a node's new
    mutual-TLS connection completes at once (handshakes on a few threads queued behind them,
    15 of 3 s each held a new one up for 12 s, past the dial's deadline)."""
    import socket

    from emsd.transport import peer

    monkeypatch.setattr(peer, "AUTH_TIMEOUT", 3.0)
    a, b = Node("a"), Node("b")
    b.put_local("ns", [1], blocks(1, 4096, seed=6))
    server, port = await tls_server(b, pki.tls("b"))
    loop = asyncio.get_running_loop()
    silent = []
    conn = PeerConnection(a.service, a.pool, "a", SECRET, pki.tls("a"))
    try:
        for _ in range(peer.MAX_UNAUTHENTICATED_PER_ADDRESS - 1):
            raw = socket.socket()
            raw.setblocking(False)
            await loop.sock_connect(raw, ("127.0.0.1", port))
            silent.append(raw)
        await asyncio.sleep(0.2)  # every silent one has been accepted and is in its handshake
        await conn.connect("127.0.0.1", port, timeout=2.0)
        assert await conn.get("ns", KeyBatch.from_user([1])) == 1
        assert server.refused == 0  # every silent handshake was still waiting
    finally:
        for raw in silent:
            raw.close()
        conn.close()
        await server.close()
