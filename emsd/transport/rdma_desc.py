"""What a node advertises about its RDMA endpoint, and the QP address exchange.

A node that serves RDMA puts one map under ``NodeInfo.extra["rdma"]``
(``RdmaDescriptor.to_extra``)::

    {"v": 1, "dev": "mlx5_0", "port": 1, "gid": "fe80:0000:...", "lid": 0,
     "mtu": 4096, "sge": 30, "wr": 32768,
     "base": <virtual address of pool offset 0>,
     "chunks": [[length, rkey], ...]}          # contiguous from offset 0

Peers read it back with ``RdmaDescriptor.from_extra``, which checks every
field (types, ranges, chunk count and total) and raises ``DescriptorError``
naming the bad field: a malformed advertisement makes that peer TCP-only,
never an exception in the daemon. The per-connection queue-pair addresses
(``QpAddress``: qpn, psn, gid, lid) cannot be advertised once, since every
link has its own QP; they cross the authenticated TCP connection when a link
opens (``qp_to_wire``/``qp_from_wire``), with the same checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from emsd.transport.rdma_plan import MAX_CHUNKS, Chunk
from emsd.transport.verbs import PortInfo, QpAddress

VERSION = 1
EXTRA_KEY = "rdma"
_GID = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")
_DEVICE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_ADDR = (1 << 64) - 1
MAX_U32 = (1 << 32) - 1
MAX_U24 = (1 << 24) - 1


class DescriptorError(ValueError):
    """A malformed RDMA advertisement or QP address; the message names the field."""


@dataclass(frozen=True)
class RdmaDescriptor:
    port: PortInfo
    base: int  # virtual address of pool offset 0 on the advertising node
    chunks: tuple[tuple[int, int], ...]  # (length, rkey), contiguous from offset 0

    @property
    def size(self) -> int:
        return sum(length for length, _ in self.chunks)

    def remote_chunks(self) -> list[Chunk]:
        """The chunks as ``Chunk`` values with pool offsets, addresses and rkeys."""
        out, off = [], 0
        for length, rkey in self.chunks:
            out.append(Chunk(off, length, rkey, self.base + off))
            off += length
        return out

    def to_extra(self) -> dict[str, Any]:
        p = self.port
        return {"v": VERSION, "dev": p.device, "port": p.port, "gid": p.gid, "lid": p.lid, "mtu": p.mtu,
                "sge": p.max_sge, "wr": p.max_wr, "base": self.base,
                "chunks": [[length, rkey] for length, rkey in self.chunks]}

    @classmethod
    def from_extra(cls, extra: dict[str, Any], capacity: int) -> RdmaDescriptor | None:
        """The descriptor in a peer's ``NodeInfo.extra``; None if it advertises no RDMA.

        ``capacity`` is the peer's advertised pool size: the chunks must cover
        exactly that. Raises ``DescriptorError`` for a malformed descriptor.
        """
        raw = extra.get(EXTRA_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise DescriptorError(f"rdma: must be a map (got {type(raw).__name__})")
        if raw.get("v") != VERSION:
            raise DescriptorError(f"rdma.v: version {raw.get('v')!r} unsupported (this node: {VERSION})")
        dev = raw.get("dev")
        if not isinstance(dev, str) or not _DEVICE.match(dev):
            raise DescriptorError(f"rdma.dev: must be a device name (got {dev!r})")
        port = _int(raw, "port", 1, 255)
        gid = _gid(raw.get("gid"), "rdma.gid")
        lid = _int(raw, "lid", 0, 0xFFFF)
        mtu = _int(raw, "mtu", 256, 4096)
        sge = _int(raw, "sge", 1, 1 << 16)
        wr = _int(raw, "wr", 1, 1 << 24)
        base = _int(raw, "base", 0, MAX_ADDR)
        chunks = raw.get("chunks")
        if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_CHUNKS:
            raise DescriptorError(f"rdma.chunks: must be a list of 1..{MAX_CHUNKS} [length, rkey] pairs")
        out = []
        for i, item in enumerate(chunks):
            if (not isinstance(item, list | tuple) or len(item) != 2
                    or not all(type(v) is int for v in item)
                    or not 0 < item[0] <= MAX_ADDR or not 0 <= item[1] <= MAX_U32):
                raise DescriptorError(f"rdma.chunks[{i}]: must be [length > 0, rkey u32] (got {item!r})")
            out.append((int(item[0]), int(item[1])))
        total = sum(length for length, _ in out)
        if total != capacity:
            raise DescriptorError(f"rdma.chunks: cover {total} bytes, the pool has {capacity}")
        if base + total > MAX_ADDR:
            raise DescriptorError("rdma.base: the pool would run past the end of the address space")
        return cls(PortInfo(dev, port, gid, lid, mtu, sge, wr), base, tuple(out))


def qp_to_wire(qp: QpAddress) -> dict[str, Any]:
    return {"qpn": qp.qpn, "psn": qp.psn, "gid": qp.gid, "lid": qp.lid}


def qp_from_wire(raw: object) -> QpAddress:
    """A QP address from a control message; raises ``DescriptorError``."""
    if not isinstance(raw, dict):
        raise DescriptorError("qp: must be a map")
    return QpAddress(qpn=_int(raw, "qpn", 1, MAX_U24), psn=_int(raw, "psn", 0, MAX_U24),
                     gid=_gid(raw.get("gid"), "qp.gid"), lid=_int(raw, "lid", 0, 0xFFFF))


def _int(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = raw.get(key)
    if type(value) is not int or not low <= value <= high:
        raise DescriptorError(f"rdma.{key}: must be an integer in {low}..{high} (got {value!r})")
    return value


def _gid(value: object, key: str) -> str:
    if not isinstance(value, str) or not _GID.match(value):
        raise DescriptorError(f"{key}: must be 8 groups of 4 hex digits (got {value!r})")
    return value.lower()
