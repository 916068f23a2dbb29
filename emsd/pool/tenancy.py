"""Tenant memory: each tenant's blocks live in a memfd of its own, so a client maps only its own.

Without a tenants file the pool is one memfd (``emsd.pool.region``) that
every client maps whole. With tenants, a client handed that memfd could read
or overwrite any tenant's blocks in place, so the daemon keeps one memfd per
tenant (group 1, 2, ... in the slab allocator; the default tenant is group 0,
the region's own memfd), each as large as the pool and sparse, and:

- The daemon's view of the pool stays one contiguous mapping, so every byte
  offset (index, ledger, grants, peer transfers, checksums) means what it
  meant: each slab page of the view is mapped (``MAP_FIXED``) from the memfd
  of the group that owns it, at the same offset.
- A client receives only its tenant's memfd at HELLO, and maps it whole at
  the same offsets (zero copy as before). Pages of other tenants are holes in
  its file: reading one gives zeros, writing one fills its own file only.
- A page moves between tenants only when it is free (no block, grant or pin
  on it: ``emsd.pool.slab`` calls ``bind``). The new owner's memfd is mapped
  into the view there, then the old owner's pages are punched out of its
  file (``FALLOC_FL_PUNCH_HOLE``): the memory goes back to the kernel, which
  zeroes it before anyone gets it again. A client of the old tenant that
  still maps its file sees zeros there from then on, never the new tenant's
  bytes: memory that held one tenant's blocks is never mapped by another's
  client while the first's mapping lives.

What a client can still do: fault in pages of its own memfd where its
tenant has no block (at most the pool's size per tenant file, its own
zeroes), and write garbage into its own tenant's blocks (a checksum catches
it with ``pool.checksum``). What it cannot do: see or change bytes of any
other tenant, or of the default tenant.

With warm restart each tenant's memfd is held by a keeper of its own
(``<state_dir>/emsd-<node>-t<digest>.keeper``, the digest of the tenant id);
``restore`` maps restored pages from their tenant's memfd and punches, from
every memfd, the pages it does not own and the free ones. RDMA cannot follow
pages remapped under a registered memory region, so with tenants peers use
TCP (``emsd.server``). A page bound to a tenant is faulted in on a thread of
its own (the kernel zeroes it first), and a client maps its sparse file in a
slab page at a time as its calls first use one (``ems.client``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from emsd.pool import keeper
from emsd.pool.region import Region, RegionError, keep, kept_memfd, new_memfd
from emsd.tenants import DEFAULT

log = logging.getLogger(__name__)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_POPULATE_WRITE = 23
MAP_SHARED_FIXED = mmap.MAP_SHARED | 0x10  # MAP_FIXED
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


class TenantMemory:
    """The per-tenant memfds of a pool whose view is ``region`` (see the module docstring).

    ``page_size``: the slab page, the unit pages move between tenants in; a
    multiple of the region's own page (4 KiB, or the hugepage size), else
    ``RegionError``. ``persist_dir``: where keepers hold the memfds (warm
    restart), or None.
    """

    def __init__(self, region: Region, page_size: int, name: str, persist_dir: Path | None) -> None:
        unit = region.page_unit()
        if page_size % unit:
            raise RegionError(f"pool.page_size: with tenants it must be a multiple of the pool's "
                              f"page ({unit >> 10} KiB, {region.kind}); got {page_size} bytes")
        self.region = region
        self.page_size = page_size
        self.name = name
        self.persist_dir = persist_dir
        self._base = region.address()
        self._fds: list[int] = [region.fd]  # group -> memfd; group 0 is the region's own
        self._groups: dict[str, int] = {DEFAULT: 0}  # tenant id -> group
        self.reused: dict[str, bool] = {}  # tenant id -> its memfd came back from a keeper
        self._faulting = ThreadPoolExecutor(1, thread_name_prefix="emsd-bind")  # bind's prefaults

    def open(self, tenant: str) -> int:
        """The group of ``tenant``'s memory, its memfd made (or taken back from its keeper)
        on the first call (the default tenant's is the region's own, group 0); raises
        ``RegionError`` if shared memory cannot be had."""
        group = self._groups.get(tenant)
        if group is not None:
            return group
        fd, reused = self._memfd(tenant)
        self._fds.append(fd)
        group = len(self._fds) - 1
        self._groups[tenant] = group
        self.reused[tenant] = reused
        return group

    def group(self, tenant: str) -> int:
        """The group of an opened tenant, 0 (the region's) for any other."""
        return self._groups.get(tenant, 0)

    def fd(self, tenant: str) -> int:
        """The memfd a client of ``tenant`` is handed."""
        return self._fds[self.group(tenant)]

    def bind(self, page: int, old: int, new: int) -> None:
        """Make slab page ``page`` (free, no chunk of it in use) group ``new``'s memory: map
        ``new``'s memfd there in the view, then punch the page out of ``old``'s memfd.

        Raises ``OSError`` if the mapping fails (the view still maps ``old`` there).
        """
        self._map(page, new)
        try:
            self._punch(old, page, 1)
        except OSError as exc:  # the old owner's file keeps the page's memory; nothing is exposed
            log.warning("tenant memory: %s (its memory stays held until restart)", exc)
        # Fault the page in ahead of its first blocks, on a thread of its own: the kernel
        # zeroes it at about 1 GB/s here (64 ms for 64 MiB), which the loop must not wait for.
        self._faulting.submit(_populate, self._base + page * self.page_size, self.page_size)

    def restore(self, page_group: np.ndarray, free: np.ndarray) -> None:
        """After a warm restart's re-index: map each page from the memfd of the group that
        owns it (``page_group[page]``), and punch from every memfd the pages it does not own
        and the ``free`` ones (bytes of blocks that did not come back, such as a tenant's
        kept by an emsd from before tenant memory in the pool's own file)."""
        for page in np.flatnonzero(page_group != 0).tolist():
            self._map(page, int(page_group[page]))
        for group in range(len(self._fds)):
            for start, count in _runs(np.flatnonzero((page_group != group) | free)):
                self._punch(group, start, count)

    def close(self) -> None:
        """Close the tenants' memfds (the region closes its own; keepers keep theirs), once the
        prefaults in flight are done (before the region is unmapped)."""
        self._faulting.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds[1:]:
            os.close(fd)
        del self._fds[1:]
        self._groups = {DEFAULT: 0}

    def _memfd(self, tenant: str) -> tuple[int, bool]:
        region = self.region
        hugepages = "on" if region.kind == "hugetlb" else "off"
        path = self._keeper_path(tenant) if self.persist_dir is not None else None
        if path is not None:
            fd, _kind, _why = kept_memfd(path, region.size, hugepages)
            if fd is not None:
                return fd, True
        try:
            fd = new_memfd(f"{self.name}-t", region.size, huge=region.kind == "hugetlb")
        except OSError as exc:
            raise RegionError(f"tenants: cannot make {tenant!r}'s memory ({region.kind}, "
                              f"{region.size} bytes): {exc.strerror or exc}") from None
        if path is not None:
            keep(path, fd)  # best effort, as for the pool: without a keeper a restart is cold
        return fd, False

    def _keeper_path(self, tenant: str) -> Path:
        assert self.persist_dir is not None
        return keeper_path(self.persist_dir, self.name, tenant)

    def _map(self, page: int, group: int) -> None:
        off = page * self.page_size
        got = _libc.mmap(self._base + off, self.page_size, mmap.PROT_READ | mmap.PROT_WRITE,
                         MAP_SHARED_FIXED, self._fds[group], off)
        if got in (None, MAP_FAILED) or got != self._base + off:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping page {page} of tenant memory: {os.strerror(err)}")

    def _punch(self, group: int, page: int, count: int) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        off, length = page * self.page_size, count * self.page_size
        length = min(length, self.region.size - off)
        if length > 0 and _libc.fallocate(self._fds[group], mode, off, length) != 0:
            err = ctypes.get_errno()  # the memory stays held, nothing is exposed: log-worthy only
            raise OSError(err, f"punching page {page} of group {group}: {os.strerror(err)}")


def _populate(address: int, length: int) -> None:
    """``MADV_POPULATE_WRITE`` (Linux 5.14) of a page of the view; best effort."""
    _libc.madvise(address, length, MADV_POPULATE_WRITE)


def keeper_path(persist_dir: Path, name: str, tenant: str) -> Path:
    """Where the keeper of ``tenant``'s memfd of pool ``name`` listens (a digest of the id:
    tenant ids may be longer than a file name)."""
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:16]
    return persist_dir / f"{name}-t{digest}.keeper"


def stop_tenant_keeper(persist_dir: Path, name: str, tenant: str) -> None:
    """Let the memfd kept for ``tenant`` go (a tenant no longer configured, or a restart that
    cannot use its bytes); nothing if no keeper holds one."""
    keeper.stop(keeper_path(persist_dir, name, tenant))


def _runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive page numbers in ascending ``pages``."""
    if pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.r_[0, breaks]
    ends = np.r_[breaks, pages.size]
    return [(int(pages[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
