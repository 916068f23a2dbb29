"""The byte streams under a peer link: a plain TCP socket (``PlainStream``) or mutual TLS
(``TlsStream``).

``emsd.transport.peer`` speaks its protocol through a ``PeerStream`` and never
looks at the socket kind. A stream moves two things: frames (the codec of
``emsd.transport.frames``, which stays sans-I/O) and bulk bytes (blocks,
straight between pool memoryviews and the socket). Every stream keeps these
contracts:

- ``send_frame(header, *payload)``: send one frame; the header goes out with
  the protocol version ``v`` and an ``id`` (0 unless it has one), first.
- ``recv_frame(limit)``: the next frame as (header, payload). With ``limit``,
  a frame of more than ``limit`` bytes (header and payload) raises
  ``PeerError`` before anything is allocated for it; past the codec's own
  limits, or with a bad header, ``FrameError``.
- ``send_bulk(views)`` / ``recv_bulk(views)``: move exactly the bytes of
  ``views``, in order (nothing for an empty list). A peer that stalls them
  past ``BULK_STALL`` seconds, or a failing socket, raises ``PeerError``.
- ``send_frame_bulk(header, payload, views)``: ``send_frame`` then
  ``send_bulk``, the same bytes on the wire (a GET's answer and its blocks, a
  PUT and its blocks).
- Any receive raises ``PeerError("peer closed the connection")`` at EOF.
  Frame calls on a plain stream may also raise ``OSError`` (the socket's own
  error); callers treat it as ``PeerError``.
- A cancelled call leaves the stream out of step (the caller must hang up),
  but never leaves a thread touching memory after it returns: a bulk thread
  is stopped by shutting the socket down and waited for first (``_in_thread``).
- ``hang_up()``: shut the socket down, then close it, so that a thread
  blocked on it wakes at once (a bare close would leave it blocked, holding
  views of the pool, until its kernel timeout).

``sock`` is the socket underneath (an ``ssl.SSLSocket`` for TLS), for socket
options and tests; I/O goes through the methods.

How each moves its bytes:

- ``PlainStream``, a non-blocking socket. Frames go through the event loop: a
  frame of at most ``JOIN_LIMIT`` bytes is joined and sent in one call, and a
  receive takes what has arrived at once, going through the loop only to wait
  for more (``_recv_exact_into``). Bulk bytes of at most ``LOOP_BULK`` a call
  move on the event loop too, bounded by ``BULK_STALL`` (those that have arrived
  are taken first, without a timer: ``_take_arrived``); a frame followed by
  such bulk bytes goes out in one ``sendmsg`` when the kernel takes it all, so
  that the receiver wakes once, to all of it (one block a call); more move as blocking
  ``sendmsg`` / ``recvmsg_into(MSG_WAITALL)`` of up to ``MAX_IOV`` blocks a call
  in a bulk thread (the socket made blocking for the call), bounded by the
  kernel timeouts ``_tune`` sets.
- ``TlsStream``, an ``ssl.SSLSocket``. The event loop's socket calls cannot
  drive one, so every frame and bulk move is a blocking call in a bulk thread
  (``recv_into`` one record at a time: no MSG_WAITALL on SSL sockets), bounded
  by the socket timeout (``BULK_STALL``). Before a frame is read the event loop
  waits for the socket to become readable (unless TLS already holds decrypted
  bytes, ``pending()``), so an idle connection holds no thread. ``handshake``
  runs in the event loop, one non-blocking step per readiness event.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from emsd.transport.frames import PREFIX, PROTOCOL_VERSION, check_lengths, decode_header, encode_parts

JOIN_LIMIT = 64 << 10  # a frame up to this size is joined and sent in one call
LOOP_BULK = 256 << 10  # block bytes up to this many a call move on the event loop (PlainStream)
MAX_IOV = 64  # buffers one sendmsg takes at most (the kernel's IOV_MAX is 1024)
SOCKET_BUFFER = 256 << 10  # kernel buffers per direction (cluster.peer_socket_buffer; see _tune)
BULK_STALL = 30  # seconds a bulk send or receive may make no progress before the connection fails


class PeerError(Exception):
    """A peer broke the protocol, refused us, or went away."""


Frame = tuple[dict[str, Any], bytes]
T = TypeVar("T")


def _tune(sock: socket.socket, buffer: int = SOCKET_BUFFER) -> None:
    """No Nagle delay, the bulk stall timeouts, and kernel buffers of ``buffer`` bytes a
    direction (0: left to the kernel's autotuning).

    The kernel doubles the value asked for, caps it at ``net.core.[rw]mem_max`` and
    stops autotuning that socket. Small buffers move blocks faster between two
    daemons of one host, as the benchmark runs them: what the sender copies into
    the kernel is still in its core's cache when the receiver copies it out (256 KiB
    against 4 MiB: about 1.4x on loopback; docs/benchmarks.md). Links with a
    larger bandwidth-delay product than twice ``buffer`` (100 Gb/s at 40 us) want
    a larger value, or 0.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stall = struct.pack("ll", BULK_STALL, 0)  # struct timeval: a blocked bulk call gives up after this
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if buffer else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer)
        except OSError:  # refused outright: the kernel's choice stands
            pass


