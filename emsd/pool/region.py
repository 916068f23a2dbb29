"""The pool's shared-memory region: one sealed memfd, mapped once, handed to clients.

``Region.create(size, hugepages)`` decides which kind of memory backs the
pool and maps it:

- ``"hugetlb"``: a memfd created with ``MFD_HUGETLB``, its size rounded up to
  the default hugepage size (``Hugepagesize`` in /proc/meminfo). Used when
  ``hugepages`` is ``"on"``, or ``"auto"`` and enough hugepages are free.
- ``"shm"``: a plain memfd (shmem, 4 KiB pages). Used when ``hugepages`` is
  ``"off"``, or ``"auto"`` and hugepages are short or fail to map.

Either is sealed once sized (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``):
clients receive ``fd`` over the Unix socket (SCM_RIGHTS) and map it
read/write, and whatever they do with it, they cannot truncate it (which
would bring SIGBUS to the daemon and every other client and lose every
block), grow it, or add seals that would stop others mapping it. (They can
still write or punch holes in its pages: with ``pool.checksum`` a block whose
bytes changed is a miss.)

With ``persist_dir`` (warm restart) the memfd outlives the daemon in a keeper
process (``emsd.pool.keeper``) listening at ``<persist_dir>/<name>.keeper``:
a restarted daemon gets the very same memory back from it. ``reused`` says
whether it did (a kept memfd of the right kind and size) rather than start a
new one. One daemon per pool: ``create`` takes an exclusive ``flock`` on
``<persist_dir>/<name>.lock`` first, on a descriptor that clients never
receive, and a second daemon given the same files (the same ``node.id`` and
state directory) gets ``RegionBusy`` having touched nothing. A pool file
``<name>.pool`` left by an emsd from before the keeper is removed (its
blocks are not carried over: the first start after the upgrade is cold).

The decision (``_choose``) is apart from the mapping (``new_memfd``,
``_map``). ``reason`` says in one line why this kind was chosen, for the
startup log. ``prefault`` makes the kernel allocate every page up front, so
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
from emsd.pool import keeper

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
    reserved: int = 0  # promised to mappings made already, not yet faulted in (HugePages_Rsvd)

    @property
    def available(self) -> int:
        """Hugepages a new mapping can have: free ones not promised to another mapping."""
        return self.free - self.reserved


@dataclass
class Region:
    """A MAP_SHARED read/write mapping of a sealed memfd of ``size`` bytes."""

    kind: str  # "hugetlb" or "shm"
    reason: str  # why this kind, one line for the log
    size: int  # bytes mapped
    fd: int  # the memfd, to pass to clients with SCM_RIGHTS
    mm: mmap.mmap  # the whole region
    keeper: Path | None = None  # the keeper's socket, when the region outlives the process
    reused: bool = False  # the keeper's memfd was mapped again, with its bytes
    lock_fd: int = -1  # with a keeper: the descriptor holding the pool's flock (never given to clients)

    @classmethod
    def create(cls, size: int, hugepages: str, name: str = "emsd-pool",
               persist_dir: Path | None = None) -> Region:
        """Create (or, with ``persist_dir``, get back from the keeper) and map a region of at
        least ``size`` bytes.

        ``hugepages`` is ``"auto"``, ``"on"`` or ``"off"`` (see the module
        docstring). Raises ``RegionError`` if the mode is unknown, the size is
        not positive, ``"on"`` cannot get enough hugepages, or shared memory
        itself cannot be mapped; ``RegionBusy`` while another daemon holds the
        pool; ``UnsafePath`` for a lock file that is a symlink or not the daemon's.
        """
        if hugepages not in MODES:
            raise RegionError(f'pool.hugepages: must be "auto", "on" or "off" (got {hugepages!r})')
        if size <= 0:
            raise RegionError(f"pool.size: must be positive (got {size} bytes)")
        if persist_dir is None:
            return cls._new(size, hugepages, name)
        lock = _lock(persist_dir / f"{name}.lock")
        try:
            _remove_pool_file(persist_dir / f"{name}.pool")
            keeper_path = persist_dir / f"{name}.keeper"
            region, why = _kept(keeper_path, size, hugepages)
            kept = region is not None
            if region is None:
                region = cls._new(size, hugepages, name)
                kept, why_not = keep(keeper_path, region.fd)
                why += why_not
            region.reason += why
            region.keeper = keeper_path if kept else None
            region.lock_fd = lock
            return region
        except BaseException:
            os.close(lock)
            raise

    @classmethod
    def _new(cls, size: int, hugepages: str, name: str) -> Region:
        """A new sealed memfd region (see ``create``)."""
        huge_size, reason = _choose(size, hugepages, read_hugepage_info())
        if huge_size is not None:
            try:
                fd = new_memfd(name, huge_size, huge=True)
                return cls("hugetlb", reason, huge_size, fd, _map(fd, huge_size))
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
            fd = new_memfd(name, shm_size, huge=False)
            return cls("shm", reason, shm_size, fd, _map(fd, shm_size))
        except OSError as exc:
            raise RegionError(
                f"pool.size: cannot map {shm_size} bytes of shared memory: {exc.strerror or exc}"
            ) from None

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

        step = self.page_unit()
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

    def page_unit(self) -> int:
        """The size of the pages backing the region (4 KiB, or the hugepage size)."""
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
        reserved=fields.get("HugePages_Rsvd", 0),
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
    free = info.available  # a mapping's reservation is taken when it is made, not when touched
    if free < needed:
        if mode == "on":
            raise RegionError(
                f"pool.hugepages=on: {free} of {needed} free hugepages of {mib} MiB needed; "
                f"reserve them with `echo {info.total + needed - free} > {NR_HUGEPAGES}` "
                f'or set pool.hugepages = "auto"'
            )
        return None, (f"hugepages=auto: {free} of {needed} free hugepages of {mib} MiB "
                      "needed; using shared memory")
    return huge_size, f"hugepages={mode}: {needed} hugepages of {mib} MiB ({free} were free)"


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def new_memfd(name: str, size: int, huge: bool) -> int:
    """A new memfd of ``size`` bytes, sealed against any change of size and any further seal;
    raises OSError."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, size: int) -> mmap.mmap:
    """``fd``'s shared read/write mapping; closes ``fd`` and raises OSError if it cannot."""
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def _lock(path: Path) -> int:
    """An exclusive ``flock`` on ``path`` (created), held by the returned descriptor; raises
    ``RegionBusy`` while another process holds it."""
    lock = open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise RegionBusy(f"another emsd holds {path} (a second daemon with the same node.id and "
                         "pool.state_dir?); its pool was left as it is") from None
    return lock


