"""The SDK's connection to its local emsd: one Unix socket, many calls in flight.

``DaemonClient.connect`` opens the socket, sends HELLO and receives the
pool's file descriptor with the answer (SCM_RIGHTS), then maps the pool
read/write: from then on the SDK moves block bytes itself, and the socket
carries only control frames.

Calls from any number of threads share the connection. Each request gets an
id and a slot; whichever waiting thread holds the read lock reads responses
and hands each to its slot (a leader/follower scheme), so a lone caller reads
its own answer on its own thread, with no thread hand-off on the fast path.

Every call has a deadline. A call that times out raises ``EMS_IO_TIMEOUT``;
if its answer arrives later, the call's ``late`` callback undoes what the
daemon did for it (aborts reservations, drops pins), so a timeout leaks
nothing. A broken connection fails every waiting call with ``EMS_IO_ERROR``
at once, and every later call too, until the SDK reconnects.
"""

from __future__ import annotations

import itertools
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ems.common.exception import EmsErrorCode, EmsException
from ems.grants import Grants
from emsd.pool.shared_index import SharedIndexReader
from emsd.pool.shared_index import available as shared_index_built
from emsd.transport.frames import (
    PROTOCOL_VERSION,
    SOCKET_NAME,
    FrameDecoder,
    FrameError,
    Op,
    Status,
    encode_parts,
)
from emsd.transport.pollwindow import next_window

DEFAULT_SOCKET_DIR = "/dev/shm/ems"
SOCKET_DIR_ENV = "EMS_SOCKET_DIR"
BUSY_POLL_ENV = "EMS_BUSY_POLL_US"  # microseconds a call polls for its answer before sleeping
BUSY_POLL_DEFAULT_US = 200
# seconds ``connect`` waits for the daemon's HELLO: a daemon that is gone refuses at once, so
# this only bounds a live one, which a loaded host can keep from answering for seconds
CONNECT_TIMEOUT = 5.0
_MADV_POPULATE_WRITE = 23
_MAP_NORESERVE = 0x4000  # Linux: no swap or hugepage reservation for the mapping
RECV_BUFFER = 64 * 1024
SHARED_INDEX_ENV = "EMS_SHARED_INDEX"  # "0": never read the daemon's shared index (ask it instead)

Late = Callable[[dict[str, Any], bytes], None]


def shared_index_wanted() -> bool:
    """Whether to ask the daemon for its shared index (``$EMS_SHARED_INDEX`` is not "0" and
    the C table is built): loads and ``exists`` of blocks in the pool then need no round
    trip (``emsd.pool.shared_index``)."""
    return os.environ.get(SHARED_INDEX_ENV, "1") != "0" and shared_index_built()


def busy_poll_budget() -> float:
    """Seconds a waiting call polls for its answer before it sleeps (``$EMS_BUSY_POLL_US``,
    default 200 us, which covers the daemon's answer to a small call; 0 off): an answer that
    arrives meanwhile needs no wake-up, which on a virtual machine costs tens of microseconds
    (``emsd.transport.busypoll``). The poll (``poll`` with no timeout) lets go of the GIL, so
    the caller's other threads run meanwhile. A value that is not an integer from 0 to 10000
    is ignored (the default)."""
    raw = os.environ.get(BUSY_POLL_ENV, "")
    us = int(raw) if raw.isdigit() and int(raw) <= 10_000 else BUSY_POLL_DEFAULT_US
    return us / 1e6


def socket_path() -> Path:
    """The daemon's socket: ``$EMS_SOCKET_DIR/emsd.sock`` (default /dev/shm/ems)."""
    return Path(os.environ.get(SOCKET_DIR_ENV) or DEFAULT_SOCKET_DIR) / SOCKET_NAME


def _error(status: int, message: str) -> EmsException:
    try:
        code = EmsErrorCode(status)
    except ValueError:
        code = EmsErrorCode.EMS_INTERNAL_ERROR
    return EmsException(code, message)


class _Slot:
    __slots__ = ("done", "header", "payload", "error", "late")

    def __init__(self, late: Late | None) -> None:
        self.done = False
        self.header: dict[str, Any] = {}
        self.payload = b""
        self.error: EmsException | None = None
        self.late = late