def _hang_up(sock: socket.socket) -> None:
    """Shut ``sock`` down, then close it (``PeerStream.hang_up``; also for a socket that has
    no stream yet)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw socket, TLS or not
    sock.close()


class PeerStream(ABC):
    """Frames and bulk bytes over one connected socket; see the module docstring for the
    contract of each method."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @abstractmethod
    async def send_frame(self, header: dict[str, Any], *payload: bytes | memoryview) -> None:
        """Send one frame (``header`` stamped with ``v`` and ``id``)."""

    @abstractmethod
    async def recv_frame(self, limit: int | None = None) -> Frame:
        """The next frame; with ``limit``, one of at most that many bytes (else ``PeerError``)."""

    @abstractmethod
    async def send_bulk(self, views: list[memoryview]) -> None:
        """Send the bytes of ``views``; ``PeerError`` if that fails or stalls."""

    @abstractmethod
    async def recv_bulk(self, views: list[memoryview]) -> None:
        """Fill ``views`` from the stream; ``PeerError`` if that fails, stalls or hits EOF."""

    async def send_frame_bulk(self, header: dict[str, Any], payload: tuple[bytes | memoryview, ...],
                              views: list[memoryview]) -> None:
        """``send_frame(header, *payload)``, then ``send_bulk(views)``."""
        await self.send_frame(header, *payload)
        await self.send_bulk(views)

    def hang_up(self) -> None:
        """Shut the socket down and close it: a thread blocked on it wakes at once."""
        _hang_up(self.sock)


def _frame_parts(header: dict[str, Any], payload: tuple[bytes | memoryview, ...]) -> list[bytes | memoryview]:
    """The encoded parts of a frame, its header stamped with the protocol version and an id."""
    return encode_parts({"v": PROTOCOL_VERSION, "id": header.get("id", 0), **header}, *payload)


def _frame_lengths(prefix: bytes | bytearray, limit: int | None) -> tuple[int, int]:
    """(header, payload) lengths of a frame's prefix; raises ``FrameError`` past the codec's
    limits and ``PeerError`` past ``limit`` bytes in all (before anything is allocated)."""
    header_len, payload_len = PREFIX.unpack(prefix)
    check_lengths(header_len, payload_len)
    if limit is not None and header_len + payload_len > limit:
        raise PeerError(f"a frame of {header_len + payload_len} bytes before authentication "
                        f"(at most {limit})")
    return header_len, payload_len


def _split_body(body: bytearray, header_len: int) -> Frame:
    return decode_header(bytes(body[:header_len])), bytes(body[header_len:])


# -- plain TCP: a non-blocking socket ------------------------------------------


