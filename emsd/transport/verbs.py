"""The verbs engine: the narrow seam between the RDMA transport and the NIC.

``VerbsEngine`` is the small interface ``emsd.transport.rdma`` needs of an
RDMA device: register memory, make reliable-connected (RC) queue pairs,
connect them to a remote QP, post one-sided READ/WRITE work requests and
poll completions without blocking. ``PyverbsEngine`` implements it with
pyverbs (rdma-core's Python binding, Debian's ``python3-pyverbs``); the
unit tests implement it with an in-memory fake that copies bytes between
buffers, which exercises the transport's logic and is not RDMA.

pyverbs is optional and imported lazily (``load_pyverbs``): PyPI's pyverbs
does not build on common machines, so the daemon looks for Debian's copy in
``/usr/lib/python3/dist-packages`` and imports only the ``pyverbs`` package
from there (the directory is never put on ``sys.path``, so nothing else in it
can shadow the daemon's own dependencies).

``PyverbsEngine`` has not run against an RDMA device in this project's CI
(the CI machines have none); see docs/transports.md for how to run the
integration test on a machine that has one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import ipaddress
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

DEBIAN_DIST = Path("/usr/lib/python3/dist-packages")


class RdmaError(Exception):
    """Anything the verbs layer refused or reported as failed."""


class Opcode(Enum):
    READ = "read"  # remote -> local (a load)
    WRITE = "write"  # local -> remote (a save)


@dataclass(frozen=True)
class Sge:
    """One scatter/gather element: local bytes ``[addr, addr + length)`` under ``lkey``."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA READ or WRITE: the local scatter list against one contiguous remote range."""

    wr_id: int
    sges: tuple[Sge, ...]
    remote_addr: int
    rkey: int

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


@dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    status: str  # "success" or the verbs status that failed the request


@dataclass(frozen=True)
class MemoryRegion:
    """A registered range of the pool: ``addr`` is its virtual address, ``offset`` its place in the pool."""

    offset: int
    addr: int
    length: int
    lkey: int
    rkey: int


@dataclass(frozen=True)
class PortInfo:
    """What a peer needs to reach this device: advertised through membership."""

    device: str
    port: int
    gid: str  # "xxxx:xxxx:...:xxxx", 8 groups
    lid: int
    mtu: int  # path MTU in bytes (256..4096)
    max_sge: int
    max_wr: int


@dataclass(frozen=True)
class GidEntry:
    """One row of a port's GID table, as ``choose_gid_index`` sees it."""

    index: int
    gid: str  # "xxxx:xxxx:...:xxxx", 8 groups
    roce_v2: bool  # RoCE v2 (UDP/IP encapsulated); False: InfiniBand or RoCE v1


def choose_gid_index(entries: Sequence[GidEntry], ethernet: bool) -> int:
    """The GID index this port's queue pairs should use (``cluster.rdma_gid_index = "auto"``).

    InfiniBand: the lowest index with a non-zero GID (the port GID). Ethernet
    (RoCE): the best non-zero entry, the lowest index among equals: RoCE v2
    with an IPv4-mapped address (``::ffff:a.b.c.d``: routed like the host's
    IPv4 traffic), then RoCE v2 with a global IPv6 address, then RoCE v2
    link-local, then RoCE v1. A GID that is not an IPv6 address in either
    notation is skipped. Raises ``RdmaError`` when no entry is usable.
    """
    ranked = [(rank, e.index) for e in entries if (rank := _gid_rank(e, ethernet)) is not None]
    if not ranked:
        raise RdmaError("the port has no usable GID (set cluster.rdma_gid_index, see show_gids)")
    return min(ranked)[1]


def _gid_rank(e: GidEntry, ethernet: bool) -> int | None:
    """0 = best; None: a zero or unreadable GID. On InfiniBand every GID ranks alike."""
    try:
        addr = ipaddress.IPv6Address(e.gid)
    except ValueError:
        return None
    if int(addr) == 0:
        return None
    if not ethernet:
        return 0
    if not e.roce_v2:
        return 3
    if addr.ipv4_mapped is not None:
        return 0
    return 2 if addr.is_link_local else 1


@dataclass(frozen=True)
class QpAddress:
    """One RC QP's address, exchanged over the authenticated TCP connection when a link opens."""

    qpn: int
    psn: int
    gid: str
    lid: int


