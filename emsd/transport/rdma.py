"""The RDMA peer transport: one-sided READ and WRITE between pools, TCP for control.

Pieces, each behind the ``PeerLink`` interface the cluster already uses:

- ``RdmaEndpoint``: this daemon's RDMA side. At start it registers the whole
  pool as memory regions (``rdma_plan.chunk_region``; chunks registered in
  parallel threads) and builds the descriptor it advertises through
  membership (``rdma_desc``).
- ``RdmaServing``: the owner's half, one per peer TCP connection. Data never
  passes through it; it answers small control messages on the existing
  authenticated TCP connection (``emsd.transport.peer``): QP (connect an RC
  queue pair pair), PIN and UNPIN (blocks the client READs), RESERVE and
  COMMIT (chunks the client WRITEs), each served from a table; their layouts
  and limits are in ``emsd.protocol.rdma``.

  Everything a connection holds (pins, reservations, its QP) is released
  when it closes, so a client that dies mid-transfer leaks nothing.
- ``SelectingLink``: the client's link. It always opens the authenticated
  TCP connection; when selection allows (``emsd.transport.selection``) it
  also connects a QP. A load is PIN, RDMA READ into freshly reserved local
  chunks, local commit, UNPIN; a save is RESERVE on the owner, RDMA WRITE
  into the slabs it reserved, COMMIT. When RDMA fails mid-transfer the
  link tears its QP down (so no request touches memory any more), aborts
  what it had reserved, marks the peer FELL_BACK, and redoes the request
  over its TCP connection.

Work requests: ``rdma_plan.plan`` builds them; ``run_work`` keeps up to
``max_outstanding`` in flight on a QP and polls completions without ever
blocking the event loop (a poll that finds nothing yields, then sleeps a
little longer each time, up to ``POLL_MAX_SLEEP``).

Security: the advertised rkeys let any host on the RDMA fabric that learns
them read and write this node's pool; RDMA trusts the fabric (as Mooncake's
transfer engine does). The control messages themselves are authenticated.

This data path has not run on RDMA hardware in this project's CI; see
docs/transports.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import numpy as np

from emsd.pool.keys import KeyBatch
from emsd.pool.store import Status as SlotStatus
from emsd.protocol.peer import Encoded
from emsd.protocol.rdma import (
    CommitAnswer,
    CommitRequest,
    PinAnswer,
    PinRequest,
    QpAnswer,
    QpRequest,
    ReserveAnswer,
    ReserveRequest,
    UnpinRequest,
)
from emsd.transport.frames import FrameError, PeerOp
from emsd.transport.owner import BlockOwner
from emsd.transport.peer import (
    BULK_STALL,
    PeerConnection,
    PeerError,
    PeerRefused,
)
from emsd.transport.rdma_desc import DescriptorError, RdmaDescriptor, qp_from_wire, qp_to_wire
from emsd.transport.rdma_plan import DEFAULT_CHUNK, Chunk, chunk_region, plan, segments
from emsd.transport.selection import PeerTransports
from emsd.transport.verbs import MemoryRegion, Opcode, RdmaError, VerbsEngine, WorkRequest

log = logging.getLogger("emsd.rdma")

_A = TypeVar("_A")

MAX_OUTSTANDING = 32  # work requests in flight per QP
MAX_SGE = 16  # scatter elements per work request (capped by the device's max_sge)
MAX_HELD = 64  # pins/reservations one connection may hold at once
REGISTER_THREADS = 8
POLL_SPIN = 64  # empty polls that only yield before sleeping
POLL_MAX_SLEEP = 0.001


def pool_address(pool: memoryview) -> int:
    """The virtual address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(pool))


