"""Hostile frames from an authenticated peer: the server answers or hangs up and keeps its data.

test_fuzz_daemon.py sends hostile AUTH exchanges to the peer port; this sends
what a peer that holds the cluster secret could (a buggy build, a newer or
older version, a corrupted stream) after it has authenticated. A seeded
generator (``EMS_PEER_FUZZ_SEED``, ``EMS_PEER_FUZZ_FRAMES``; the seed is in
every failure's message) writes well-framed requests over a real loopback
link to a ``PeerServer`` in this process: every peer op and unknown ones,
header fields of every wrong type and range, payloads of random length
(keys, keys and lengths, cut short, noise), bulk bytes after a PUT or an
unknown op, in full or cut short. Each is followed by a HAS of a known key,
whose answer marks the end of the request's answers.

For every request the server either answers, an error answer carrying a
status code and a message, or hangs up (the fuzzer then links again). Mixed
in are valid PUTs of fresh blocks and valid GETs of them and of three blocks
stored at the start: each must store and come back byte for byte. At the
end nothing stays reserved or pinned, and the three blocks read back equal.
DROP is sent for other namespaces only: dropping one is a peer's right.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
from typing import Any

import msgpack
import numpy as np
from test_peer import Node, blocks, link, serve

from emsd.pool.index import PENDING
from emsd.pool.keys import KeyBatch
from emsd.transport.frames import PeerOp, Status
from emsd.transport.peer import PeerConnection

SEED = int(os.environ.get("EMS_PEER_FUZZ_SEED", "20261202"))
FRAMES = int(os.environ.get("EMS_PEER_FUZZ_FRAMES", "2000"))
KNOWN = [1, 2, 3]  # keys of namespace "ns" stored before the fuzzing
MARK_ID = 1 << 40  # the request id of the HAS after each request
OPS = [int(op) for op in PeerOp] * 3 + [0, 99, 112, 250, (1 << 64) - 1, -1, "get", None]
PEER_OPS = frozenset(int(op) for op in PeerOp)
FIELDS = ("ns", "n", "kt", "bulk", "count", "token", "qp", "commit", "lengths", "tenant")


class Fuzz:
    """The seeded generator of one run's frames."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def value(self) -> Any:
        rng = self.rng
        return rng.choice([0, 1, 2, 7, -1, 1 << 31, 1 << 40, 1 << 63, (1 << 64) - 1, "ns", "", "x" * 9000,
                           b"\x00" * 8, None, True, 1.5, [1, 2], {"a": 1}, rng.randrange(100)])

    def header(self) -> dict[str, Any]:
        rng = self.rng
        h: dict[str, Any] = {"v": 1, "id": rng.randrange(1 << 20), "op": rng.choice(OPS)}
        h.update({f: self.value() for f in FIELDS if rng.random() < 0.6})
        if rng.random() < 0.5:
            h["ns"] = "ns"
        if rng.random() < 0.5:
            h["n"], h["kt"] = rng.choice([0, 1, 2, 3, 64]), rng.choice([0, 1])
        if h["op"] == PeerOp.DROP:
            h["ns"] = "other"
        return h

    def payload(self, h: dict[str, Any]) -> bytes:
        rng = self.rng
        n = h.get("n") if type(h.get("n")) is int and 0 <= h["n"] < 100 else rng.randrange(4)
        if h.get("kt") == 0:
            words = [rng.choice([1, 2, 3, rng.randrange(1 << 64)]) for _ in range(n)]
            keys = struct.pack(f"<{n}Q", *words)
        else:
            keys = rng.randbytes(33 * n)
        sizes = [rng.choice([1, 1000, 4096, 1 << 20, 0, 1 << 40]) for _ in range(n)]
        lengths = struct.pack(f"<{n}Q", *sizes)
        return rng.choice([keys, keys + lengths, keys + lengths[:-1], b"", rng.randbytes(rng.randrange(50))])

    def bulk(self, h: dict[str, Any]) -> bytes:
        """The bytes after the frame: for a PUT or an unknown op with a plausible ``bulk``, that
        many or fewer; none after ops that take none (the stream would only be out of step)."""
        bulk, op = h.get("bulk"), h.get("op")
        if type(bulk) is not int or not 0 < bulk < 1 << 21 or (op in PEER_OPS and op != PeerOp.PUT):
            return b""
        return bytes(bulk if self.rng.random() < 0.7 else self.rng.randrange(bulk + 1))


def frame(h: dict[str, Any], payload: bytes) -> bytes:
    head = msgpack.packb(h, use_bin_type=True)
    return struct.pack("<II", len(head), len(payload)) + head + payload