class VerbsEngine(Protocol):
    """What the RDMA transport needs of a device. Every method raises ``RdmaError`` on failure."""

    def port_info(self) -> PortInfo: ...

    def register(self, offset: int, addr: int, length: int) -> MemoryRegion:
        """Register ``[addr, addr + length)`` (pool offset ``offset``) for local and remote read/write."""

    def create_qp(self, max_outstanding: int, max_sge: int) -> tuple[Any, QpAddress]:
        """A new RC QP (opaque handle) and its address."""

    def connect_qp(self, qp: Any, remote: QpAddress) -> None:
        """Move ``qp`` to ready-to-send against ``remote``."""

    def post(self, qp: Any, op: Opcode, wr: WorkRequest) -> None:
        """Post one signaled work request; never blocks."""

    def poll(self, qp: Any, limit: int) -> list[Completion]:
        """Up to ``limit`` completions of ``qp``'s work requests; [] if none yet. Never blocks."""

    def destroy_qp(self, qp: Any) -> None:
        """Tear ``qp`` down; once this returns, no work request of it touches memory any more."""

    def close(self) -> None: ...


# -- loading pyverbs -----------------------------------------------------------

_pyverbs: ModuleType | None = None
_load_lock = threading.Lock()


def load_pyverbs(dist: Path = DEBIAN_DIST) -> ModuleType:
    """The ``pyverbs`` package (installed in the environment, or Debian's); raises ``RdmaError``."""
    global _pyverbs
    with _load_lock:
        if _pyverbs is not None:
            return _pyverbs
        if "pyverbs" in sys.modules:
            _pyverbs = sys.modules["pyverbs"]
            return _pyverbs
        spec = importlib.util.find_spec("pyverbs")
        if spec is None:
            spec = importlib.machinery.PathFinder.find_spec("pyverbs", [str(dist)])
        if spec is None or spec.loader is None:
            raise RdmaError("pyverbs is not installed (Debian: apt-get install python3-pyverbs)")
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module  # its submodules import "pyverbs.x" by name
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules["pyverbs"]
            raise RdmaError(f"pyverbs does not import: {exc}") from None
        _pyverbs = module
        return module


def list_devices() -> list[str]:
    """Names of the RDMA devices present; [] when there are none (or no kernel support).

    ``get_device_list`` raises rather than returning [] on machines without
    the RDMA kernel modules; both mean "no device" here.
    """
    load_pyverbs()
    import pyverbs.device as device

    try:
        devices = device.get_device_list()
    except Exception:  # PyverbsRDMAError: no verbs devices / no uverbs support
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


def probe() -> tuple[list[str], str]:
    """(devices, why there are none): never raises."""
    try:
        devices = list_devices()
    except RdmaError as exc:
        return [], str(exc)
    return devices, "" if devices else "no RDMA device (pyverbs.device.get_device_list() found none)"


# -- the real engine -------------------------------------------------------------

_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