class Pending:
    """A request sent by ``DaemonClient.submit`` whose answer ``wait`` returns."""

    __slots__ = ("rid", "slot")

    def __init__(self, rid: int, slot: _Slot) -> None:
        self.rid = rid
        self.slot = slot

    @property
    def answered(self) -> bool:
        """Whether its answer (or its failure) is in: ``wait`` then returns without waiting."""
        return self.slot.done


class DaemonClient:
    """A connection to the local emsd plus the mapped pool."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or socket_path()
        self.sock: socket.socket | None = None
        self.pool: mmap.mmap | None = None
        self.pool_array: np.ndarray | None = None
        self.pool_addr = 0
        self._populator: _Populator | None = None
        self._sparse_page = 0  # a sparse mapping's slab page (0: the mapping is not sparse)
        self._mapped_pages: set[int] = set()  # slab pages of a sparse mapping populated here
        self.pool_size = 0
        self.info: dict[str, Any] = {}
        self.broken = True
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._waiters = 0  # threads blocked in _cond.wait (read under _cond)
        self._decoder = FrameDecoder()
        # A fixed receive buffer: recv(n) would allocate (and for large n, mmap)
        # a fresh n-byte object on every call.
        self._rbuf = bytearray(RECV_BUFFER)
        self._rview = memoryview(self._rbuf)
        self.grants = Grants(self)  # chunks granted to this connection for its next saves
        self.busy_poll = busy_poll_budget()  # the cap of the poll window
        self.poll_window = self.busy_poll  # seconds the next wait polls (emsd.transport.pollwindow)
        self._poller: select.poll | None = None  # the socket, for the busy poll (under _read_lock)
        self._hangup_poller = select.poll()  # the socket, for ``hung_up`` (set when connected)
        self.index: SharedIndexReader | None = None  # the daemon's shared index, when it offers one
        self._later: list[bytes] = []  # frames for the next write (``send_later``), under _send_lock

    # -- connection -------------------------------------------------------------

    def connect(self, hello: dict[str, Any], timeout: float = CONNECT_TIMEOUT) -> None:
        """Connect, authenticate and map the pool; raises ``EmsException``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.path))
            header = {"v": PROTOCOL_VERSION, "id": 0, "op": int(Op.HELLO), "pid": os.getpid(), **hello}
            if shared_index_wanted():
                header["idx"] = True
            sock.sendall(b"".join(encode_parts(header)))
            answer, fd, index_fd = _recv_hello(sock)
        except (OSError, FrameError) as exc:
            sock.close()
            raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                               f"cannot reach emsd at {self.path}: {exc}") from None
        index = _shared_index(answer, index_fd)
        if answer.get("st") != Status.OK or fd is None:
            sock.close()
            if index is not None:
                index.close()
            if fd is not None:
                os.close(fd)
            raise _error(answer.get("st", Status.INTERNAL), str(answer.get("msg", "HELLO refused")))
        try:
            size = int(answer["pool_size"])
            # MAP_NORESERVE: a tenant's memfd (``sparse``) is as large as the pool but holds only
            # its tenant's pages, which the daemon has faulted in; no hugepages to reserve here.
            self.pool = mmap.mmap(fd, size, mmap.MAP_SHARED | _MAP_NORESERVE,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, KeyError, ValueError) as exc:
            sock.close()
            if index is not None:
                index.close()
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, f"cannot map the pool: {exc}") from None
        finally:
            os.close(fd)
        self.pool_array = np.frombuffer(self.pool, dtype=np.uint8)
        self.pool_addr = int(self.pool_array.ctypes.data)
        self.pool_size = size
        # A sparse mapping is not populated whole: that would fill the tenant's file with
        # zeroes where other tenants' blocks are. Its pages are, one slab page at a time,
        # when a call first uses one (``map_in``).
        sparse = bool(answer.get("sparse"))
        self._sparse_page = int(answer.get("page", 0)) if sparse else 0
        self._mapped_pages = set()
        self._populator = None  # ``populate``: once something registers a KV cache to copy
        self.info = answer
        self.index = index
        self.sock = sock
        self._poller = None
        self._hangup_poller = _poller_of(sock, select.POLLRDHUP)
        self.broken = False

    def hung_up(self) -> bool:
        """Whether emsd has closed this connection while it was idle (its lease ran out, or emsd
        went away): ``poll`` says the peer hung up (``POLLRDHUP``, ``POLLHUP``), whatever
        answers are still unread. One system call, on a poll object kept for it (a new one
        a call doubled its cost; another thread's check at the same moment, which a poll
        object refuses, makes one of its own); marks the connection broken, so that the
        SDK reconnects before the next call, not after it fails."""
        sock = self.sock
        if self.broken or sock is None:
            return True
        try:
            try:
                events = self._hangup_poller.poll(0)
            except RuntimeError:  # "concurrent poll() invocation"
                events = _poller_of(sock, select.POLLRDHUP).poll(0)
        except OSError:
            return False
        closed = any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in events)
        if closed:
            self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, "emsd closed the connection"))
        return closed

    def close_socket(self) -> None:
        """Close the connection (pending calls fail) but keep the pool mapped."""
        self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, "client closed"))

    def populate(self) -> None:
        """Start filling this process's page tables for the whole pool in the background
        (``_Populator``), once per connection; cheap to call again. ``ContextCaching`` calls it
        once a KV cache is registered: only a connection that copies touches the pool. One
        that only asks (``exists``: a vLLM scheduler's) maps the pool and never fills its page
        tables, which on 4 KiB pages cost about 0.2 s of CPU and 2 MiB of kernel memory per
        GiB of pool. A no-op for a sparse mapping (``map_in`` fills its pages as calls use
        them) and before ``connect``."""
        if self._populator is None and self.pool_addr and not self._sparse_page:
            with self._cond:  # async calls run on several threads: one fill a connection
                if self._populator is None and self.pool_addr:
                    self._populator = _Populator(self.pool_addr, self.pool_size)

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) for ``populate``'s
        background fill to end; whether it has (True too when none was started). For
        benchmarks that connect anew and must not time the fill: it competes with the
        first calls for the CPU, about a second of a core per GiB of pool here."""
        populator = self._populator
        return populator is None or populator.wait(timeout)

    def map_in(self, offsets: np.ndarray) -> None:
        """With a sparse mapping (a tenant's memfd), fill this process's page tables for the
        slab pages holding ``offsets`` (byte offsets of blocks of this tenant, just reserved,
        granted or pinned) the first time a call uses each: one ``MADV_POPULATE_WRITE`` a
        page instead of a fault every 4 KiB. Those pages are this tenant's, allocated by the
        daemon, so nothing new is allocated. A no-op otherwise, and where the kernel lacks it."""
        page = self._sparse_page
        if not page or not len(offsets):
            return
        first = int(offsets[0]) // page
        if len(offsets) == 1 or first == int(offsets[-1]) // page:  # the usual call: one page
            if first in self._mapped_pages:
                return
            wanted = [first]
        else:
            pages = np.unique(np.asarray(offsets) // page).tolist()
            wanted = [p for p in pages if p not in self._mapped_pages]
        for p in wanted:
            self._mapped_pages.add(p)
            start = p * page
            _madvise(self.pool_addr + start, min(page, self.pool_size - start), _MADV_POPULATE_WRITE)

    def close(self) -> None:
        """Close the socket and unmap the pool. Call only with no copy in progress."""
        self.close_socket()
        if self._populator is not None:  # before the pool is unmapped under it
            self._populator.stop()
            self._populator = None
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.pool_addr:
            from ems.layout import unregister_pool_for_cuda

            unregister_pool_for_cuda(self.pool_addr)
            self.pool_addr = 0
        self.pool_array = None
        if self.pool is not None:
            try:
                self.pool.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
            self.pool = None

    # -- calls --------------------------------------------------------------------

    def call(self, op: Op, fields: dict[str, Any], payload: Sequence[bytes] = (),
             timeout: float | None = None, late: Late | None = None) -> tuple[dict[str, Any], bytes]:
        """Send one request and wait for its answer; raises ``EmsException``.

        ``timeout`` in seconds (None: wait forever). A non-OK status raises the
        matching ``EmsErrorCode``. ``late`` runs if the answer arrives after the
        call gave up.
        """
        return self.wait(self.submit(op, fields, payload, late), timeout)

    def submit(self, op: Op, fields: dict[str, Any], payload: Sequence[bytes] = (),
               late: Late | None = None) -> Pending:
        """Send one request without waiting: ``call`` in two halves, so that the
        caller can work while the daemon answers. Every ``Pending`` must be passed
        to ``wait`` (which gives up at once with ``timeout=0``, leaving ``late`` to
        undo the request). Raises ``EmsException`` if the request cannot be sent.
        """
        rid = next(self._ids)
        slot = _Slot(late)
        with self._cond:
            self._slots[rid] = slot
        self._send(rid, op, fields, payload)
        return Pending(rid, slot)

    def wait(self, pending: Pending, timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        """The answer to a ``submit``ted request, as ``call`` returns it; raises like ``call``."""
        slot = pending.slot
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait(slot, pending.rid, deadline)
        if slot.error is not None:
            raise slot.error
        st = slot.header.get("st", Status.INTERNAL)
        if st != Status.OK:
            raise _error(st, str(slot.header.get("msg", "request failed")))
        return slot.header, slot.payload

    def send_noreply(self, op: Op, fields: dict[str, Any], payload: Sequence[bytes] = ()) -> None:
        """Fire-and-forget request (the daemon answers only if it fails)."""
        self._send(0, op, {**fields, "nr": True}, payload)

    def send_later(self, op: Op, fields: dict[str, Any], payload: Sequence[bytes] = ()) -> None:
        """A fire-and-forget request that goes out in the same write as the next request sent
        on this connection: no wake-up of the daemon of its own (a write that wakes a sleeping
        daemon costs 100 us and more on a virtual machine)."""
        data = b"".join(encode_parts({"v": PROTOCOL_VERSION, "id": 0, "op": int(op), **fields, "nr": True},
                                     *payload))
        with self._send_lock:
            self._later.append(data)

    def _send(self, rid: int, op: Op, fields: dict[str, Any], payload: Sequence[bytes]) -> None:
        if self.broken or self.sock is None:
            with self._cond:
                self._slots.pop(rid, None)
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, "not connected to emsd")
        data = b"".join(encode_parts({"v": PROTOCOL_VERSION, "id": rid, "op": int(op), **fields},
                                     *payload))
        try:
            with self._send_lock:
                sock = self.sock  # once: another thread may close the connection meanwhile
                if sock is None:
                    raise OSError("the connection was closed")
                if self._later:
                    data = b"".join((*self._later, data))
                    self._later.clear()
                sock.sendall(data)
        except OSError as exc:
            self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, f"emsd connection lost: {exc}"))
            raise EmsException(EmsErrorCode.EMS_IO_ERROR, f"emsd connection lost: {exc}") from None

    def _wait(self, slot: _Slot, rid: int, deadline: float | None) -> None:
        while not slot.done:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._give_up(slot, rid)
                return
            if self._read_lock.acquire(blocking=False):
                try:
                    self._pump(slot, deadline)
                finally:
                    self._read_lock.release()
                    with self._cond:  # under _cond: a follower is either waiting or will see it free
                        if self._waiters:
                            self._cond.notify_all()
                continue
            with self._cond:
                if not slot.done and self._read_lock.locked():
                    self._waiters += 1
                    try:
                        self._cond.wait(timeout=remaining)
                    finally:
                        self._waiters -= 1

    def _give_up(self, slot: _Slot, rid: int) -> None:
        with self._cond:
            if slot.done:
                return
            slot.done = True
            slot.error = EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "emsd did not answer in time")
            if slot.late is None:
                self._slots.pop(rid, None)

    def _pump(self, mine: _Slot, deadline: float | None) -> None:
        """Read and dispatch answers until ``mine`` is done or the deadline passes."""
        sock = self.sock
        while not mine.done and sock is not None and not self.broken:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:
                start = time.perf_counter()
                caught = self._poll_briefly(sock) if self.poll_window else False
                sock.settimeout(remaining)
                got = sock.recv_into(self._rbuf)
                if self.busy_poll:
                    self.poll_window = next_window(self.poll_window, self.busy_poll, caught,
                                                   time.perf_counter() - start)
            except TimeoutError:
                return
            except OSError as exc:
                self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, f"emsd connection lost: {exc}"))
                return
            if not got:
                self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, "emsd closed the connection"))
                return
            try:
                frames = self._decoder.feed(self._rview[:got])
            except FrameError as exc:
                self._fail_all(EmsException(EmsErrorCode.EMS_IO_ERROR, f"bad answer from emsd: {exc}"))
                return
            for frame in frames:
                self._dispatch(frame.header, frame.payload)

    def _poll_briefly(self, sock: socket.socket) -> bool:
        """Poll ``sock`` for up to ``poll_window`` seconds (``poll`` with no timeout, which lets
        go of the GIL), so that an answer arriving meanwhile is read without sleeping; whether
        one did."""
        poller = self._poller
        if poller is None:
            poller = self._poller = _poller_of(sock, select.POLLIN | select.POLLRDHUP)
        end = time.perf_counter() + self.poll_window
        while not poller.poll(0):
            if time.perf_counter() >= end:
                return False
            os.sched_yield()  # with more runnable threads than cores, the daemon's goes first
        return True

    def _dispatch(self, header: dict[str, Any], payload: bytes) -> None:
        rid = header.get("id", 0)
        with self._cond:
            slot = self._slots.pop(rid, None)
            if slot is None:
                return  # an error answer to a no-reply request, or an abandoned call
            late = slot.late if slot.done else None
            if not slot.done:
                slot.header, slot.payload, slot.done = header, payload, True
            if self._waiters:
                self._cond.notify_all()
        if late is not None and header.get("st") == Status.OK:
            try:
                late(header, payload)
            except EmsException:
                pass

    def _fail_all(self, error: EmsException) -> None:
        with self._cond:
            self.broken = True
            for slot in self._slots.values():
                if not slot.done:
                    slot.done, slot.error = True, error
            self._slots.clear()
            self._cond.notify_all()
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def _poller_of(sock: socket.socket, events: int) -> select.poll:
    """A poll object watching ``sock`` for ``events``."""
    poller = select.poll()
    poller.register(sock, events)
    return poller


def _madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)`` through ctypes (which lets go of the GIL); -1 where it cannot be called."""
    global _madvise_fn
    if _madvise_fn is None:
        import ctypes

        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return -1
        fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        _madvise_fn = fn
    return int(_madvise_fn(address, length, advice))


_madvise_fn: Any = None


class _Populator:
    """Fills this process's page tables for the pool in the background, a chunk at a time.

    Without it each first touch of a 4 KiB page here is a minor fault (about
    30% of a 2 MiB block's copy time). ``MADV_POPULATE_WRITE`` (Linux 5.14;
    older kernels just fault lazily) maps them; it runs on a thread of its own,
    through ctypes (which lets go of the GIL), a chunk a call, so that the
    first call does not wait for a large pool to be mapped, nor for pages
    the daemon is still prefaulting (this allocates them as it goes).
    ``stop`` ends it after the chunk in flight: call it before unmapping.
    """

    CHUNK = 64 << 20

    def __init__(self, address: int, size: int) -> None:
        self._address, self._size = address, size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ems-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for off in range(0, self._size, self.CHUNK):
            if self._stop.is_set() or _madvise(self._address + off, min(self.CHUNK, self._size - off),
                                               _MADV_POPULATE_WRITE) != 0:
                return

    def wait(self, timeout: float | None) -> bool:
        """Whether the fill has ended, after waiting up to ``timeout`` seconds for it."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _recv_hello(sock: socket.socket) -> tuple[dict[str, Any], int | None, int | None]:
    """Read the HELLO answer and the descriptors sent with it: the pool's, and the shared
    index's when the daemon offers one."""
    decoder = FrameDecoder()
    got: list[int] = []
    try:
        while True:
            data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
            got += fds
            if not data:
                raise ConnectionError("emsd closed the connection during HELLO")
            frames = decoder.feed(data)
            if frames:
                fd, index_fd = (got + [None, None])[:2]
                got = got[2:]
                return frames[0].header, fd, index_fd
    finally:
        for extra in got:
            os.close(extra)


def _shared_index(answer: dict[str, Any], fd: int | None) -> SharedIndexReader | None:
    """The shared index the HELLO answer offers (``idx``: its size) mapped read-only from
    ``fd`` (closed here), or None; a table that cannot be mapped is left unused."""
    if fd is None:
        return None
    try:
        size = answer.get("idx")
        return SharedIndexReader(fd, size) if type(size) is int and answer.get("st") == Status.OK else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
