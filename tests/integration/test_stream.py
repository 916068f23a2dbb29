"""The peer link's streams (``emsd.transport.stream``) over real loopback TCP sockets.

Each test runs on a ``PlainStream`` pair and on a ``TlsStream`` pair (mutual TLS, certificates
from ``tests/certs.py``): frames and bulk bytes arrive intact on every path (bulk on the event
loop up to ``LOOP_BULK``, in a bulk thread past it); a peer that hangs up or falls silent
mid-transfer is a ``PeerError``; a cancelled bulk move wakes and ends its thread at once.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import certs  # noqa: E402

from emsd.transport import stream as stream_module  # noqa: E402
from emsd.transport.frames import PREFIX  # noqa: E402
from emsd.transport.stream import (  # noqa: E402
    JOIN_LIMIT,
    LOOP_BULK,
    PeerError,
    PeerStream,
    PlainStream,
    TlsStream,
    _tune,
    _unsent,
)
from emsd.transport.tls import PeerTls  # noqa: E402

KINDS = ["plain", "tls"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[PeerTls, PeerTls] | None:
    """TLS settings of two nodes of one cluster CA (None without the openssl command)."""
    if certs.available() is not None:
        return None
    ca = certs.Authority(tmp_path_factory.mktemp("pki"), "cluster").create()

    def load(node: str) -> PeerTls:
        cert, key = ca.issue(node)
        return PeerTls.load(str(cert), str(key), str(ca.cert))

    return load("a"), load("b")


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a loopback TCP connection, non-blocking and tuned as the transport's are."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    for sock in (near, far):
        sock.setblocking(False)
        _tune(sock)
    return near, far


async def connected(kind: str, pki: tuple[PeerTls, PeerTls] | None) -> tuple[PeerStream, PeerStream]:
    """A connected pair of streams of ``kind`` (TLS: handshake done)."""
    if kind == "tls" and pki is None:
        pytest.skip(str(certs.available()))
    near_sock, far_sock = tcp_pair()
    if kind == "plain":
        return PlainStream(near_sock), PlainStream(far_sock)
    assert pki is not None
    near = TlsStream(pki[0].client.wrap_socket(near_sock, do_handshake_on_connect=False))
    far = TlsStream(pki[1].server.wrap_socket(far_sock, server_side=True, do_handshake_on_connect=False))
    try:
        await asyncio.gather(near.handshake(5.0), far.handshake(5.0))
    except BaseException:
        near.hang_up()
        far.hang_up()
        raise
    return near, far


@pytest.fixture(params=KINDS)
async def pair(request: pytest.FixtureRequest,
               pki: tuple[PeerTls, PeerTls] | None) -> AsyncIterator[tuple[PeerStream, PeerStream]]:
    near, far = await connected(request.param, pki)
    try:
        yield near, far
    finally:
        near.hang_up()
        far.hang_up()


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def cut(view: memoryview, at: list[int]) -> list[memoryview]:
    """``view`` in pieces between the offsets ``at`` (0 and its length added)."""
    edges = [0, *at, len(view)]
    return [view[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def in_step(stream: PeerStream) -> None:
    """After a bulk move: a plain socket is non-blocking again, a TLS one keeps its timeout."""
    if isinstance(stream, PlainStream):
        assert not stream.sock.getblocking()
    else:
        assert stream.sock.gettimeout() == stream_module.BULK_STALL


async def test_frames_arrive_whole_stamped_and_in_order(pair: tuple[PeerStream, PeerStream]) -> None:
    near, far = pair
    big = random_bytes(JOIN_LIMIT + 1000, seed=1)  # past JOIN_LIMIT: sent in parts, not joined
    header = {"id": 42, "op": 8}

    async def send() -> None:
        await near.send_frame({"op": 7, "x": "small"}, b"abc")
        await near.send_frame(header, big[:100], memoryview(big))
        await near.send_bulk([])  # nothing moves
        await near.send_frame({"op": 9})

    sent = asyncio.ensure_future(send())
    got = [await far.recv_frame() for _ in range(3)]
    await far.recv_bulk([])
    await sent
    assert got == [({"v": 1, "id": 0, "op": 7, "x": "small"}, b"abc"),
                   ({"v": 1, "id": 42, "op": 8}, big[:100] + big),
                   ({"v": 1, "id": 0, "op": 9}, b"")]
    assert header == {"id": 42, "op": 8}  # the caller's header is left as it was


@pytest.mark.parametrize("total", [LOOP_BULK, LOOP_BULK + 1, 3 << 20], ids=["event-loop", "thread", "3MiB"])
async def test_bulk_views_arrive_intact_and_the_stream_stays_in_step(
        pair: tuple[PeerStream, PeerStream], total: int) -> None:
    near, far = pair
    data = random_bytes(total, seed=total)
    into = bytearray(total)
    at = [1, total // 3, total - 5]  # uneven views, the first a single byte
    await asyncio.gather(near.send_bulk(cut(memoryview(data), at)), far.recv_bulk(cut(memoryview(into), at)))
    assert into == data
    in_step(near)
    in_step(far)
    await near.send_frame({"op": 1}, b"after")
    assert await far.recv_frame() == ({"v": 1, "id": 0, "op": 1}, b"after")


@pytest.mark.parametrize("total", [0, 64 << 10, LOOP_BULK, LOOP_BULK + 1],
                         ids=["no-bulk", "one-write", "loop-limit", "thread"])
async def test_a_frame_and_its_bulk_arrive_as_a_frame_then_bulk(
        pair: tuple[PeerStream, PeerStream], total: int) -> None:
    """``send_frame_bulk`` puts the same bytes on the wire as ``send_frame`` then ``send_bulk``
    (in one ``sendmsg`` on a plain stream when the kernel takes them), the caller's header
    left as it was."""
    near, far = pair
    data = random_bytes(total, seed=total + 1)
    into = bytearray(total)
    at = [total // 2] if total else []
    header = {"id": 7, "op": 3, "bulk": total}

    async def receive() -> tuple[dict[str, object], bytes]:
        frame = await far.recv_frame()
        await far.recv_bulk(cut(memoryview(into), at) if total else [])
        return frame

    views = cut(memoryview(data), at) if total else []
    got, _ = await asyncio.gather(receive(), near.send_frame_bulk(header, (b"keys",), views))
    assert got == ({"v": 1, "id": 7, "op": 3, "bulk": total}, b"keys") and into == data
    assert header == {"id": 7, "op": 3, "bulk": total}
    in_step(near)
    await near.send_frame({"op": 1}, b"after")
    assert await far.recv_frame() == ({"v": 1, "id": 0, "op": 1}, b"after")


async def test_a_frame_and_bulk_the_kernel_takes_in_part_finish_on_the_loop() -> None:
    """A send buffer smaller than the frame and its blocks: ``sendmsg`` takes a part, the rest
    goes out on the event loop as the receiver reads, and nothing is lost or reordered."""
    near_sock, far_sock = tcp_pair()
    near_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    far_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    near, far = PlainStream(near_sock), PlainStream(far_sock)
    try:
        data = random_bytes(LOOP_BULK, seed=5)
        into = bytearray(LOOP_BULK)
        at = [1, 3000, 100_000]

        async def receive() -> tuple[dict[str, object], bytes]:
            await asyncio.sleep(0.05)  # the sender finds the buffers full first
            frame = await far.recv_frame()
            await far.recv_bulk(cut(memoryview(into), at))
            return frame

        got, _ = await asyncio.gather(receive(), near.send_frame_bulk({"op": 2}, (b"k" * 5000,),
                                                                      cut(memoryview(data), at)))
        assert got == ({"v": 1, "id": 0, "op": 2}, b"k" * 5000) and into == data
    finally:
        near.hang_up()
        far.hang_up()


@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(0, 300))
def test_unsent_is_what_follows_the_sent_bytes(parts: list[bytes], sent: int) -> None:
    whole = b"".join(parts)
    sent = min(sent, len(whole))
    rest = _unsent(list(parts), sent)
    assert b"".join(rest) == whole[sent:] and all(len(r) for r in rest)


@pytest.mark.parametrize("total", [64 << 10, 1 << 20], ids=["event-loop", "thread"])
async def test_a_peer_that_hangs_up_mid_bulk_is_a_peer_error(
        pair: tuple[PeerStream, PeerStream], total: int) -> None:
    near, far = pair

    async def half_then_gone() -> None:
        await near.send_bulk([memoryview(bytes(total // 2))])
        near.hang_up()

    sender = asyncio.ensure_future(half_then_gone())
    with pytest.raises(PeerError, match="peer closed the connection"):
        await far.recv_bulk([memoryview(bytearray(total))])
    await sender
    in_step(far)


async def test_eof_inside_a_frame_is_a_peer_error(pair: tuple[PeerStream, PeerStream]) -> None:
    near, far = pair
    near.sock.sendall(PREFIX.pack(10, 0) + b"abc")  # 3 of 10 header bytes (through TLS on a TLS stream)
    near.hang_up()
    with pytest.raises(PeerError, match="peer closed the connection"):
        await far.recv_frame()


async def test_a_frame_past_the_limit_is_refused(pair: tuple[PeerStream, PeerStream]) -> None:
    near, far = pair
    await near.send_frame({"op": 1}, bytes(100))
    assert (await far.recv_frame(limit=4096))[1] == bytes(100)
    await near.send_frame({"op": 2}, bytes(5000))
    with pytest.raises(PeerError, match="at most 4096"):
        await far.recv_frame(limit=4096)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("total", [64 << 10, 1 << 20], ids=["event-loop", "thread"])
async def test_a_peer_silent_mid_bulk_fails_it_after_bulk_stall(
        kind: str, total: int, pki: tuple[PeerTls, PeerTls] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "BULK_STALL", 1)  # the loop's bound, the kernel's and TLS timeouts
    near, far = await connected(kind, pki)
    loop = asyncio.get_running_loop()
    try:
        await near.send_bulk([memoryview(bytes(1000))])  # then silence
        start = loop.time()
        with pytest.raises(PeerError):
            await far.recv_bulk([memoryview(bytearray(total))])
        assert 0.5 < loop.time() - start < 10
        in_step(far)
    finally:
        near.hang_up()
        far.hang_up()


async def test_a_cancelled_bulk_receive_stops_its_thread_and_shuts_the_socket(
        pair: tuple[PeerStream, PeerStream]) -> None:
    """Cancelled mid-receive in a bulk thread (the peer stalls, far below BULK_STALL): the caller
    returns at once, and the socket is shut down (the peer sees the end of the stream)."""
    near, far = pair
    loop = asyncio.get_running_loop()
    into = bytearray(1 << 20)  # past LOOP_BULK: a bulk thread on either stream
    receiving = asyncio.ensure_future(far.recv_bulk([memoryview(into)]))
    await near.send_bulk([memoryview(b"\x01" * 1000)])
    await asyncio.sleep(0.2)
    assert not receiving.done()
    receiving.cancel()
    start = loop.time()
    with pytest.raises(asyncio.CancelledError):
        await receiving
    assert loop.time() - start < 5
    assert into[:1000] == b"\x01" * 1000 and not any(into[1000:])
    with pytest.raises(PeerError):
        await near.recv_frame()