class RdmaEndpoint:
    """This daemon's RDMA side: the engine and the registered pool."""

    def __init__(self, engine: VerbsEngine, regions: Sequence[MemoryRegion], size: int) -> None:
        self.engine = engine
        self.size = size
        self.local = [Chunk(r.offset, r.length, r.lkey, r.addr) for r in regions]
        info = engine.port_info()
        self.max_sge = max(1, min(MAX_SGE, info.max_sge))
        self.max_outstanding = max(1, min(MAX_OUTSTANDING, info.max_wr))
        base = regions[0].addr if regions else 0
        self.descriptor = RdmaDescriptor(info, base, tuple((r.length, r.rkey) for r in regions))

    @classmethod
    def register(cls, engine: VerbsEngine, pool: memoryview, max_chunk: int = DEFAULT_CHUNK) -> RdmaEndpoint:
        """Register all of ``pool`` (in parallel chunks); raises ``RdmaError``."""
        base = pool_address(pool)
        chunks = chunk_region(len(pool), max_chunk)
        with ThreadPoolExecutor(min(REGISTER_THREADS, max(1, len(chunks)))) as ex:
            regions = list(ex.map(lambda c: engine.register(c[0], base + c[0], c[1]), chunks))
        return cls(engine, regions, len(pool))

    def serving(self, owner: BlockOwner) -> RdmaServing:
        """The control messages of one peer connection, over ``owner``'s blocks."""
        return RdmaServing(self, owner)

    def close(self) -> None:
        self.engine.close()


def open_endpoint(pool: memoryview, open_engine: Callable[..., VerbsEngine] | None = None,
                  device: str = "", port: int = 1, gid_index: int | None = None
                  ) -> tuple[RdmaEndpoint | None, str]:
    """An endpoint on RDMA ``device`` (""): the first one found) ``port``, with GID table entry
    ``gid_index`` (None: chosen by ``verbs.choose_gid_index``), or (None, why not). Never raises.
    ``open_engine(device, port, gid_index)`` defaults to ``PyverbsEngine``."""
    from emsd.transport.verbs import PyverbsEngine, probe

    devices, why = probe()
    if not devices:
        return None, why
    name = device or devices[0]
    if name not in devices:
        return None, f"no RDMA device {name!r} (found {', '.join(devices)})"
    try:
        engine = (open_engine or PyverbsEngine)(name, port, gid_index)
        return RdmaEndpoint.register(engine, pool), ""
    except RdmaError as exc:
        return None, f"RDMA device {name}: {exc}"


# -- moving work requests --------------------------------------------------------


async def run_work(engine: VerbsEngine, qp: Any, op: Opcode, wrs: Sequence[WorkRequest],
                   max_outstanding: int, stall: float = BULK_STALL) -> None:
    """Post ``wrs`` with at most ``max_outstanding`` in flight; return when all completed.

    Raises ``RdmaError`` for a failed completion, a completion nobody
    posted, or ``stall`` seconds without any completion. On any exception
    (and on cancellation) work requests may still be in flight: the caller
    must ``destroy_qp`` before reusing the memory.
    """
    posted = done = 0
    inflight: set[int] = set()
    idle, last = 0, time.monotonic()
    while done < len(wrs):
        while posted < len(wrs) and len(inflight) < max_outstanding:
            engine.post(qp, op, wrs[posted])
            inflight.add(wrs[posted].wr_id)
            posted += 1
        completions = engine.poll(qp, max_outstanding)
        for c in completions:
            if c.wr_id not in inflight:
                raise RdmaError(f"completion for unknown work request {c.wr_id}")
            if not c.ok:
                raise RdmaError(f"RDMA {op.value} failed: {c.status}")
            inflight.discard(c.wr_id)
            done += 1
        if completions:
            idle, last = 0, time.monotonic()
            continue
        if time.monotonic() - last > stall:
            raise RdmaError(f"no completion in {stall:.0f}s ({len(inflight)} work requests in flight)")
        idle += 1
        await asyncio.sleep(0 if idle < POLL_SPIN else min(POLL_MAX_SLEEP, 1e-5 * (idle - POLL_SPIN + 1)))


# -- the owner's half: control messages ------------------------------------------