MARK = frame({"v": 1, "id": MARK_ID, "op": int(PeerOp.HAS), "ns": "ns", "n": 1, "kt": 0},
             struct.pack("<Q", KNOWN[0]))


async def answers(sock: socket.socket) -> tuple[list[dict[str, Any]], bool]:
    """The answers up to the mark's, skipping the bulk bytes after a GET's, and whether the
    server hung up before the mark's; TimeoutError when it says nothing for 10 s."""
    loop, buf, got = asyncio.get_running_loop(), b"", []
    try:
        while True:
            while len(buf) < 8 or len(buf) < 8 + sum(struct.unpack("<II", buf[:8])):
                buf += await _more(loop, sock)
            hl, pl = struct.unpack("<II", buf[:8])
            answer = msgpack.unpackb(buf[8 : 8 + hl])
            buf = buf[8 + hl + pl :]
            if answer.get("st") == Status.OK and answer.get("bulk"):
                while len(buf) < answer["bulk"]:
                    buf += await _more(loop, sock)
                buf = buf[answer["bulk"] :]
            if answer.get("id") == MARK_ID:
                return got, False
            got.append(answer)
    except (ConnectionError, OSError):
        return got, True


async def _more(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
    if not chunk:
        raise ConnectionError("the server hung up")
    return chunk


async def valid_round_trip(node: Node, conn: PeerConnection, other: Node, reader: PeerConnection,
                           rng: random.Random, i: int) -> None:
    """A valid PUT of two fresh blocks of ``node`` to namespace "fuzz" over ``conn``, then a
    GET of them over ``reader``, ``other``'s link: the bytes must come back into its pool."""
    users = [10_000 + 2 * i, 10_001 + 2 * i]
    keys = KeyBatch.from_user(users)
    data = [rng.randbytes(rng.choice([1, 700, 4096])) for _ in range(2)]
    res = node.store.reserve(node.ns("fuzz"), keys, np.array([len(d) for d in data], dtype=np.uint64))
    for off, d in zip(res.offsets.tolist(), data, strict=True):
        node.mem[off : off + len(d)] = d
    node.store.commit(res.handles)
    pinned = node.store.pin(node.ns("fuzz"), keys)
    try:
        assert await conn.put("fuzz", keys, pinned.offsets, pinned.lengths) == 2
    finally:
        node.store.release(pinned.handles)
    assert await reader.get("fuzz", keys) == 2
    assert other.read("fuzz", users) == data


async def test_hostile_frames_from_an_authenticated_peer() -> None:
    fuzz, rng = Fuzz(SEED), random.Random(SEED + 1)
    a, b, c = Node("a"), Node("b"), Node("c")
    known = blocks(3, 1000, seed=7)
    b.put_local("ns", KNOWN, known)
    server, port = await serve(b)
    loop = asyncio.get_running_loop()
    conn, reader = await link(a, port), await link(c, port)
    refused = hangups = 0
    try:
        for i in range(FRAMES):
            h = fuzz.header()
            sent = frame(h, fuzz.payload(h)) + fuzz.bulk(h)
            assert conn.sock is not None
            try:
                await loop.sock_sendall(conn.sock, sent + MARK)
                got, hung_up = await answers(conn.sock)
            except TimeoutError:
                raise AssertionError(f"seed {SEED}, frame {i}: no answer and no hang-up to {h}") from None
            except (ConnectionError, OSError):  # hung up while the frame was being sent
                got, hung_up = [], True
            for answer in got:
                if answer.get("st") != Status.OK:
                    refused += 1
                    assert answer["st"] in set(Status) and answer.get("msg"), (SEED, i, h, answer)
            if hung_up:
                hangups += 1
                conn.close()
                conn = await link(a, port)
            if i % 200 == 0:
                await valid_round_trip(a, conn, c, reader, rng, i)
        assert await reader.get("ns", KeyBatch.from_user(KNOWN)) == 3
        assert c.read("ns", KNOWN) == known
    finally:
        conn.close()
        reader.close()
        await server.close()
    assert refused > FRAMES // 20 and hangups > FRAMES // 20  # the hostile kinds really were refused
    assert b.read("ns", KNOWN) == known
    for node in (a, b, c):
        index = node.store.index
        live = index.state != 0
        assert not (index.state[live] == PENDING).any(), f"seed {SEED}: {node.name} kept a reservation"
        assert int(index.pins[live].sum()) == 0, f"seed {SEED}: {node.name} kept a pin"