class PlainStream(PeerStream):
    """A non-blocking TCP socket: frames and small bulk moves on the event loop, larger bulk
    moves as blocking calls in a bulk thread."""

    async def send_frame(self, header: dict[str, Any], *payload: bytes | memoryview) -> None:
        loop = asyncio.get_running_loop()
        parts = _frame_parts(header, payload)
        if sum(map(len, parts)) <= JOIN_LIMIT:  # a control frame: one segment, one system call
            parts = [b"".join(parts)]
        for part in parts:
            await loop.sock_sendall(self.sock, part)

    async def recv_frame(self, limit: int | None = None) -> Frame:
        loop = asyncio.get_running_loop()
        prefix = bytearray(PREFIX.size)
        await _recv_exact_into(loop, self.sock, memoryview(prefix))
        header_len, payload_len = _frame_lengths(prefix, limit)
        body = bytearray(header_len + payload_len)
        await _recv_exact_into(loop, self.sock, memoryview(body))
        return _split_body(body, header_len)

    async def send_bulk(self, views: list[memoryview]) -> None:
        if not views:
            return
        if sum(map(len, views)) > LOOP_BULK:
            await _in_thread(self.sock, _send_blocking, self.sock, views)
            return
        loop = asyncio.get_running_loop()
        await _on_loop(views, lambda view: loop.sock_sendall(self.sock, view))

    async def recv_bulk(self, views: list[memoryview]) -> None:
        if not views:
            return
        if sum(map(len, views)) > LOOP_BULK:
            await _in_thread(self.sock, _recv_waitall, self.sock, views)
            return
        rest = _take_arrived(self.sock, views)  # a GET's blocks came with its answer: all of them
        if rest:
            loop = asyncio.get_running_loop()
            await _on_loop(rest, lambda view: _recv_exact_into(loop, self.sock, view))

    async def send_frame_bulk(self, header: dict[str, Any], payload: tuple[bytes | memoryview, ...],
                              views: list[memoryview]) -> None:
        """Up to ``LOOP_BULK`` block bytes: frame and blocks in one ``sendmsg`` as far as the
        kernel takes them, the rest on the event loop (bounded by ``BULK_STALL``)."""
        parts = [*_frame_parts(header, payload), *views]
        if sum(map(len, views)) > LOOP_BULK or len(parts) > MAX_IOV:
            await super().send_frame_bulk(header, payload, views)
            return
        try:
            sent = self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        rest = _unsent(parts, sent)
        if rest:
            loop = asyncio.get_running_loop()
            await _on_loop(rest, lambda view: loop.sock_sendall(self.sock, view))


