"""The local control transport: a Unix socket served with asyncio (uvloop).

Each connection starts with a handshake done on the raw socket: the client
sends HELLO, the daemon answers with the pool's file descriptor attached
(SCM_RIGHTS), so the client maps the very same memory (with tenants, the
memfd of the client's tenant alone: ``emsd.pool.tenancy``). Only then is the
socket handed to asyncio as a ``ControlProtocol``; from there on every frame
is decoded with ``FrameDecoder`` and served by ``emsd.coordinator.Coordinator``
in arrival order. Requests are handled synchronously on the event loop (they
only touch the in-memory index), so a response is written in the same
``data_received`` call that completed its request (the answers to a call's
frames together, except that those before a GRANT are written before it is
handled). A request that needs other nodes (a PIN's fetch, a COMMIT's
forward; see the coordinator) is answered when that work is done, by id,
possibly after later requests' answers.

A malformed frame is answered once with an error status (request id 0 when
it could not be read) and the connection is closed; the daemon and every
other client carry on. A client that disappears is cleaned up by
``Service.close``.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from emsd.coordinator import Coordinator
from emsd.files import check_dir
from emsd.logs import Once
from emsd.service import RequestError, Response, Service, Session
from emsd.transport.busypoll import BusyPoll
from emsd.transport.frames import (
    PREFIX,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameError,
    Op,
    Status,
    check_lengths,
    decode_header,
    encode,
    encode_parts,
)

log = logging.getLogger("emsd.unix")

HANDSHAKE_TIMEOUT = 5.0
_PEERCRED = struct.Struct("3i")
WRITE_STALL_TIMEOUT = 10.0  # seconds a client may leave its answers past the high-water mark unread


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


class ControlProtocol(asyncio.Protocol):
    """One authenticated client connection."""

    def __init__(self, service: Service, session: Session, on_close: Callable[[Any], None],
                 busy: BusyPoll | None = None) -> None:
        self.service = service
        self.coordinator = Coordinator(service)
        self.busy = busy  # keeps the loop awake a moment after answers (emsd.transport.busypoll)
        self._fd = -1
        self.session = session
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self._on_close = on_close
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._stall: asyncio.TimerHandle | None = None
        self.heard = time.monotonic()  # when the client last sent anything
        self._expired = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        if self.busy is not None:
            self.busy.add(self._fd)

    def silent(self, now: float) -> float:
        """Seconds the client has been silent with no request of its in flight (0 while one is)."""
        return 0.0 if self._tasks else now - self.heard

    def expire(self) -> None:
        """Hang up: the connection outlived its lease (``connection_lost`` releases its holds,
        as ``Service.close(expired=True)`` says)."""
        self._expired = True
        if self.transport is not None and not self._closed:
            self.transport.abort()

    def pause_writing(self) -> None:
        """The answers queued past the high-water mark: read no more requests until they drain,
        and hang up on a client that does not read them within ``WRITE_STALL_TIMEOUT`` (issue 25:
        a client sending STATS and never reading grew the daemon by gigabytes)."""
        assert self.transport is not None
        self.transport.pause_reading()
        self._stall = asyncio.get_running_loop().call_later(WRITE_STALL_TIMEOUT, self._stalled)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if not self._closed and self.transport is not None:
            self.transport.resume_reading()

    def _stalled(self) -> None:
        log.warning("closing client pid %s: it read no answers for %.0f s", self.session.peer_pid,
                    WRITE_STALL_TIMEOUT)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.heard = time.monotonic()
        if self.busy is not None:
            self.busy.heard()
        try:
            frames = self.decoder.feed(data)
        except FrameError as exc:
            self._refuse(exc)
            return
        out: list[bytes | memoryview] = []
        waiting = False  # a request answered later, when its peers have
        for frame in frames:
            if out and frame.header.get("op") == Op.GRANT:
                # A GRANT (the SDK sends one after a PUT, for its next save) may evict: the
                # answers before it go out first, so that it never holds them up.
                self.transport.writelines(out)
                out = []
            answer = self.coordinator.serve(self.session, frame.header, frame.payload)
            if not isinstance(answer, tuple):  # answered when the peers have (by id, out of order)
                self._spawn(self._answer_later(answer))
                waiting = True
                continue
            resp, parts = answer
            if not frame.header.get("nr") or resp.get("st"):
                out += encode_parts(resp, *parts)
        if out:
            self.transport.writelines(out)
        # Poll for the client's next request, unless it waits for an answer from peers: then
        # the cores are the peers' (the owner serving a GET), and the answer polls when it goes.
        if self.busy is not None and (out or not waiting):
            self.busy.after_answer()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_later(self, answer: Awaitable[Response]) -> None:
        resp, parts = await answer
        self._write(resp, parts)

    def _write(self, resp: dict[str, Any], parts: list[bytes]) -> None:
        if not self._closed and self.transport is not None:
            self.transport.writelines(encode_parts(resp, *parts))
            if self.busy is not None:
                self.busy.after_answer()

    def _refuse(self, exc: FrameError) -> None:
        assert self.transport is not None
        log.warning("closing client pid %s: %s", self.session.peer_pid, exc)
        self.transport.write(encode({"v": PROTOCOL_VERSION, "id": 0, "st": int(exc.status),
                                     "msg": str(exc)}))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self.busy is not None:
            self.busy.remove(self._fd)
        if self._stall is not None:
            self._stall.cancel()
        self.service.close(self.session, expired=self._expired)
        self._on_close(self)

    def close(self) -> list[asyncio.Task[None]]:
        """Hang up and cancel the peer work of requests in flight; the tasks to wait for."""
        if self.transport is not None:
            self.transport.close()
        for task in self._tasks:
            task.cancel()
        return list(self._tasks)


class UnixControlServer:
    """Accepts SDK connections on ``path``; hands each to a ``ControlProtocol``."""

    def __init__(self, path: Path, mode: int, pool_fd: Callable[[str], int | None],
                 service: Callable[[], Service | None], on_count: Callable[[int], None],
                 allowed: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()), lease: float = 0.0,
                 on_expired: Callable[[], None] = lambda: None, busy_poll: float = 0.0) -> None:
        """``lease``: seconds a connection may stay silent with no request in flight before it
        is closed, releasing its pins, reservations and grants (``node.client_lease``; 0: never);
        ``on_expired`` is called for each one. ``busy_poll``: seconds the loop polls its
        client connections after answers before it sleeps (``node.busy_poll``; 0: never)."""
        self.busy = BusyPoll(busy_poll) if busy_poll > 0 else None
        self.path = path
        self.mode = mode
        self.allowed_uids, self.allowed_gids = allowed  # both empty: whoever can open the socket
        self._pool_fd = pool_fd
        self._service = service
        self._on_count = on_count
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._accept_log = Once(60.0)
        self.lease = lease
        self._on_expired = on_expired
        self._lease_task: asyncio.Task[None] | None = None
        self._expired_log = Once(60.0)
        self.expired = 0
        self._conns: set[ControlProtocol] = set()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file bind() made

    def bind(self) -> None:
        """Create the socket file (replacing a stale one); raises OSError if one is live,
        ``UnsafePath`` if the directory is another user's or others may write to it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_dir(self.path.parent)
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()
            else:
                raise OSError(f"another emsd is already serving on {self.path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bind() creates the file with the umask's permissions; under 0o177 no one but
        # us can connect before the chmod below widens it to ``mode`` (issue 25).
        umask = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(umask)
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        os.chmod(self.path, self.mode)
        sock.listen(512)
        sock.setblocking(False)
        self._listener = sock

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        if self.lease > 0:
            self._lease_task = asyncio.get_running_loop().create_task(self._lease_loop())

    async def _lease_loop(self) -> None:
        """Close connections silent past the lease, checking a few times a lease (at most every s)."""
        while True:
            await asyncio.sleep(min(self.lease / 4, 1.0))
            service = self._service()
            if service is not None:
                service.release_quarantined()
            now = time.monotonic()
            for conn in [c for c in self._conns if c.silent(now) > self.lease]:
                self.expired += 1
                self._on_expired()
                if self._expired_log.due():
                    log.warning("closing client pid %s: silent for %.0f s, past node.client_lease (its pins "
                                "are released; its reservations and grants once that process has exited; "
                                "%d so closed; said once a minute at most)", conn.session.peer_pid,
                                conn.silent(now), self.expired)
                conn.expire()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                if self._accept_log.due():  # every 100 ms while it lasts
                    log.warning("accept failed: %s (said once a minute at most)", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handshake(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        session = Session()
        try:
            pid, uid, gid = peer_credentials(conn)
            session.peer_pid, session.peer_uid = pid, uid
            header = await asyncio.wait_for(self._read_hello(loop, conn), HANDSHAKE_TIMEOUT)
            if not self.admits(uid, gid):  # before answering: a refused peer never gets the fd
                log.warning("refused pid %d: uid %d / gid %d not in node.allowed_uids/gids", pid, uid, gid)
                raise RequestError(Status.INVALID_ARGUMENT,
                                   f"uid {uid} / gid {gid} may not use this emsd (node.allowed_uids/gids)")
            service = self._service()
            if service is None:
                self._send(conn, {"id": header["id"], "st": int(Status.RECOVERING),
                                  "msg": "emsd is starting; retry"})
                conn.close()
                return
            info = service.hello(session, header)
            # the memory of the client's tenant alone; none for a session of operator commands only
            fd = None if session.operator_only else self._pool_fd(session.tenant)
            fds = [] if fd is None else [fd]
            shared = service.store.shared
            if fds and shared is not None and "idx" in info:
                fds.append(shared.fd)  # read-only to clients (emsd.pool.shared_index)
            info.update(v=PROTOCOL_VERSION, id=header["id"], st=int(Status.OK))
            self._send(conn, info, fds)
        except (FrameError, RequestError) as exc:
            status = exc.status
            self._send(conn, {"id": 0, "st": int(status), "msg": str(exc)})
            conn.close()
            return
        except (TimeoutError, OSError, ConnectionError) as exc:
            log.debug("handshake with pid %s failed: %s", session.peer_pid, exc)
            conn.close()
            return
        transport, proto = await loop.connect_accepted_socket(
            lambda: ControlProtocol(service, session, self._closed, self.busy), conn)
        self._conns.add(proto)
        self._on_count(len(self._conns))

    def admits(self, uid: int, gid: int) -> bool:
        """Whether a peer with these credentials may connect (SO_PEERCRED)."""
        if not self.allowed_uids and not self.allowed_gids:
            return True
        return uid in self.allowed_uids or gid in self.allowed_gids

    async def _read_hello(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> dict[str, Any]:
        prefix = await _recv_exact(loop, conn, PREFIX.size)
        header_len, payload_len = PREFIX.unpack(prefix)
        check_lengths(header_len, payload_len)
        if payload_len:
            raise FrameError("HELLO carries no payload")
        return decode_header(await _recv_exact(loop, conn, header_len))

    @staticmethod
    def _send(conn: socket.socket, header: dict[str, Any], fds: list[int] | None = None) -> None:
        header.setdefault("v", PROTOCOL_VERSION)
        data = encode(header)
        try:
            if not fds:
                conn.sendall(data)
            else:
                conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError:
            pass

    def _closed(self, proto: ControlProtocol) -> None:
        self._conns.discard(proto)
        self._on_count(len(self._conns))

    async def close(self) -> None:
        """Stop accepting, close every connection, remove the socket file if ``bind`` made it
        (a daemon refused because another serves there leaves that one's file alone)."""
        if self._accept_task is not None:
            self._accept_task.cancel()
        if self._lease_task is not None:
            self._lease_task.cancel()
        for task in list(self._handshakes):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        pending = [task for proto in list(self._conns) for task in proto.close()]
        if pending:  # each unwinds at once: its bulk threads stop when their sockets shut down
            await asyncio.wait(pending, timeout=5.0)
        await asyncio.sleep(0)
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self._bound = None


async def _recv_exact(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(conn, n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during handshake")
        buf += chunk
    return bytes(buf)
