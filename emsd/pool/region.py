"""The pool's shared-memory region: one memfd, mapped once, handed to clients.

``Region.create(size, hugepages)`` decides which kind of memory backs the
pool and maps it:

- ``"hugetlb"``: a memfd created with ``MFD_HUGETLB``, its size rounded up to
  the default hugepage size (``Hugepagesize`` in /proc/meminfo). Used when
  ``hugepages`` is ``"on"``, or ``"auto"`` and enough hugepages are free.
- ``"shm"``: a plain memfd (shmem, 4 KiB pages). Used when ``hugepages`` is
  ``"off"``, or ``"auto"`` and hugepages are short or fail to map.

With ``persist_dir`` (warm restart), the region is a file instead of a
memfd, so that it outlives the process and a restarted daemon maps the very
same bytes again: ``<persist_dir>/<name>.pool`` for shared memory (put
``persist_dir`` on tmpfs, such as /dev/shm), or a file on the first
hugetlbfs mount for hugepages. ``reused`` says whether an existing file of
the right size was mapped (its bytes kept) rather than a new one. Without
a hugetlbfs mount, hugepages stay a memfd and the reason says that warm
restart is off.

One daemon per pool file: ``_map_file`` takes an exclusive ``flock`` on the
file before it looks at it or resizes it, on a descriptor of its own that
clients never receive (they map the file through ``fd``, and a mapping keeps
its open file's lock alive: a lock on ``fd`` would outlive a killed daemon
for as long as its clients run, and block its warm restart). A second
daemon given the same file (the same ``node.id`` and state directory) gets
``RegionBusy`` and has touched nothing: resizing the file would have zeroed
the live daemon's pool under it.

The decision (``_choose``) is apart from the mapping (``_map_memfd``,
``_map_file``).

``reason`` says in one line why this kind was chosen, for the startup log.
Clients receive ``fd`` over the Unix socket (SCM_RIGHTS) and map it
themselves. ``prefault`` makes the kernel allocate every page up front, so
that the first save does not pay for page faults and a short host fails at
start, not mid-service.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from emsd.files import open_own

MODES = ("auto", "on", "off")
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by the mmap module of 3.11
MEMINFO = Path("/proc/meminfo")
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class RegionError(Exception):
    """The region cannot be created; ``str()`` is one line for the operator."""


class RegionBusy(RegionError):
    """Another live process holds the pool file (``_map_file``)."""


@dataclass(frozen=True)
class HugepageInfo:
    """The host's default hugepages, from /proc/meminfo."""

    page_size: int  # bytes
    total: int
    free: int


@dataclass
class Region:
    """A MAP_SHARED read/write mapping of a memfd of ``size`` bytes."""

    kind: str  # "hugetlb" or "shm"
    reason: str  # why this kind, one line for the log
    size: int  # bytes mapped
    fd: int  # the memfd or file, to pass to clients with SCM_RIGHTS
    mm: mmap.mmap  # the whole region
    path: Path | None = None  # the file, when the region outlives the process
    reused: bool = False  # an existing file was mapped with its bytes
    lock_fd: int = -1  # with a file: the descriptor holding its flock (never given to clients)

    @classmethod
    def create(cls, size: int, hugepages: str, name: str = "emsd-pool",
               persist_dir: Path | None = None) -> Region:
        """Create and map a region of at least ``size`` bytes.

        ``hugepages`` is ``"auto"``, ``"on"`` or ``"off"`` (see the module
        docstring). Raises ``RegionError`` if the mode is unknown, the size is
        not positive, ``"on"`` cannot get enough hugepages, or shared memory
        itself cannot be mapped.
        """
        if hugepages not in MODES:
            raise RegionError(f'pool.hugepages: must be "auto", "on" or "off" (got {hugepages!r})')
        if size <= 0:
            raise RegionError(f"pool.size: must be positive (got {size} bytes)")
        huge_size, reason = _choose(size, hugepages, read_hugepage_info())
        if huge_size is not None:
            try:
                mount = hugetlbfs_mount() if persist_dir is not None else None
                if mount is not None:
                    path = mount / f"{name}.pool"
                    fd, mm, reused, lock = _map_file(path, huge_size)
                    return cls("hugetlb", reason, huge_size, fd, mm, path, reused, lock)
                if persist_dir is not None:
                    reason += ("; warm restart off: no hugetlbfs mount "
                               "(mount -t hugetlbfs none /dev/hugepages)")
                fd, mm = _map_memfd(name, huge_size, huge=True)
                return cls("hugetlb", reason, huge_size, fd, mm)
            except OSError as exc:
                if hugepages == "on":
                    raise RegionError(
                        f"pool.hugepages=on: cannot map {huge_size} bytes of hugepages: "
                        f"{exc.strerror or exc}"
                    ) from None
                reason = (
                    f"hugepages=auto: mapping hugepages failed ({exc.strerror or exc}); "
                    "using shared memory"
                )
        shm_size = _round_up(size, mmap.PAGESIZE)
        try:
            if persist_dir is not None:
                path = persist_dir / f"{name}.pool"
                fd, mm, reused, lock = _map_file(path, shm_size)
                return cls("shm", reason, shm_size, fd, mm, path, reused, lock)
            fd, mm = _map_memfd(name, shm_size, huge=False)
        except OSError as exc:
            raise RegionError(
                f"pool.size: cannot map {shm_size} bytes of shared memory: {exc.strerror or exc}"
            ) from None
        return cls("shm", reason, shm_size, fd, mm)

    def prefault(self) -> str:
        """Allocate every page now; returns the method used.

        ``"MADV_POPULATE_WRITE"`` when the kernel has it, else ``"touch"``
        (one write per page, keeping the byte's value).
        """
        try:
            self.mm.madvise(MADV_POPULATE_WRITE, 0, self.size)
            return "MADV_POPULATE_WRITE"
        except OSError:
            pass
        import numpy as np

        step = self._page_size()
        view = np.frombuffer(self.mm, dtype=np.uint8)
        try:
            view[::step] |= 0  # a write faults the page in; |= 0 keeps the data
        finally:
            del view  # release the buffer export so that close() can unmap
        return "touch"

    def address(self) -> int:
        """Virtual address of the mapping in this process."""
        anchor = ctypes.c_char.from_buffer(self.mm)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor  # release the buffer export so that close() can unmap

    def close(self) -> None:
        """Unmap the region and close the memfd (idempotent)."""
        if not self.mm.closed:
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def _page_size(self) -> int:
        if self.kind == "hugetlb":
            info = read_hugepage_info()
            return info.page_size if info else mmap.PAGESIZE
        return mmap.PAGESIZE