class RdmaServing:
    """The RDMA control messages of one peer connection (``peer.ControlHandler``): blocks are
    lent and reserved through ``owner`` (``BlockOwner``), as over TCP."""

    def __init__(self, endpoint: RdmaEndpoint, owner: BlockOwner) -> None:
        self.endpoint = endpoint
        self.owner = owner
        self.qp: Any = None
        self._pins: dict[int, np.ndarray] = {}  # token -> pinned handles
        self._reserved: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # token -> (status, handles)
        self._tokens = 0

    def handle(self, op: int, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        serve = self._serving.get(op)
        if serve is None:
            raise FrameError(f"unknown RDMA control op {op}")
        fields, parts = serve(self, header, payload)
        return fields, b"".join(parts)

    def _qp(self, header: dict[str, Any], payload: bytes) -> Encoded:
        try:
            remote = qp_from_wire(QpRequest.decode(header, payload).qp)
        except DescriptorError as exc:
            raise FrameError(str(exc)) from None
        if self.qp is not None:
            self.endpoint.engine.destroy_qp(self.qp)
            self.qp = None
        e = self.endpoint
        try:
            qp, mine = e.engine.create_qp(e.max_outstanding, e.max_sge)
            self.qp = qp
            e.engine.connect_qp(qp, remote)
        except RdmaError as exc:
            raise PeerRefused(str(exc)) from None
        return QpAnswer(qp_to_wire(mine)).encode()

    def _next_token(self) -> int:
        if len(self._pins) + len(self._reserved) >= MAX_HELD:
            raise PeerRefused(f"this connection already holds {MAX_HELD} pins or reservations")
        self._tokens += 1
        return self._tokens

    @staticmethod
    def _held(tok: int, table: dict[int, Any]) -> int:
        if tok not in table:
            raise FrameError(f"unknown token {tok!r}")
        return tok

    def _pin(self, header: dict[str, Any], payload: bytes) -> Encoded:
        req = PinRequest.decode(header, payload)
        tok = self._next_token()
        pinned = self.owner.pin_to_lend(self.owner.namespace_id(req.ns), req.keys)
        self._pins[tok] = pinned.handles
        return PinAnswer(tok, pinned.offsets, pinned.lengths).encode()

    def _unpin(self, header: dict[str, Any], payload: bytes) -> Encoded:
        handles = self._pins.pop(self._held(UnpinRequest.decode(header, payload).tok, self._pins))
        self.owner.release_lent(handles)
        return {}, []

    def _reserve(self, header: dict[str, Any], payload: bytes) -> Encoded:
        req = ReserveRequest.decode(header, payload)
        tok = self._next_token()
        res = self.owner.reserve_arriving(self.owner.namespace_id(req.ns), req.keys, req.lengths,
                                         copy=False)
        self._reserved[tok] = (res.status, res.handles)
        return ReserveAnswer(tok, res.status, res.offsets).encode()

    def _commit(self, header: dict[str, Any], payload: bytes) -> Encoded:
        req = CommitRequest.decode(header, payload)
        status, handles = self._reserved.pop(self._held(req.tok, self._reserved))
        new = handles[status == SlotStatus.NEW]
        if not req.ok:
            self.owner.abort_arriving(new)
            return CommitAnswer(0).encode()
        self.owner.commit_arrived(new)
        failed = np.flatnonzero(status == SlotStatus.FAILED)
        return CommitAnswer(int(failed[0]) if failed.size else len(status)).encode()

    # Each control op and the method that serves it (any other op is refused: ``handle``).
    _serving: ClassVar[dict[int, Callable[[RdmaServing, dict[str, Any], bytes], Encoded]]] = {
        PeerOp.RDMA_QP: _qp,
        PeerOp.RDMA_PIN: _pin,
        PeerOp.RDMA_UNPIN: _unpin,
        PeerOp.RDMA_RESERVE: _reserve,
        PeerOp.RDMA_COMMIT: _commit,
    }

    def close(self) -> None:
        if self.qp is not None:  # first: no remote write lands after the aborts below
            self.endpoint.engine.destroy_qp(self.qp)
            self.qp = None
        for handles in self._pins.values():
            self.owner.release_lent(handles)
        for status, handles in self._reserved.values():
            self.owner.abort_arriving(handles[status == SlotStatus.NEW])
        self._pins.clear()
        self._reserved.clear()


# -- the client's link --------------------------------------------------------------


Advert = Callable[[str], tuple[RdmaDescriptor | None, str]]  # peer id -> (descriptor, why malformed)
Report = Callable[[str], None]  # peer id whose transport state just changed


class SelectingLink:
    """A ``PeerLink`` over RDMA when selection allows, else over its TCP connection."""

    def __init__(self, tcp: PeerConnection, endpoint: RdmaEndpoint | None, transports: PeerTransports,
                 advert: Advert, report: Report) -> None:
        self.tcp = tcp
        self.endpoint = endpoint
        self.transports = transports
        self.advert = advert
        self.report = report
        self.remote: RdmaDescriptor | None = None
        self.qp: Any = None
        self.last_bytes = 0
        self._lock = asyncio.Lock()
        self.peer_id = ""  # the node id the peer proved, once connected

    @property
    def owner(self) -> BlockOwner:
        """Where the copies a GET fetches are stored: its TCP connection's owner."""
        return self.tcp.owner

    async def connect(self, host: str, port: int, timeout: float = 5.0) -> None:
        """Open the TCP connection, then RDMA if selected; an RDMA failure leaves a TCP link."""
        await self.tcp.connect(host, port, timeout)
        peer = self.peer_id = self.tcp.peer_id
        desc, error = self.advert(peer)
        try_rdma, changed = self.transports.should_try_rdma(peer, desc, error)
        if changed:
            self.report(peer)
        if not try_rdma or self.endpoint is None or desc is None:
            return
        e = self.endpoint
        qp: Any = None
        try:
            qp, mine = e.engine.create_qp(e.max_outstanding, e.max_sge)
            call = self.tcp.request(QpRequest(qp_to_wire(mine)).encode())
            answer, body = await asyncio.wait_for(call, timeout)
            e.engine.connect_qp(qp, qp_from_wire(QpAnswer.decode(answer, body).qp))
        except (RdmaError, PeerRefused, DescriptorError, TimeoutError) as exc:
            if qp is not None:
                e.engine.destroy_qp(qp)
            if self.transports.connect_failed(peer, desc, str(exc)):
                self.report(peer)
            if self.tcp.sock is None:  # the control exchange itself broke the connection
                raise PeerError(f"RDMA set-up with {peer} broke the connection: {exc}") from None
            return
        except BaseException:
            if qp is not None:
                e.engine.destroy_qp(qp)
            raise
        self.qp, self.remote = qp, desc
        if self.transports.connected(peer, desc):
            self.report(peer)

    @property
    def closed(self) -> bool:
        return self.tcp.closed

    def close(self) -> None:
        self._drop_qp()
        self.tcp.close()

    def _drop_qp(self) -> None:
        if self.qp is not None and self.endpoint is not None:
            self.endpoint.engine.destroy_qp(self.qp)
        self.qp = None

    def _rdma_ready(self) -> bool:
        if self.qp is not None and not self.transports.uses_rdma(self.peer_id):
            self._drop_qp()  # another link to this peer fell back
        return self.qp is not None

    def _fell_back(self, why: str) -> None:
        self._drop_qp()
        if self.transports.transfer_failed(self.peer_id, why):
            self.report(self.peer_id)

    async def _move(self, op: Opcode, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        assert self.endpoint is not None and self.remote is not None
        e = self.endpoint
        blocks = zip(local.tolist(), remote.tolist(), lengths.tolist(), strict=True)
        rchunks = self.remote.remote_chunks()
        max_sge = min(e.max_sge, self.remote.port.max_sge)
        wrs = plan(segments(blocks, e.local, rchunks), e.local, rchunks, max_sge)
        await run_work(e.engine, self.qp, op, wrs, e.max_outstanding)

    async def get(self, ns_name: str, keys: KeyBatch) -> int:
        """Fetch the leading blocks the peer has into the local pool; how many are now local."""
        async with self._lock:  # one request at a time: requests share the QP's completion queue
            if self._rdma_ready():
                got = await self._rdma_get(ns_name, keys)
                if got is not None:
                    return got
            got = await self.tcp.get(ns_name, keys)
            self.last_bytes = self.tcp.last_bytes
            return got

    async def put(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray, lengths: np.ndarray) -> int:
        """Send local blocks (pinned by the caller) to the peer; its leading stored count."""
        async with self._lock:
            if self._rdma_ready():
                stored = await self._rdma_put(ns_name, keys, offsets, lengths)
                if stored is not None:
                    return stored
            return await self.tcp.put(ns_name, keys, offsets, lengths)

    async def exists(self, ns_name: str, keys: KeyBatch) -> int:
        """How many leading ``keys`` the peer holds (a control message: over TCP always)."""
        async with self._lock:
            return await self.tcp.exists(ns_name, keys)

    async def drop(self, ns_name: str) -> int:
        """Have the peer drop namespace ``ns_name`` (a control message: over TCP always)."""
        async with self._lock:
            return await self.tcp.drop(ns_name)

    async def _rdma_get(self, ns_name: str, keys: KeyBatch) -> int | None:
        """PIN, READ, commit, UNPIN; None when RDMA failed and the request must go over TCP."""
        try:
            header, body = await self.tcp.request(PinRequest(ns_name, keys).encode())
        except PeerRefused as exc:
            self._fell_back(str(exc))
            return None
        pinned = self._answer(PinAnswer.decode, header, body, len(keys), "PIN")
        count, tok, offsets, lengths = pinned.count, pinned.tok, pinned.offsets, pinned.lengths
        res = self.owner.reserve_arriving(self.owner.namespace_id(ns_name), keys.take(slice(0, count)),
                                          lengths, copy=True)
        new = np.flatnonzero(res.status == SlotStatus.NEW)
        try:
            await self._move(Opcode.READ, res.offsets[new], offsets[new], lengths[new])
        except (RdmaError, ValueError) as exc:  # ValueError: a plan that does not fit the regions
            self._drop_qp()
            self.owner.abort_arriving(res.handles[new])
            await self.tcp.request(UnpinRequest(tok).encode())
            self._fell_back(str(exc))
            return None
        except BaseException:
            self._drop_qp()
            self.owner.abort_arriving(res.handles[new])
            self.tcp.close()  # the owner releases the pin with the connection
            raise
        self.owner.commit_arrived(res.handles[new])
        await self.tcp.request(UnpinRequest(tok).encode())
        self.last_bytes = int(lengths.sum())
        failed = np.flatnonzero(res.status == SlotStatus.FAILED)
        return int(failed[0]) if failed.size else count

    async def _rdma_put(self, ns_name: str, keys: KeyBatch, offsets: np.ndarray,
                        lengths: np.ndarray) -> int | None:
        """RESERVE on the owner, WRITE, COMMIT; None when RDMA failed and the request must go over TCP."""
        n = len(keys)
        try:
            header, body = await self.tcp.request(ReserveRequest(ns_name, keys, lengths).encode())
        except PeerRefused as exc:
            self._fell_back(str(exc))
            return None
        reserved = self._answer(ReserveAnswer.decode, header, body, n, "RESERVE")
        tok, status, remote = reserved.tok, reserved.status, reserved.offsets
        new = np.flatnonzero(status == SlotStatus.NEW)
        try:
            await self._move(Opcode.WRITE, offsets[new], remote[new], lengths[new])
        except (RdmaError, ValueError) as exc:
            self._drop_qp()
            await self.tcp.request(CommitRequest(tok, False).encode())
            self._fell_back(str(exc))
            return None
        except BaseException:
            self._drop_qp()
            self.tcp.close()  # the owner aborts the reservation with the connection
            raise
        answer, body = await self.tcp.request(CommitRequest(tok, True).encode())
        return self._answer(CommitAnswer.decode, answer, body, n, "COMMIT").stored

    def _answer(self, decode: Callable[[dict[str, Any], bytes, int], _A], header: dict[str, Any],
                body: bytes, asked: int, what: str) -> _A:
        """``decode`` of a control answer; one that does not fit its request closes the link
        (``PeerError``): the peer is broken or not what it claims."""
        try:
            return decode(header, body, asked)
        except FrameError as exc:
            self.close()
            raise PeerError(f"{what} answer from {self.peer_id} is malformed: {exc}") from None
