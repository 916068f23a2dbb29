"""An in-memory ``VerbsEngine`` for tests. It is NOT RDMA.

It implements the same small interface as ``emsd.transport.verbs.PyverbsEngine``
so that the transport's logic (planning, posting with a bounded number in
flight, completion handling, control messages, fallback) can run without a
device. Both "nodes" live in one process: a work request is carried out with
``ctypes.memmove`` between real addresses when it is polled, after checking,
like a NIC would, that every scatter element lies inside a region registered
under its lkey and the remote range inside one registered under its rkey.
Nothing here says anything about how the real engine behaves on hardware.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from emsd.transport.verbs import Completion, MemoryRegion, Opcode, PortInfo, QpAddress, RdmaError, WorkRequest


class FakeFabric:
    """The registered memory every fake engine on it can reach, by key."""

    def __init__(self) -> None:
        self.regions: dict[int, tuple[int, int]] = {}  # key -> (addr, length)
        self.qps: dict[int, FakeQp] = {}
        self._keys = itertools.count(0x100)
        self._qpns = itertools.count(1)

    def inside(self, key: int, addr: int, length: int) -> bool:
        region = self.regions.get(key)
        return region is not None and region[0] <= addr and addr + length <= region[0] + region[1]


@dataclass
class FakeQp:
    qpn: int
    peer: int = 0  # connected remote qpn; 0 = not connected
    queue: deque[tuple[Opcode, WorkRequest]] = field(default_factory=deque)
    destroyed: bool = False


class FakeEngine:
    """``VerbsEngine`` over a ``FakeFabric`` (see the module docstring: not RDMA)."""

    def __init__(self, fabric: FakeFabric, name: str = "fake0", max_sge: int = 4, max_wr: int = 8,
                 fail: Callable[[WorkRequest], bool] | None = None, lag: int = 0,
                 refuse_connect: bool = False) -> None:
        self.fabric = fabric
        self.name = name
        self.max_sge = max_sge
        self.max_wr = max_wr
        self.fail = fail  # a work request for which this returns True completes with an error
        self.lag = lag  # empty polls before queued work is carried out
        self.refuse_connect = refuse_connect
        self.gid = "fe80:0000:0000:0000:0000:0000:0000:%04x" % (abs(hash(name)) % 0xFFFF)
        self.posted = 0
        self.peak_inflight = 0
        self.keys: list[int] = []
        self._polls = 0

    def port_info(self) -> PortInfo:
        return PortInfo(self.name, 1, self.gid, 0, 4096, self.max_sge, self.max_wr)

    def register(self, offset: int, addr: int, length: int) -> MemoryRegion:
        key = next(self.fabric._keys)
        self.fabric.regions[key] = (addr, length)
        self.keys.append(key)
        return MemoryRegion(offset, addr, length, key, key)

    def create_qp(self, max_outstanding: int, max_sge: int) -> tuple[Any, QpAddress]:
        qp = FakeQp(next(self.fabric._qpns))
        self.fabric.qps[qp.qpn] = qp
        return qp, QpAddress(qp.qpn, 0, self.gid, 0)

    def connect_qp(self, qp: Any, remote: QpAddress) -> None:
        if self.refuse_connect or remote.qpn not in self.fabric.qps:
            raise RdmaError(f"fake: cannot reach qpn {remote.qpn}")
        qp.peer = remote.qpn

    def post(self, qp: Any, op: Opcode, wr: WorkRequest) -> None:
        if qp.destroyed or not qp.peer:
            raise RdmaError("fake: post on a QP that is not ready")
        if len(wr.sges) > self.max_sge or not wr.sges:
            raise RdmaError(f"fake: {len(wr.sges)} scatter elements (max {self.max_sge})")
        if len(qp.queue) >= self.max_wr:
            raise RdmaError(f"fake: send queue full ({self.max_wr})")
        qp.queue.append((op, wr))
        self.posted += 1
        self.peak_inflight = max(self.peak_inflight, len(qp.queue))

    def poll(self, qp: Any, limit: int) -> list[Completion]:
        if qp.destroyed:
            raise RdmaError("fake: poll on a destroyed QP")
        self._polls += 1
        if self.lag and self._polls % (self.lag + 1):
            return []
        out = []
        while qp.queue and len(out) < limit:
            op, wr = qp.queue.popleft()
            out.append(self._execute(op, wr))
        return out

    def _execute(self, op: Opcode, wr: WorkRequest) -> Completion:
        if self.fail is not None and self.fail(wr):
            return Completion(wr.wr_id, False, "fake injected error")
        if not self.fabric.inside(wr.rkey, wr.remote_addr, wr.length):
            return Completion(wr.wr_id, False, "remote access error")
        remote = wr.remote_addr
        for sge in wr.sges:
            if not self.fabric.inside(sge.lkey, sge.addr, sge.length):
                return Completion(wr.wr_id, False, "local protection error")
            if op is Opcode.READ:
                ctypes.memmove(sge.addr, remote, sge.length)
            else:
                ctypes.memmove(remote, sge.addr, sge.length)
            remote += sge.length
        return Completion(wr.wr_id, True, "success")

    def destroy_qp(self, qp: Any) -> None:
        qp.destroyed = True
        qp.queue.clear()
        self.fabric.qps.pop(qp.qpn, None)

    def close(self) -> None:
        for key in self.keys:
            self.fabric.regions.pop(key, None)
        self.keys.clear()