def read_hugepage_info(meminfo: Path = MEMINFO) -> HugepageInfo | None:
    """Default hugepage size and counts, or None if the kernel has no hugetlb."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0])
    if "Hugepagesize" not in fields:
        return None
    return HugepageInfo(
        page_size=fields["Hugepagesize"] << 10,  # /proc/meminfo counts in kB
        total=fields.get("HugePages_Total", 0),
        free=fields.get("HugePages_Free", 0),
    )


def _choose(size: int, mode: str, info: HugepageInfo | None) -> tuple[int | None, str]:
    """(hugetlb size to map or None for shm, reason); raises for an unmet ``"on"``."""
    if mode == "off":
        return None, "hugepages=off: using shared memory"
    if info is None:
        if mode == "on":
            raise RegionError("pool.hugepages=on: this kernel has no hugetlb support "
                              "(no Hugepagesize in /proc/meminfo)")
        return None, "hugepages=auto: no hugetlb support in this kernel; using shared memory"
    huge_size = _round_up(size, info.page_size)
    needed = huge_size // info.page_size
    mib = info.page_size >> 20
    if info.free < needed:
        if mode == "on":
            raise RegionError(
                f"pool.hugepages=on: {info.free} of {needed} free hugepages of {mib} MiB needed; "
                f"reserve them with `echo {info.total + needed - info.free} > {NR_HUGEPAGES}` "
                f'or set pool.hugepages = "auto"'
            )
        return None, (f"hugepages=auto: {info.free} of {needed} free hugepages of {mib} MiB "
                      "needed; using shared memory")
    return huge_size, f"hugepages={mode}: {needed} hugepages of {mib} MiB ({info.free} were free)"


def _map_memfd(name: str, size: int, huge: bool) -> tuple[int, mmap.mmap]:
    """A new memfd of ``size`` bytes and its shared mapping; raises OSError."""
    flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def _map_file(path: Path, size: int) -> tuple[int, mmap.mmap, bool, int]:
    """Map ``path`` shared, ``size`` bytes; (fd, map, reused, lock fd). An existing file
    of exactly ``size`` bytes keeps its bytes; any other is emptied first. Raises
    ``RegionBusy`` (before anything is changed) while another process holds the file,
    ``UnsafePath`` if it is a symlink or not the daemon's own (``emsd.files``), ``OSError``
    otherwise."""
    lock = open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegionBusy(f"another emsd holds {path} (a second daemon with the same node.id and "
                             "pool.state_dir?); it was left as it is") from None
        fd, mm, reused = _map_locked(path, size)
    except BaseException:
        os.close(lock)
        raise
    return fd, mm, reused, lock


def _map_locked(path: Path, size: int) -> tuple[int, mmap.mmap, bool]:
    """``_map_file``'s mapping, the lock held."""
    fd = open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        reused = os.fstat(fd).st_size == size
        if not reused:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm, reused


def hugetlbfs_mount(mounts: Path = Path("/proc/mounts")) -> Path | None:
    """The first writable hugetlbfs mount point, or None."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "hugetlbfs" and os.access(parts[1], os.W_OK):
            return Path(parts[1])
    return None


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