def _take_arrived(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Fill ``views`` in order from the bytes that have arrived on the non-blocking ``sock``:
    the views (or the tail of one) still to fill once no more have arrived, an empty list
    when all are filled. ``PeerError`` at EOF or when the socket fails."""
    for i, view in enumerate(views):
        got = 0
        while got < len(view):
            try:
                n = sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                return [view[got:], *views[i + 1 :]]
            except OSError as exc:
                raise PeerError(str(exc)) from None
            if n == 0:
                raise PeerError("peer closed the connection")
            got += n
    return []


def _unsent(parts: Sequence[bytes | memoryview], sent: int) -> list[memoryview]:
    """What is left of ``parts`` after their first ``sent`` bytes (sent or received)."""
    rest: list[memoryview] = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        rest.append(memoryview(part)[sent:])
        sent = 0
    return rest


async def _recv_exact_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the non-blocking ``sock``: what has arrived is taken at once, and
    only the wait for more goes through the event loop (``sock_recv_into`` waits for
    readability first, which costs a loop iteration and several epoll_ctl calls even
    when the bytes are there: the body of a frame whose prefix was just read)."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise PeerError("peer closed the connection")
        got += n


async def _on_loop(views: list[memoryview], move: Callable[[memoryview], Awaitable[None]]) -> None:
    """``move`` each view with non-blocking calls on the event loop, all within ``BULK_STALL``.

    Up to ``LOOP_BULK`` bytes (a block or a few: what the kernel's buffers hold) move
    this way: two hand-offs to a thread and back cost more than the copy (a 64 KiB GET
    took about 1 ms through the threads). A peer that stalls them fails the request.
    """
    try:
        async with asyncio.timeout(BULK_STALL):
            for view in views:
                await move(view)
    except OSError as exc:  # TimeoutError included
        raise PeerError(str(exc) or "bulk transfer stalled") from None


def _send_blocking(sock: socket.socket, views: list[memoryview]) -> None:
    """Send the views, up to ``MAX_IOV`` a ``sendmsg``, with ``sock`` made blocking for the
    call (in a bulk thread)."""
    sock.setblocking(True)
    try:
        for at in range(0, len(views), MAX_IOV):
            rest: list[memoryview] = views[at : at + MAX_IOV]
            while rest:
                rest = _unsent(rest, sock.sendmsg(rest))
    finally:
        sock.setblocking(False)


def _recv_waitall(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill the views, up to ``MAX_IOV`` a ``recvmsg_into(MSG_WAITALL)``, with ``sock`` made
    blocking for the call (in a bulk thread)."""
    sock.setblocking(True)
    try:
        for at in range(0, len(views), MAX_IOV):
            rest: list[memoryview] = views[at : at + MAX_IOV]
            while rest:
                n = sock.recvmsg_into(rest, 0, socket.MSG_WAITALL)[0]
                if n == 0:
                    raise PeerError("peer closed the connection")
                rest = _unsent(rest, n)
    finally:
        sock.setblocking(False)


# -- mutual TLS: an SSL socket, blocking calls in bulk threads -----------------


class TlsStream(PeerStream):
    """An ``ssl.SSLSocket``: every frame and bulk move is a blocking call in a bulk thread;
    the handshake and the wait for a frame run in the event loop."""

    sock: ssl.SSLSocket

    def __init__(self, sock: ssl.SSLSocket) -> None:
        super().__init__(sock)

    async def handshake(self, timeout: float) -> None:
        """Complete the TLS handshake within ``timeout`` seconds, then set the bulk stall timeout.

        The handshake runs in the event loop, one non-blocking step per readiness
        event: a peer that connects and goes silent costs a descriptor until the
        deadline, never a thread, so stalled handshakes cannot hold up anyone
        else's (a node's own dials included). Raises ``PeerError``.
        """
        loop = asyncio.get_running_loop()
        sock = self.sock
        sock.setblocking(False)

        async def steps() -> None:
            while True:
                try:
                    sock.do_handshake()
                    return
                except ssl.SSLWantReadError:
                    await _readable(loop, sock)
                except ssl.SSLWantWriteError:
                    await _readable(loop, sock, write=True)

        try:
            await asyncio.wait_for(steps(), timeout)
        except TimeoutError:
            raise PeerError(f"the TLS handshake did not finish in {timeout:g} s") from None
        except (ssl.SSLError, OSError) as exc:
            raise PeerError(str(exc)) from None
        sock.settimeout(BULK_STALL)

    async def send_frame(self, header: dict[str, Any], *payload: bytes | memoryview) -> None:
        parts = _frame_parts(header, payload)
        await _in_thread(self.sock, _tls_send, self.sock, [memoryview(p) for p in parts])

    async def recv_frame(self, limit: int | None = None) -> Frame:
        if not self.sock.pending():
            await _readable(asyncio.get_running_loop(), self.sock)
        return await _in_thread(self.sock, _tls_recv_frame, self.sock, limit)

    async def send_bulk(self, views: list[memoryview]) -> None:
        if views:
            await _in_thread(self.sock, _tls_send, self.sock, views)

    async def recv_bulk(self, views: list[memoryview]) -> None:
        if views:
            await _in_thread(self.sock, _tls_recv, self.sock, views)


def _tls_send(sock: ssl.SSLSocket, views: list[memoryview]) -> None:
    """``sendall`` each view (in a bulk thread; the socket is blocking, with a timeout)."""
    for view in views:
        sock.sendall(view)


def _tls_recv(sock: ssl.SSLSocket, views: list[memoryview]) -> None:
    """Fill each view (in a bulk thread): no MSG_WAITALL on SSL sockets, one record per call."""
    for view in views:
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PeerError("peer closed the connection")
            got += n


def _tls_recv_frame(sock: ssl.SSLSocket, limit: int | None) -> Frame:
    """``TlsStream.recv_frame``'s reading and decoding, in a bulk thread."""
    prefix = bytearray(PREFIX.size)
    _tls_recv(sock, [memoryview(prefix)])
    header_len, payload_len = _frame_lengths(prefix, limit)
    body = bytearray(header_len + payload_len)
    _tls_recv(sock, [memoryview(body)])
    return _split_body(body, header_len)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool = False) -> None:
    """Wait until ``sock`` has bytes (or EOF) to read, or with ``write`` room to write, in the
    event loop: no thread while idle."""
    fd = sock.fileno()
    if fd < 0:
        raise PeerError("connection closed")
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)


# -- the bulk threads ------------------------------------------------------------
#
# Blocking moves run in a worker thread: one system call per up to MAX_IOV blocks, the GIL
# released, no event-loop wake-up per few segments (which costs more CPU than
# the copy itself on loopback). Kernel timeouts (SO_SNDTIMEO/SO_RCVTIMEO, set
# by ``_tune``; the socket timeout for TLS) bound a silent peer; a cancelled
# caller shuts the socket down and waits for the thread before touching the
# memory it was filling.

_BULK_THREADS = 16
_bulk_pool: ThreadPoolExecutor | None = None


async def _in_thread(sock: socket.socket, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` (blocking I/O on ``sock``) in a bulk thread; ``OSError`` becomes ``PeerError``.

    On cancellation the socket is shut down, which wakes the thread at once,
    and the thread is waited for before returning.
    """
    global _bulk_pool
    if _bulk_pool is None:
        _bulk_pool = ThreadPoolExecutor(_BULK_THREADS, thread_name_prefix="emsd-bulk")
    fut = asyncio.get_running_loop().run_in_executor(_bulk_pool, call, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw socket, TLS or not
        with contextlib.suppress(Exception):
            await fut
        raise
    except OSError as exc:
        raise PeerError(str(exc)) from None
