"""What the protocols check and read the same way: bounded ints, namespace names, payloads.

Each check returns the field's value or raises ``FrameError`` (INVALID_ARGUMENT) naming
the field and its bounds; ``emsd.protocol.local``, ``peer`` and ``rdma`` call them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from emsd.transport.frames import FrameError


def int_field(header: dict[str, Any], field: str, least: int, most: int, default: int | None = None) -> int:
    """Header field ``field``: an int in ``least..most`` (``default`` when absent, if given)."""
    value = header.get(field, default)
    if type(value) is not int or not least <= value <= most:
        raise FrameError(f"{field} must be an int in {least}..{most} (got {value!r})")
    return value


def name_field(header: dict[str, Any], field: str, most: int) -> str:
    """Header field ``field``: a namespace name of 1..``most`` characters."""
    name = header.get(field)
    if not isinstance(name, str) or not 0 < len(name) <= most:
        raise FrameError(f"{field} must be a namespace name of 1..{most} characters")
    return name


def exact_size(raw: bytes, size: int, what: str) -> None:
    """``raw`` must be ``size`` bytes (``what`` names it in the error)."""
    if len(raw) != size:
        raise FrameError(f"{what}: expected {size} bytes, got {len(raw)}")


def u64s(raw: bytes, n: int, offset: int = 0) -> np.ndarray:
    """``n`` u64 LE at ``offset`` of ``raw`` as uint64 (a copy: the caller may keep it)."""
    return np.frombuffer(raw, dtype="<u8", count=n, offset=offset).astype(np.uint64)
