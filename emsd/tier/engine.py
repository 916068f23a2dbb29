"""The disk tier's data file and the threads that read and write it.

The file is created and sized by the daemon (``posix_fallocate``, so that a
full file system shows at start, not at the first write) and opened with
``O_DIRECT``: blocks move between page-aligned memory (the pool's map, or a
staging buffer) and the device without a copy in the page cache, which
would otherwise hold a second copy of what the pool already caches and
evict the inference process's own pages. A file system that refuses
``O_DIRECT`` (tmpfs, some FUSE and overlay mounts) gets buffered I/O and a
log line: the tier still works, at page-cache speed and cost.

I/O runs in a pool of threads (``os.preadv``/``os.pwritev`` release the GIL),
so that several reads are in flight at once (NVMe needs a queue depth to
reach its bandwidth) and the event loop never waits for the disk. Reads
and writes have pools of their own, so that a backlog of demotions never
delays a promotion that a load is waiting for.

Blocks whose slots follow one another in the file (a prefix demoted in
order: ``emsd.tier.space`` hands out slots lowest first) are read in one
``preadv`` a run (``runs``, up to ``RUN_BYTES``) into their separate chunks:
fewer, larger I/Os, and one trip through the reader pool a run, not a block.

O_DIRECT needs the buffer address, file offset and length to be multiples
of the logical block size; ``SECTOR`` (4 KiB) covers every device. A block
whose place in the pool is not so aligned (a size that is not a multiple
of 4 KiB) is read through a bounce buffer and copied.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from emsd.files import open_own
from emsd.tier.space import SECTOR, slot_for

log = logging.getLogger("emsd.tier")

RUN_BYTES = 1 << 20  # at most this many bytes of adjacent blocks in one read


class DataFile:
    """The tier's data file at ``path``, ``size`` bytes, opened for direct I/O if the FS allows.

    ``direct`` says whether it was; ``reason`` why not. Raises ``OSError`` when
    the file cannot be created or sized (``ENOSPC``: the file system has no room).
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        fd = open_own(path, os.O_RDWR | os.O_CREAT)  # never through a symlink (emsd.files)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise
                log.info("disk tier: %s cannot preallocate (%s); blocks are allocated as written", path, exc)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.direct, self.reason = _reopen_direct(path, fd)

    def write(self, offset: int, buf: memoryview) -> None:
        """Write all of ``buf`` (aligned) at ``offset``; ``OSError`` on failure or a short write."""
        n = os.pwritev(self.fd, [buf], offset)
        if n != len(buf):
            raise OSError(errno.EIO, f"short write at {offset}: {n} of {len(buf)} bytes")

    def read(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` (aligned) from ``offset``; ``OSError`` on failure or a short read."""
        self.readv(offset, [buf])

    def readv(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` (each aligned) in turn from ``offset`` on, in one system call;
        ``OSError`` on failure or a short read."""
        n = os.preadv(self.fd, bufs, offset)
        want = sum(len(b) for b in bufs)
        if n != want:
            raise OSError(errno.EIO, f"short read at {offset}: {n} of {want} bytes")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _reopen_direct(path: Path, fd: int) -> tuple[int, bool, str]:
    """(descriptor, direct?, why not): ``path`` reopened with O_DIRECT when the FS takes it."""
    try:
        direct = open_own(path, os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        return fd, False, f"O_DIRECT refused ({exc.strerror})"
    probe = aligned(SECTOR)
    try:  # some file systems accept the flag and refuse the I/O
        os.preadv(direct, [memoryview(probe)], 0)
    except OSError as exc:
        os.close(direct)
        return fd, False, f"O_DIRECT I/O refused ({exc.strerror})"
    finally:
        probe.close()
    os.close(fd)
    return direct, True, ""


def aligned(n: int) -> mmap.mmap:
    """``n`` bytes of page-aligned anonymous memory (a staging or bounce buffer)."""
    return mmap.mmap(-1, max(n, 1), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def direct_ok(address: int, length: int) -> bool:
    """Whether a block of ``length`` bytes at ``address`` can move with O_DIRECT as it is."""
    return address % SECTOR == 0 and length % SECTOR == 0


def runs(offsets: list[int], lengths: list[int], bases: list[int], direct: bool,
         limit: int = RUN_BYTES) -> list[list[int]]:
    """The blocks to read (slot ``offsets[i]`` in the file, ``lengths[i]`` bytes, to memory at
    ``bases[i]``) cut into runs, each read in one I/O: indices in file order, every one in
    exactly one run. A run of more than one block holds slots that follow one another in the
    file, each of them movable with O_DIRECT as it is (``direct_ok``, so that slot and length
    agree), and at most ``limit`` bytes; anything else is a run of its own."""
    out: list[list[int]] = []
    end = size = -1
    for i in sorted(range(len(offsets)), key=offsets.__getitem__):
        movable = direct and direct_ok(bases[i], lengths[i])
        if movable and offsets[i] == end and size + lengths[i] <= limit:  # end: -1 after an unmovable one
            out[-1].append(i)
            size += lengths[i]
        else:
            out.append([i])
            size = lengths[i]
        end = offsets[i] + lengths[i] if movable else -1
    return out


def read_block(data: DataFile, offset: int, dest: memoryview, base: int) -> None:
    """Read ``len(dest)`` bytes of the slot at ``offset`` into ``dest`` (``base``: dest's address).

    Straight into ``dest`` when aligned, else through a bounce buffer.
    """
    length = len(dest)
    if not data.direct or direct_ok(base, length):
        data.read(offset, dest)
        return
    bounce = aligned(slot_for(length))
    try:
        view = memoryview(bounce)
        data.read(offset, view)
        dest[:] = view[:length]
        view.release()
    finally:
        bounce.close()


class Engine:
    """Threads for the tier's I/O: ``readers`` for promotions, ``writers`` for demotions."""

    def __init__(self, readers: int, writers: int) -> None:
        self._reads = ThreadPoolExecutor(readers, thread_name_prefix="emsd-disk-read")
        self._writes = ThreadPoolExecutor(writers, thread_name_prefix="emsd-disk-write")

    def read(self, call: object, *args: object) -> Future[object]:
        return self._reads.submit(call, *args)  # type: ignore[arg-type]

    def write(self, call: object, *args: object) -> Future[object]:
        return self._writes.submit(call, *args)  # type: ignore[arg-type]

    def close(self, wait: bool = True) -> None:
        """Stop taking work; with ``wait``, finish what is queued (a clean shutdown's demotions)."""
        self._reads.shutdown(wait=wait, cancel_futures=not wait)
        self._writes.shutdown(wait=wait, cancel_futures=not wait)
