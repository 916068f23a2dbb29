"""Prefaulting the pool in the background, while the daemon already serves.

Faulting in every page of a large pool takes long (a cold 12 GiB pool took
29 s on one thread here, 500 GiB would take many minutes), and a node
without its cache for that long is what a cache must avoid. So the daemon
serves at once and ``Prefaulter`` faults the pool in behind it: ``threads``
threads, each at the lowest CPU priority (nice 19: on a busy host the
requests come first), take ``CHUNK``-sized pieces from the front of the pool to its end,
each with one ``MADV_POPULATE_WRITE`` (Linux >= 5.14), which allocates the
pages without touching their bytes, so it is safe beside clients that
already write into them. It is called through ctypes, which lets go of the
GIL for the call (``mmap.madvise`` holds it: the event loop would stall for
each chunk, and the threads would take turns). The slab allocator hands out pages from the front
first (``SlabAllocator``: page 0 first, freed pages again before new ones),
so saves land on pages that are faulted in already. A warm restart's pool
is mostly resident: populating a resident page only walks its page table.

Where ``MADV_POPULATE_WRITE`` is missing, the caller prefaults before it
serves instead (``Region.prefault``'s touch fallback writes each page's
first byte back, which must not race with clients).

``progress()`` says how far it got, for the log (a line every
``LOG_EVERY`` seconds on a long run, and one at the end), the
``emsd_pool_prefault_bytes`` metric and ``emsctl status``. A populate that
fails (no memory left for the pool) is logged once and ends the run: the
pages not faulted in are faulted by their first use instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass

from emsd.faults import FAULTS

log = logging.getLogger("emsd.pool")

MADV_POPULATE_WRITE = 23
CHUNK = 16 << 20
NICE = 19  # the prefault threads' niceness (Linux: per thread)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
LOG_EVERY = 10.0  # seconds between two progress lines


@dataclass(frozen=True)
class Progress:
    done: int  # bytes faulted in
    total: int
    seconds: float  # since the start (until the end, once finished)
    finished: bool
    error: str  # why it stopped early ("" if it did not)


def supported(mm: mmap.mmap) -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (tried on the mapping's first page)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
        return True
    except OSError:
        return False


def populate(address: int, length: int) -> None:
    """``madvise(address, length, MADV_POPULATE_WRITE)`` without the GIL; ``OSError`` on failure."""
    if _libc.madvise(address, length, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Prefaulter:
    """Background threads that fault in the mapping at ``address`` (``size`` bytes) front to back.

    The mapping must stay mapped until ``stop`` returns."""

    def __init__(self, address: int, size: int, threads: int = 4, chunk: int = CHUNK,
                 name: str = "the pool") -> None:
        """``name``: what the mapping is, for the log lines."""
        self.address = address
        self.name = name
        self.size = size
        self.chunk = chunk
        self._next = 0  # the next chunk's offset
        self._done = 0
        self._error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._ended: float | None = None
        self._logged = self._started
        self._threads = [threading.Thread(target=self._run, name=f"emsd-prefault-{i}", daemon=True)
                         for i in range(max(1, threads))]
        self._running = len(self._threads)

    def start(self) -> Prefaulter:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop after the chunks in flight (a shutdown); waits for the threads."""
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join()

    def progress(self) -> Progress:
        with self._lock:
            end = self._ended if self._ended is not None else time.monotonic()
            return Progress(self._done, self.size, end - self._started, self._ended is not None, self._error)

    def _take(self) -> tuple[int, int] | None:
        with self._lock:
            if self._error or self._next >= self.size:
                return None
            start = self._next
            self._next = min(self.size, start + self.chunk)
            return start, self._next

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # the lowest CPU priority: requests come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        try:
            while not self._stop.is_set() and (piece := self._take()) is not None:
                start, end = piece
                if FAULTS is not None:
                    _inject()
                try:
                    populate(self.address + start, end - start)
                except OSError as exc:
                    with self._lock:
                        if not self._error:
                            self._error = f"at {start >> 20} MiB: {exc}"
                            log.error("prefault stopped %s; the rest of %s is faulted in on first use",
                                      self._error, self.name)
                    return
                self._count(end - start)
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
                if last:
                    self._ended = time.monotonic()
            if last:
                p = self.progress()
                log.info("prefaulted %d of %d MiB of %s in %.1f s (%.2f GB/s, %d threads)%s", p.done >> 20,
                         p.total >> 20, self.name, p.seconds, p.done / max(p.seconds, 1e-9) / 1e9,
                         len(self._threads), "" if p.done == p.total else "; stopped early")

    def _count(self, n: int) -> None:
        with self._lock:
            self._done += n
            now = time.monotonic()
            if now - self._logged < LOG_EVERY:
                return
            self._logged = now
            done, total, seconds = self._done, self.size, now - self._started
        log.info("prefaulting %s: %d of %d MiB (%.0f%%) in %.0f s", self.name, done >> 20, total >> 20,
                 100 * done / total, seconds)


def _inject() -> None:
    """The ``pool.prefault`` fault site (tests only): a slow prefault (``delay`` per chunk)."""
    assert FAULTS is not None
    rule = FAULTS.at("pool.prefault")
    if rule is not None and rule.action == "delay":
        time.sleep(rule.seconds)