class PyverbsEngine:  # pragma: no cover - needs an RDMA device; tests/integration/test_rdma.py
    """``VerbsEngine`` on one device port with pyverbs: one PD, one CQ per QP.

    ``gid_index``: the port's GID table entry to use; None picks one
    (``choose_gid_index``)."""

    def __init__(self, device: str, port: int = 1, gid_index: int | None = None) -> None:
        load_pyverbs()
        from pyverbs.device import Context
        from pyverbs.pd import PD

        try:
            self.ctx = Context(name=device)
            self.pd = PD(self.ctx)
            attr = self.ctx.query_device()
            pattr = self.ctx.query_port(port)
            if gid_index is None:
                gid_index = choose_gid_index(self._gid_table(port), ethernet=self._ethernet(pattr))
            gid = self.ctx.query_gid(port, gid_index)
        except Exception as exc:
            raise RdmaError(f"cannot open RDMA device {device!r} port {port}: {exc}") from None
        self.device, self.port, self.gid_index = device, port, gid_index  # logged at start
        self._info = PortInfo(device=device, port=port, gid=str(gid), lid=int(pattr.lid),
                              mtu=_MTU_BYTES.get(int(pattr.active_mtu), 1024),
                              max_sge=int(attr.max_sge), max_wr=int(attr.max_qp_wr))
        self._mrs: list[Any] = []
        self._active_mtu = int(pattr.active_mtu)
        self._psn = 0

    def port_info(self) -> PortInfo:
        return self._info

    def _gid_table(self, port: int) -> list[GidEntry]:
        import pyverbs.enums as e

        rows = self.ctx.query_gid_table(4096)  # every port's valid entries (ibv_query_gid_table)
        return [GidEntry(int(r.gid_index), str(r.gid_str), int(r.gid_type) == e.IBV_GID_TYPE_ROCE_V2)
                for r in rows if int(r.port_num) == port]

    @staticmethod
    def _ethernet(pattr: Any) -> bool:
        import pyverbs.enums as e

        return int(pattr.link_layer) == e.IBV_LINK_LAYER_ETHERNET

    def register(self, offset: int, addr: int, length: int) -> MemoryRegion:
        import pyverbs.enums as e
        from pyverbs.mr import MR

        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE)
        try:
            mr = MR(self.pd, length, access, address=addr)
        except Exception as exc:
            raise RdmaError(f"cannot register {length} bytes of the pool at offset {offset}: {exc}") from None
        self._mrs.append(mr)
        return MemoryRegion(offset=offset, addr=addr, length=length, lkey=int(mr.lkey), rkey=int(mr.rkey))

    def create_qp(self, max_outstanding: int, max_sge: int) -> tuple[Any, QpAddress]:
        import os

        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        try:
            cq = CQ(self.ctx, max_outstanding, None, None, 0)
            cap = QPCap(max_send_wr=max_outstanding, max_recv_wr=1, max_send_sge=max_sge, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
            attr = QPAttr(port_num=self.port)
            attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                                    | e.IBV_ACCESS_REMOTE_WRITE)
            qp = QP(self.pd, init, attr)
        except Exception as exc:
            raise RdmaError(f"cannot create a queue pair: {exc}") from None
        psn = int.from_bytes(os.urandom(3), "little")
        return (qp, cq, psn), QpAddress(qpn=int(qp.qp_num), psn=psn, gid=self._info.gid, lid=self._info.lid)

    def connect_qp(self, qp: Any, remote: QpAddress) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        handle, _, psn = qp
        try:
            gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid_index)
            ah = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=remote.lid)
            attr = QPAttr(port_num=self.port)
            attr.path_mtu = self._active_mtu
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.sq_psn = psn
            attr.max_rd_atomic = 16
            attr.max_dest_rd_atomic = 16
            attr.min_rnr_timer = 12
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.ah_attr = ah
            handle.to_rts(attr)
        except Exception as exc:
            raise RdmaError(f"cannot connect the QP to {remote.gid} qpn {remote.qpn}: {exc}") from None

    def post(self, qp: Any, op: Opcode, wr: WorkRequest) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        handle = qp[0]
        opcode = e.IBV_WR_RDMA_READ if op is Opcode.READ else e.IBV_WR_RDMA_WRITE
        try:
            sges = [SGE(s.addr, s.length, s.lkey) for s in wr.sges]
            send = SendWR(wr_id=wr.wr_id, opcode=opcode, num_sge=len(sges), sg=sges,
                          send_flags=e.IBV_SEND_SIGNALED)
            send.set_wr_rdma(wr.rkey, wr.remote_addr)
            handle.post_send(send)
        except Exception as exc:
            raise RdmaError(f"post_send failed: {exc}") from None

    def poll(self, qp: Any, limit: int) -> list[Completion]:
        import pyverbs.enums as e

        try:
            n, wcs = qp[1].poll(limit)
        except Exception as exc:
            raise RdmaError(f"poll_cq failed: {exc}") from None
        return [Completion(int(wc.wr_id), wc.status == e.IBV_WC_SUCCESS,
                           "success" if wc.status == e.IBV_WC_SUCCESS else f"wc status {int(wc.status)}")
                for wc in wcs[:n]]

    def destroy_qp(self, qp: Any) -> None:
        handle, cq, _ = qp
        for obj in (handle, cq):
            try:
                obj.close()
            except Exception:  # already torn down with the context
                pass

    def close(self) -> None:
        for mr in self._mrs:
            mr.close()
        self._mrs.clear()
        self.pd.close()
        self.ctx.close()