def _remove_pool_file(path: Path) -> None:
    """Remove the pool file an emsd from before the keeper left (``RegionBusy`` if one still runs)."""
    try:
        fd = open_own(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegionBusy(f"an older emsd still holds {path}; it was left as it is") from None
        path.unlink()
    finally:
        os.close(fd)


def _kept(path: Path, size: int, hugepages: str) -> tuple[Region | None, str]:
    """The region the keeper at ``path`` holds, mapped again, if it has one that suits ``size``
    and ``hugepages``; else (None, why not, for the log)."""
    fd, kind, why = kept_memfd(path, size, hugepages)
    if fd is None:
        return None, why
    st = os.fstat(fd)
    try:
        mm = _map(fd, st.st_size)
    except OSError as exc:
        return None, f"; the kept pool cannot be mapped ({exc.strerror or exc}): a new pool"
    return Region(kind, f"kept by {path.name} since an earlier start", st.st_size, fd, mm,
                  reused=True), ""


def kept_memfd(path: Path, size: int, hugepages: str) -> tuple[int | None, str, str]:
    """(the memfd the keeper at ``path`` holds, its kind, "") if it holds a sealed one that
    suits ``size`` and ``hugepages``; else (None, "", why not for the log, "" if none is kept)."""
    try:
        fd = keeper.fetch(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return None, "", ""
    except (OSError, keeper.KeeperError) as exc:
        return None, "", f"; the keeper did not answer ({exc}): a new pool"
    if fd is None:
        return None, "", ""
    st = os.fstat(fd)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    info = read_hugepage_info()
    huge = info is not None and st.st_blksize == info.page_size != mmap.PAGESIZE
    kind, unit = ("hugetlb", info.page_size) if huge and info is not None else ("shm", mmap.PAGESIZE)
    suits = (st.st_size == _round_up(size, unit) and seals & SEALS == SEALS
             and hugepages != ("off" if huge else "on"))
    if not suits:
        os.close(fd)
        return None, "", (f"; the kept pool ({kind}, {st.st_size} bytes) does not suit pool.size and "
                          f"pool.hugepages now: a new pool")
    return fd, kind, ""


def keep(path: Path, fd: int) -> tuple[bool, str]:
    """Hand ``fd`` to the keeper at ``path``, starting one if none listens; (whether it is
    kept, "" or why warm restart is off, for the log)."""
    try:
        keeper.put(path, fd)
        return True, ""
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    except (OSError, keeper.KeeperError) as exc:
        return False, f"; warm restart off: the keeper at {path} did not take the pool ({exc})"
    try:
        keeper.spawn(path, fd)
    except OSError as exc:
        return False, f"; warm restart off: cannot start a keeper at {path} ({exc.strerror or exc})"
    return True, ""


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
