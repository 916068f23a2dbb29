"""Pure planning for the RDMA transport: memory-region chunks and work requests.

Nothing here touches a device; everything is a function of numbers, so it
is property-tested (tests/unit/test_rdma_plan.py).

Chunks. The pool is registered as several memory regions rather than one:
registration pins and maps every page, which takes seconds for hundreds of
GiB, and separate chunks register in parallel threads. ``chunk_region``
cuts ``[0, size)`` into contiguous chunks of at most ``max_chunk`` bytes
(page aligned) and at most ``MAX_CHUNKS`` of them, so the advertisement stays
small.

Work requests. A transfer is a list of blocks ``(local offset, remote
offset, length)``. ``segments`` splits each block where it crosses a local or
a remote chunk boundary (a scatter element and an RDMA remote range must each
lie inside one registered region). ``plan`` then packs segments into work
requests: consecutive segments whose remote ranges are contiguous in one
remote chunk share a request, one scatter element each (merged when also
contiguous locally in one local chunk), up to ``max_sge`` elements and
``max_bytes`` per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from emsd.transport.verbs import Sge, WorkRequest

MAX_CHUNKS = 256  # regions per pool: keeps the membership advertisement under its 16 KiB limit
CHUNK_ALIGN = 4096
DEFAULT_CHUNK = 1 << 30
MAX_WR_BYTES = 1 << 30  # below every device's max_msg_sz (2 GiB on mlx5)


class PlanError(ValueError):
    """A transfer that does not fit the registered regions."""


@dataclass(frozen=True)
class Chunk:
    """One registered range of a pool: ``[offset, offset + length)`` under ``key``."""

    offset: int
    length: int
    key: int = 0  # lkey locally, rkey for a peer's chunk
    addr: int = 0  # virtual address of ``offset``


def chunk_region(size: int, max_chunk: int = DEFAULT_CHUNK) -> list[tuple[int, int]]:
    """Cut ``[0, size)`` into contiguous ``(offset, length)`` chunks to register.

    Every chunk but the last is a multiple of ``CHUNK_ALIGN``; there are at
    most ``MAX_CHUNKS`` (chunks grow beyond ``max_chunk`` when needed);
    ``size == 0`` gives no chunks. Raises ``PlanError`` for a negative size or
    a ``max_chunk`` below ``CHUNK_ALIGN``.
    """
    if size < 0 or max_chunk < CHUNK_ALIGN:
        raise PlanError(f"cannot chunk {size} bytes into chunks of {max_chunk}")
    step = max(max_chunk, -(-size // MAX_CHUNKS))
    step -= step % CHUNK_ALIGN
    if step * MAX_CHUNKS < size:
        step += CHUNK_ALIGN
    return [(off, min(step, size - off)) for off in range(0, size, step)]


@dataclass(frozen=True)
class Segment:
    local: int  # local pool offset
    remote: int  # remote pool offset
    length: int
    lchunk: int  # index into the local chunks
    rchunk: int  # index into the remote chunks


def _find(chunks: Sequence[Chunk], offset: int) -> int:
    lo, hi = 0, len(chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if chunks[mid].offset + chunks[mid].length <= offset:
            lo = mid + 1
        else:
            hi = mid
    if lo == len(chunks) or chunks[lo].offset > offset:
        raise PlanError(f"offset {offset} lies in no registered region")
    return lo


def segments(blocks: Iterable[tuple[int, int, int]], local: Sequence[Chunk],
             remote: Sequence[Chunk]) -> list[Segment]:
    """Blocks ``(local offset, remote offset, length)`` split at every chunk boundary on either side.

    Zero-length blocks are skipped; raises ``PlanError`` when a block runs
    outside the chunks (chunks must be sorted and contiguous).
    """
    out: list[Segment] = []
    for loff, roff, length in blocks:
        if length < 0 or loff < 0 or roff < 0:
            raise PlanError(f"bad block ({loff}, {roff}, {length})")
        while length > 0:
            li, ri = _find(local, loff), _find(remote, roff)
            lc, rc = local[li], remote[ri]
            step = min(length, lc.offset + lc.length - loff, rc.offset + rc.length - roff)
            out.append(Segment(loff, roff, step, li, ri))
            loff, roff, length = loff + step, roff + step, length - step
    return out


def plan(segs: Sequence[Segment], local: Sequence[Chunk], remote: Sequence[Chunk], max_sge: int,
         max_bytes: int = MAX_WR_BYTES, first_id: int = 1) -> list[WorkRequest]:
    """Pack segments into work requests (see the module docstring); ids count up from ``first_id``.

    Each request has 1..``max_sge`` scatter elements, at most ``max_bytes``
    bytes (a single larger segment is cut), and one contiguous remote range
    inside one remote chunk; every byte of ``segs`` is moved exactly once,
    in order.
    """
    if max_sge < 1 or max_bytes < 1:
        raise PlanError(f"max_sge ({max_sge}) and max_bytes ({max_bytes}) must be positive")
    wrs: list[WorkRequest] = []
    sges: list[Sge] = []
    start = end = rchunk = size = 0
    last_local = (-1, -1)  # (end offset, chunk) of the last element, to merge into it

    def flush() -> None:
        nonlocal sges, size
        if sges:
            rc = remote[rchunk]
            wrs.append(WorkRequest(first_id + len(wrs), tuple(sges), rc.addr + start - rc.offset, rc.key))
        sges, size = [], 0

    for seg in segs:
        loff, roff, left = seg.local, seg.remote, seg.length
        while left > 0:
            step = min(left, max_bytes)
            joins = sges and seg.rchunk == rchunk and roff == end
            if not joins or size + step > max_bytes:
                flush()
                start = end = roff
                rchunk = seg.rchunk
                last_local = (-1, -1)
            lc = local[seg.lchunk]
            if last_local == (loff, seg.lchunk):
                prev = sges[-1]
                sges[-1] = Sge(prev.addr, prev.length + step, prev.lkey)
            elif len(sges) < max_sge:
                sges.append(Sge(lc.addr + loff - lc.offset, step, lc.key))
            else:
                flush()
                start, rchunk = roff, seg.rchunk
                sges.append(Sge(lc.addr + loff - lc.offset, step, lc.key))
            size += step
            end = roff + step
            last_local = (loff + step, seg.lchunk)
            loff, roff, left = loff + step, roff + step, left - step
    flush()
    return wrs
