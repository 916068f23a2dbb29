"""The TCP peer transport: moving blocks between the pools of two daemons.

``emsd.cluster`` uses it: ``PeerServer`` serves this daemon's pool,
``PeerConnection`` is one authenticated connection to another daemon. Both
sides are tested on their own in tests/integration/test_peer.py.

Bytes never pass through Python ``bytes`` objects: a sender hands the
kernel memoryview slices of its pool, a receiver reads straight into freshly
reserved slabs of its own pool. This module speaks the protocol; how frames
and block bytes cross the connection is the business of a ``PeerStream``
(``emsd.transport.stream``): ``PlainStream`` for a TCP socket, ``TlsStream``
for mutual TLS. A frame uses the same codec as the local socket
(``emsd.transport.frames``); its ``bulk`` field says how many raw bytes
follow it. On a plain connection control frames go through the event loop,
each sent in one call; block bytes move as blocking calls in a worker thread
(one system call per up to 64 blocks, no event-loop wake-ups), except a request of at
most ``LOOP_BULK`` block bytes (what the kernel's buffers hold), which moves
them on the event loop: there the two hand-offs to a thread and back cost
more than the bytes.

Connections authenticate both ways before anything else, with a shared
cluster secret and HMAC-SHA256 over fresh nonces:

    server -> client   {op: CHALLENGE, nonce: Ns}
    client -> server   {op: AUTH, node, nonce: Nc, mac: H(secret, "c" Ns Nc node)}
    server -> client   {st: OK, node, mac: H(secret, "s" Nc Ns node)}

A wrong secret is refused (and logged) and the connection closed; the
secret itself never crosses the wire.

With TLS configured (``emsd.transport.tls.PeerTls``) each connection first
completes a mutual TLS handshake (``TlsStream.handshake``), then runs the same
challenge inside it. The handshake runs in the event loop (non-blocking steps,
one deadline), so a stranger that stalls it holds a descriptor, never a
thread. After it, a ``TlsStream`` does all its I/O (frames too) as blocking
calls in the bulk worker threads, since the event loop's ``sock_*`` calls
cannot drive an SSL socket; the loop only waits for readability before a
frame, so an idle connection holds no thread.

Requests (one at a time per connection; a daemon keeps several connections
per peer for parallelism; each request and answer is a value type of
``emsd.protocol.peer``, which both ends encode and decode). Both ends store,
lend, count and drop blocks through their daemon's ``BlockOwner``
(``emsd.transport.owner``: the ``Service``, which keeps quotas and checksums),
never through the store:

- ``GET {ns, n, kt}`` + keys: the server promotes what its disk tier holds
  (``BlockOwner.peer_promotion``), pins the leading present blocks and
  answers ``{count, lengths}`` followed by their bytes, then releases the
  pins. The client reserves local chunks for them, receives each block into
  its chunk (or discards it when the block was already present locally) and
  commits.
- ``PUT {ns, n, kt, lengths}`` + keys + the blocks' bytes: the server
  reserves, receives into its chunks and commits; it answers ``{stored}``, the
  number of leading blocks now present on the server.
- ``HAS {ns, n, kt}`` + keys: ``{count}`` of leading keys the server holds
  (its disk tier's too).
- ``DROP {ns}``: the server drops the namespace (``Service.drop_namespace``)
  and answers ``{dropped}``, the blocks it evicted.

An op the server does not know (a newer peer's, during a rolling upgrade) is
answered with INVALID_ARGUMENT and the connection stays up, unless its frame
announces ``bulk`` bytes: their meaning is unknown, so the server answers and
closes, as for any malformed request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from emsd.faults import FAULTS
from emsd.logs import Once
from emsd.pool.keys import KeyBatch
from emsd.pool.store import Status as SlotStatus
from emsd.protocol import readpass
from emsd.protocol.peer import (
    DropAnswer,
    DropRequest,
    Encoded,
    GetAnswer,
    GetRequest,
    HasAnswer,
    HasRequest,
    PutAnswer,
    PutRequest,
)
from emsd.transport.busypoll import BusyPoll, no_poll
from emsd.transport.frames import RDMA_OPS, FrameError, PeerOp, Status
from emsd.transport.owner import BlockOwner
from emsd.transport.stream import BULK_STALL as BULK_STALL
from emsd.transport.stream import JOIN_LIMIT as JOIN_LIMIT
from emsd.transport.stream import LOOP_BULK as LOOP_BULK
from emsd.transport.stream import SOCKET_BUFFER as SOCKET_BUFFER
from emsd.transport.stream import PeerError as PeerError
from emsd.transport.stream import PeerStream, PlainStream, TlsStream, _hang_up
from emsd.transport.stream import _tune as _tune
from emsd.transport.tls import PeerTls

if TYPE_CHECKING:
    from emsd.effects import Promote

log = logging.getLogger("emsd.peer")

PEER_PROTOCOL = 1
NONCE_BYTES = 32
AUTH_TIMEOUT = 5.0
# Before authentication a frame is a CHALLENGE, an AUTH or its answer: a few hundred bytes. A
# larger one is refused before anything is allocated for it: a stranger's length prefix must
# not make the daemon allocate (up to check_lengths' limits, megabytes a connection).
AUTH_FRAME_LIMIT = 4096
# Connections not yet authenticated (TLS handshake and AUTH exchange included), in all and per
# source address; more are closed at once. A silent one costs a descriptor for AUTH_TIMEOUT.
MAX_UNAUTHENTICATED = 64
MAX_UNAUTHENTICATED_PER_ADDRESS = 16
SCRATCH = 4 << 20  # discard buffer for blocks the receiver does not keep
_NO_SCRATCH = memoryview(b"")  # what a closed connection holds instead
_NEW, _FAILED = int(SlotStatus.NEW), int(SlotStatus.FAILED)  # a reserve's answers, as plain ints
# JOIN_LIMIT, LOOP_BULK, SOCKET_BUFFER, BULK_STALL, PeerError and _tune live in
# emsd.transport.stream (the streams use them; patch them there) and are imported from here too.


class PeerRefused(PeerError):
    """The peer answered a request with an error status; the connection is still in step."""


class ControlHandler(Protocol):
    """Serves the RDMA control messages of one connection (``emsd.transport.rdma.RdmaServing``)."""

    def handle(self, op: int, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """The answer's fields and payload; raises ``FrameError`` (the connection ends) or
        ``PeerRefused`` (an error answer, the connection stays)."""

    def close(self) -> None:
        """The connection ended: release everything it still holds."""


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


def _address(conn: socket.socket) -> str:
    """The source address of an accepted connection ("?" if it is already gone)."""
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "?"


def _views(pool: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    return [pool[off : off + size] for off, size in zip(offsets.tolist(), lengths.tolist(), strict=True)]


def _scratch_views(scratch: memoryview, nbytes: int) -> list[memoryview]:
    """Views of ``scratch`` that together take ``nbytes`` off the stream (and are thrown away);
    ``PeerError`` if the connection has let its scratch go (closed)."""
    if nbytes and not len(scratch):
        raise PeerError("connection closed")
    out = []
    while nbytes > 0:
        step = min(nbytes, len(scratch))
        out.append(scratch[:step])
        nbytes -= step
    return out


async def _inject_serving() -> None:
    """An injected fault while answering a peer (tests only: ``emsd.faults``)."""
    rule = FAULTS.at("peer.serve") if FAULTS is not None else None
    if rule is None:
        return
    if rule.action == "delay":
        await asyncio.sleep(rule.seconds)
    elif rule.action == "drop":
        raise ConnectionError("injected fault at peer.serve: drop")
    else:
        raise FrameError("injected fault at peer.serve: error")


async def _answer(link: _Served, rid: int, answer: GetAnswer | PutAnswer | HasAnswer | DropAnswer) -> None:
    """Send an OK answer to request ``rid``."""
    header, parts = answer.encode()
    await link.conn.send_frame({**header, "id": rid}, *parts)


def _check_id(header: dict[str, Any], rid: int) -> None:
    if header.get("id") != rid:
        raise PeerError(f"answer {header.get('id')!r} does not match request {rid}")


async def _receive_blocks(stream: PeerStream, owner: BlockOwner, pool: memoryview, ns: int, keys: KeyBatch,
                          lengths: np.ndarray, scratch: memoryview, copy: bool) -> int:
    """Reserve (``owner.reserve_arriving``: within the tenant's quota), receive into ``pool``,
    commit; returns how many leading keys are now present. ``copy``: the blocks are copies
    this node fetched.

    Blocks that are already present, or for which there is no space, are
    read off the stream into ``scratch`` and dropped, keeping the stream in
    step. A failure mid-stream aborts what was reserved.
    """
    res = owner.reserve_arriving(ns, keys, lengths, copy)
    status = res.status.tolist()
    new = [i for i, st in enumerate(status) if st == _NEW]
    views: list[memoryview] = []
    for st, off, size in zip(status, res.offsets.tolist(), lengths.tolist(), strict=True):
        if st == _NEW:
            views.append(pool[off : off + size])
        else:
            views += _scratch_views(scratch, size)
    try:
        await stream.recv_bulk(views)
    except BaseException:
        owner.abort_arriving(res.handles[new])
        raise
    owner.commit_arrived(res.handles[new])
    return status.index(_FAILED) if _FAILED in status else len(keys)


# -- server ------------------------------------------------------------------


@dataclass
class _Served:
    """One authenticated connection a ``PeerServer`` serves: what its requests share."""

    loop: asyncio.AbstractEventLoop
    conn: PeerStream
    scratch: memoryview  # where a PUT's blocks that are not kept are received
    control: ControlHandler | None = None  # made at the first RDMA control message
    reader: Reader | None = None  # an SDK client with a read pass (GET only), None: a daemon


@dataclass(frozen=True)
class Reader:
    """An SDK client that showed a read pass: it may GET blocks of ``tenant`` until ``expires``."""

    tenant: str
    expires: int  # Unix seconds

    def check(self, op: object) -> None:
        """Raises ``FrameError`` (the server answers and hangs up) unless ``op`` is a GET
        made before the pass expired."""
        if op != PeerOp.GET:
            raise FrameError(f"a reader may only GET (got op {op!r})")
        if time.time() >= self.expires:
            raise FrameError("read pass expired")


Promoting = Callable[["Promote", float], Awaitable[object]]  # carries out a Promote by a deadline


class PeerServer:
    """Serves this daemon's pool to authenticated peers over TCP (over mutual TLS with ``tls``).

    ``owner`` stores, lends, counts and drops the blocks (``BlockOwner``: the ``Service``);
    ``pool`` is the whole region, writable. ``promote`` carries out the disk-tier promotion a
    GET needs (``owner.peer_promotion``; ``emsd.remote.Remote.before``); None: none is done.
    """

    def __init__(self, owner: BlockOwner, pool: memoryview, node_id: str, secret: bytes, *,
                 control: Callable[[], ControlHandler] | None = None, tls: PeerTls | None = None,
                 socket_buffer: int = SOCKET_BUFFER, promote: Promoting | None = None) -> None:
        self.owner = owner
        self.pool = pool
        self.promote = promote
        self.socket_buffer = socket_buffer  # bytes a direction per accepted connection (_tune)
        self.node_id = node_id
        self.secret = secret
        self.control = control  # RDMA control messages; None: refused (this node serves TCP only)
        self.tls = tls
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[PeerStream] = set()  # accepted connections not yet ended
        self.reads = 0  # GETs served to SDK clients' read passes
        self.refused = 0  # connections that ended before authenticating (TLS, AUTH, malformed, silent)
        self.unauthenticated: collections.Counter[str] = collections.Counter()  # by source address
        self.refused_busy = 0  # connections closed at once: too many not yet authenticated
        self._busy_log, self._refused_log, self._accept_log = Once(60.0), Once(60.0), Once(60.0)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; returns the bound (host, port) (port 0 picks a free one)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._spawn(self._accept_loop())
        bound = sock.getsockname()
        return bound[0], bound[1]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._conns):
            conn.hang_up()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if self._listener is None:
                    return
                if self._accept_log.due():  # EMFILE and friends: every 100 ms while it lasts
                    log.warning("peer accept failed: %s (said once a minute at most)", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            address = _address(conn)
            if not self._admit(address):
                _hang_up(conn)
                continue
            _tune(conn, self.socket_buffer)
            stream = PlainStream(conn)
            self._conns.add(stream)
            self._spawn(self._serve(stream, address))

    def refusals(self) -> dict[str, int]:
        """Connections refused so far, by reason: failed TLS or AUTH ("auth"), or closed at once
        because too many were not yet authenticated ("busy")."""
        return {"auth": self.refused, "busy": self.refused_busy}

    def _admit(self, address: str) -> bool:
        """Whether a new connection from ``address`` may start authenticating (and count it)."""
        if (sum(self.unauthenticated.values()) >= MAX_UNAUTHENTICATED
                or self.unauthenticated[address] >= MAX_UNAUTHENTICATED_PER_ADDRESS):
            self.refused_busy += 1
            if self._busy_log.due():
                log.warning("peer connections refused: %d not yet authenticated (at most %d, %d from "
                            "one address; %s has %d); %d refused so far", sum(self.unauthenticated.values()),
                            MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_ADDRESS, address,
                            self.unauthenticated[address], self.refused_busy)
            return False
        self.unauthenticated[address] += 1
        return True

    def _refuse(self, address: str, why: Exception) -> None:
        """Count a connection from ``address`` that ended before authenticating; log it, at
        most once a minute (anyone can make such connections)."""
        self.refused += 1
        if self._refused_log.due():
            log.warning("peer connection from %s refused: %s (%d refused so far; one line a minute at "
                        "most)", address, why, self.refused)

    def _authenticated(self, address: str) -> None:
        """``address``'s connection left the unauthenticated state (authenticated or closed)."""
        self.unauthenticated[address] -= 1
        if self.unauthenticated[address] <= 0:
            del self.unauthenticated[address]

    async def _serve(self, conn: PeerStream, address: str) -> None:
        loop = asyncio.get_running_loop()
        peer = "?"
        link: _Served | None = None
        pending = True  # counted in self.unauthenticated until authenticated or closed
        try:
            if self.tls is not None:
                conn = await self._tls_accept(conn)
            peer, reader = await asyncio.wait_for(self._authenticate(conn), AUTH_TIMEOUT)
            pending = False
            self._authenticated(address)
            scratch = memoryview(bytearray(SCRATCH)) if reader is None else _NO_SCRATCH  # a reader never PUTs
            link = _Served(loop, conn, scratch, reader=reader)
            while True:
                header, payload = await conn.recv_frame()
                rid, op = header["id"], header.get("op")
                try:
                    if FAULTS is not None:
                        await _inject_serving()
                    if reader is not None:
                        reader.check(op)
                    serve = self._serving.get(op) if type(op) is int else None
                    if serve is not None:
                        await serve(self, link, rid, header, payload)
                    elif not header.get("bulk"):  # a newer peer's op: refuse it, stay in step
                        await conn.send_frame({"id": rid, "st": int(Status.INVALID_ARGUMENT),
                                               "msg": f"unknown peer op {op!r}"})
                    else:  # raw bytes of unknown meaning follow: the stream cannot be kept in step
                        raise FrameError(f"unknown peer op {op!r} with bulk bytes")
                except FrameError as exc:
                    # The stream may be out of step after a bad request: answer and drop it.
                    await conn.send_frame({"id": rid, "st": int(exc.status), "msg": str(exc)})
                    raise
        except (PeerError, FrameError, ConnectionError, TimeoutError, OSError) as exc:
            if pending:
                self._refuse(address, exc if str(exc) else PeerError("no AUTH in time"))
            else:
                log.debug("peer %s: connection ends: %s", peer, exc)
        finally:
            if pending:
                self._authenticated(address)
            if link is not None:
                link.scratch = _NO_SCRATCH  # now, not when a cycle holding the link is collected
                if link.control is not None:
                    link.control.close()  # its pins and reservations go with the connection
            self._conns.discard(conn)
            conn.hang_up()

    async def _tls_accept(self, conn: PeerStream) -> TlsStream:
        """The TLS side of an accepted connection; raises ``PeerError`` if its handshake fails."""
        assert self.tls is not None
        tls_conn = TlsStream(self.tls.server.wrap_socket(conn.sock, server_side=True,
                                                         do_handshake_on_connect=False))
        self._conns.discard(conn)  # wrapping took over its descriptor
        self._conns.add(tls_conn)
        try:
            await tls_conn.handshake(AUTH_TIMEOUT)
        except PeerError as exc:
            self._conns.discard(tls_conn)
            tls_conn.hang_up()
            raise PeerError(f"TLS handshake failed: {exc}") from None
        return tls_conn

    async def _control(self, link: _Served, rid: int, header: dict[str, Any], payload: bytes) -> None:
        """An RDMA control message, served by the connection's ``ControlHandler``."""
        if link.control is None and self.control is not None:
            link.control = self.control()
        if link.control is None:
            answer: dict[str, Any] = {"st": int(Status.INVALID_ARGUMENT), "msg": "this node serves TCP only"}
            body = b""
        else:
            try:
                fields, body = link.control.handle(int(header["op"]), header, payload)
                answer = {"st": int(Status.OK), **fields}
            except PeerRefused as exc:
                answer, body = {"st": int(Status.INVALID_ARGUMENT), "msg": str(exc)}, b""
        await link.conn.send_frame({"id": rid, **answer}, body)

    async def _authenticate(self, conn: PeerStream) -> tuple[str, Reader | None]:
        """Who is on ``conn``: a daemon that proved the secret (its node id, None), or an SDK
        client that showed a read pass (``emsd.protocol.readpass``: "reader", its tenant and
        expiry). Raises ``PeerError`` for anyone else, after one refusal."""
        nonce = os.urandom(NONCE_BYTES)
        await conn.send_frame({"op": PeerOp.CHALLENGE, "nonce": nonce, "proto": PEER_PROTOCOL})
        header, _ = await conn.recv_frame(AUTH_FRAME_LIMIT)
        if header.get("op") == PeerOp.READ:
            try:
                tenant, expires = readpass.check(self.secret, header.get("pass"), time.time())
            except FrameError as exc:
                await conn.send_frame({"st": int(Status.INVALID_ARGUMENT), "msg": str(exc)})
                raise PeerError(str(exc)) from None
            await conn.send_frame({"st": int(Status.OK), "node": self.node_id})
            return "reader", Reader(tenant, expires)
        node, their, mac = header.get("node"), header.get("nonce"), header.get("mac")
        ok = (header.get("op") == PeerOp.AUTH and isinstance(node, str) and isinstance(their, bytes)
              and len(their) == NONCE_BYTES and isinstance(mac, bytes)
              and hmac.compare_digest(mac, _mac(self.secret, b"c", nonce, their, node.encode())))
        if not ok or not isinstance(their, bytes):
            await conn.send_frame({"st": int(Status.INVALID_ARGUMENT), "msg": "authentication failed"})
            raise PeerError("authentication failed")
        await conn.send_frame({"st": int(Status.OK), "node": self.node_id,
                               "mac": _mac(self.secret, b"s", their, nonce, self.node_id.encode())})
        return str(node), None

    async def _get(self, link: _Served, rid: int, header: dict[str, Any], payload: bytes) -> None:
        req = GetRequest.decode(header, payload)
        owner = self.owner
        keys = req.keys
        if link.reader is None:
            ns = owner.namespace_id(req.ns)
        else:  # an SDK client: its tenant's namespaces only, and none made for it
            self.reads += 1
            known = owner.readers_namespace(link.reader.tenant, req.ns)
            if known is None:
                await _answer(link, rid, GetAnswer(0, np.zeros(0, np.uint64)))
                return
            ns = known
        if self.promote is not None:  # blocks only on this node's disk are read into the pool first
            promotion = owner.peer_promotion(ns, keys)
            if promotion is not None:
                await self.promote(promotion, link.loop.time() + promotion.budget)
        pinned = owner.pin_to_lend(ns, keys)
        try:
            header, parts = GetAnswer(pinned.count, pinned.lengths).encode()
            await link.conn.send_frame_bulk({**header, "id": rid}, tuple(parts),
                                            _views(self.pool, pinned.offsets, pinned.lengths))
        finally:
            owner.release_lent(pinned.handles)

    async def _has(self, link: _Served, rid: int, header: dict[str, Any], payload: bytes) -> None:
        req = HasRequest.decode(header, payload)
        count = self.owner.present_count(self.owner.namespace_id(req.ns), req.keys)
        await _answer(link, rid, HasAnswer(count))

    async def _drop(self, link: _Served, rid: int, header: dict[str, Any], payload: bytes) -> None:
        req = DropRequest.decode(header, payload)
        await _answer(link, rid, DropAnswer(self.owner.drop_namespace(req.ns)))

    async def _put(self, link: _Served, rid: int, header: dict[str, Any], payload: bytes) -> None:
        req = PutRequest.decode(header, payload)
        ns = self.owner.namespace_id(req.ns)
        stored = await _receive_blocks(link.conn, self.owner, self.pool, ns, req.keys, req.lengths,
                                       link.scratch, copy=False)
        await _answer(link, rid, PutAnswer(stored))

    # Each peer op and the method that serves it (an op not here is refused: see ``_serve``).
    _serving: ClassVar[dict[int, Callable[[PeerServer, _Served, int, dict[str, Any], bytes],
                                          Awaitable[None]]]] = {
        PeerOp.GET: _get,
        PeerOp.PUT: _put,
        PeerOp.HAS: _has,
        PeerOp.DROP: _drop,
        **dict.fromkeys(RDMA_OPS, _control),
    }


# -- client ------------------------------------------------------------------


class PeerConnection:
    """One authenticated connection to a peer (over mutual TLS with ``tls``); one request at a time."""

    def __init__(self, owner: BlockOwner, pool: memoryview, node_id: str, secret: bytes,
                 tls: PeerTls | None = None, socket_buffer: int = SOCKET_BUFFER,
                 busy: BusyPoll | None = None) -> None:
        """``owner`` stores the copies a GET fetches (``BlockOwner``: the ``Service``) in
        ``pool`` (the whole region), whose blocks a PUT sends. ``busy``: the loop's busy poll
        (``node.busy_poll``), which then also polls for this link's answers
        (``BusyPoll.awaiting``); None: the loop sleeps while it waits for them."""
        self.owner = owner
        self.pool = pool
        self.busy = busy
        self.socket_buffer = socket_buffer  # bytes a direction (_tune)
        self.node_id = node_id
        self.secret = secret
        self.tls = tls
        self.stream: PeerStream | None = None  # PlainStream, or TlsStream with ``tls``
        self.peer_id = ""
        self._ids = 0
        self._lock = asyncio.Lock()
        self._scratch = _NO_SCRATCH  # SCRATCH bytes while connected
        self.last_bytes = 0  # block bytes the last GET answered with

    async def connect(self, host: str, port: int, timeout: float = 5.0) -> None:
        """Connect and authenticate both ways; raises ``PeerError``."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        stream: PeerStream = PlainStream(sock)
        try:
            _tune(sock, self.socket_buffer)
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
            if self.tls is not None:
                stream = TlsStream(self.tls.client.wrap_socket(sock, do_handshake_on_connect=False))
                await stream.handshake(timeout)
            await asyncio.wait_for(self._authenticate(stream), timeout)
        except (OSError, TimeoutError, FrameError, PeerError) as exc:
            stream.hang_up()
            raise PeerError(f"cannot connect to peer {host}:{port}: {exc}") from None
        self.stream = stream
        self._scratch = memoryview(bytearray(SCRATCH))

    async def _authenticate(self, stream: PeerStream) -> None:
        header, _ = await stream.recv_frame(AUTH_FRAME_LIMIT)
        theirs = header.get("nonce")
        if header.get("op") != PeerOp.CHALLENGE or not isinstance(theirs, bytes):
            raise PeerError("peer did not send a challenge")
        mine = os.urandom(NONCE_BYTES)
        await stream.send_frame({"op": PeerOp.AUTH, "node": self.node_id, "nonce": mine,
                                 "mac": _mac(self.secret, b"c", theirs, mine, self.node_id.encode())})
        answer, _ = await stream.recv_frame(AUTH_FRAME_LIMIT)
        node, mac = answer.get("node"), answer.get("mac")
        if answer.get("st") != Status.OK or not isinstance(node, str) or not isinstance(mac, bytes):
            raise PeerError(f"peer refused us: {answer.get('msg', 'no reason')}")
        if not hmac.compare_digest(mac, _mac(self.secret, b"s", mine, theirs, node.encode())):
            raise PeerError("peer failed to prove the cluster secret")
        self.peer_id = node

    def close(self) -> None:
        """Hang up and let the scratch buffer go now: a closed link may live on in a reference
        cycle (a failed request's traceback) until the collector's next full pass."""
        if self.stream is not None:
            self.stream.hang_up()
            self.stream = None
        self._scratch = _NO_SCRATCH

    @property
    def closed(self) -> bool:
        return self.stream is None

    @property
    def sock(self) -> socket.socket | None:
        """The socket under the stream (None once closed), for socket options and tests; I/O
        goes through ``stream``."""
        return None if self.stream is None else self.stream.sock

    async def get(self, ns_name: str, keys: KeyBatch) -> int:
        """Fetch the leading blocks the peer has into the local pool; returns how many are now local."""
        async with self._lock:
            stream = self._ready()
            with self._closing_on_failure(f"GET from {self.peer_id}"):
                header, payload = await self._exchange(stream, GetRequest(ns_name, keys).encode())
                if header.get("st") != Status.OK:
                    raise PeerError(f"GET refused: {header.get('msg')}")
                answer = GetAnswer.decode(header, payload, len(keys))
                ns = self.owner.namespace_id(ns_name)
                self.last_bytes = answer.bulk
                held = keys if answer.count == len(keys) else keys.take(slice(0, answer.count))
                return await _receive_blocks(stream, self.owner, self.pool, ns, held, answer.lengths,
                                             self._scratch, copy=True)

    async def put(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray) -> int:
        """Send local blocks (pool ``offsets``/``lengths``) to the peer; returns its leading stored count.

        The caller keeps the blocks pinned until this returns.
        """
        async with self._lock:
            stream = self._ready()
            rid = self._next_id()
            with self._closing_on_failure(f"PUT to {self.peer_id}"):
                header, parts = PutRequest(ns_name, keys, lengths).encode()
                with self._awaiting(stream) as poll:
                    await stream.send_frame_bulk({**header, "id": rid}, tuple(parts),
                                                 _views(self.pool, offsets, lengths))
                    poll()
                    header, payload = await stream.recv_frame()
                _check_id(header, rid)
                if header.get("st") != Status.OK:
                    raise PeerError(f"PUT refused: {header.get('msg')}")
                return PutAnswer.decode(header, payload, len(keys)).stored

    async def exists(self, ns_name: str, keys: KeyBatch) -> int:
        """How many leading ``keys`` the peer holds; no bytes move."""
        try:
            header, payload = await self.request(HasRequest(ns_name, keys).encode())
            return HasAnswer.decode(header, payload, len(keys)).count
        except PeerRefused as exc:
            raise PeerError(str(exc)) from None
        except FrameError as exc:
            raise PeerError(f"EXISTS answer from {self.peer_id}: {exc}") from None

    async def drop(self, ns_name: str) -> int:
        """Have the peer drop namespace ``ns_name``: 1 once it has, 0 if it refused (a node
        of a version without DROP; logged, and the peer is still up).
        Raises ``PeerError`` if the link fails."""
        try:
            await self.request(DropRequest(ns_name).encode())
        except PeerRefused as exc:
            log.warning("namespace %r not dropped: %s", ns_name, exc)
            return 0
        return 1

    async def call(self, op: int, fields: dict[str, Any], *payload: bytes) -> tuple[dict[str, Any], bytes]:
        """One control request (RDMA set-up) and its answer: ``request`` of a header map."""
        return await self.request(({"op": op, **fields}, list(payload)))

    async def request(self, encoded: Encoded) -> tuple[dict[str, Any], bytes]:
        """One request without bulk bytes and its answer; raises ``PeerRefused`` for an error
        answer (the connection stays usable) and ``PeerError`` otherwise (the connection is closed)."""
        op = encoded[0].get("op")
        async with self._lock:
            stream = self._ready()
            with self._closing_on_failure(f"request {op} to {self.peer_id}"):
                header, body = await self._exchange(stream, encoded)
        if header.get("st") != Status.OK:
            raise PeerRefused(f"{self.peer_id} refused request {op}: {header.get('msg', 'no reason')}")
        return header, body

    async def _exchange(self, stream: PeerStream, encoded: Encoded) -> tuple[dict[str, Any], bytes]:
        """Send a request frame under the next id and read its answer (the lock held)."""
        rid = self._next_id()
        header, parts = encoded
        with self._awaiting(stream) as poll:
            await stream.send_frame({**header, "id": rid}, *parts)
            poll()
            answer, body = await stream.recv_frame()
        _check_id(answer, rid)
        return answer, body

    def _awaiting(self, stream: PeerStream) -> contextlib.AbstractContextManager[Callable[[], None]]:
        """The loop's poll for this request's answer (``BusyPoll.awaiting``), or none."""
        if self.busy is None:
            return contextlib.nullcontext(no_poll)
        return self.busy.awaiting(stream.sock.fileno())

    @contextlib.contextmanager
    def _closing_on_failure(self, what: str) -> Iterator[None]:
        """Close the link when the request inside fails or is cancelled (a cancel: the caller's
        deadline struck mid-request): either way the stream is out of step. Failures become
        ``PeerError("<what> failed: ...")``."""
        try:
            yield
        except (OSError, FrameError, PeerError) as exc:
            self.close()
            raise PeerError(f"{what} failed: {exc}") from None
        except asyncio.CancelledError:
            self.close()
            raise

    def _ready(self) -> PeerStream:
        if self.stream is None:
            raise PeerError("not connected")
        return self.stream

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids
