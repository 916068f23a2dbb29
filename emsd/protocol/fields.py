"""Header fields both protocols check the same way: bounded ints and namespace names.

Each returns the field's value or raises ``FrameError`` (INVALID_ARGUMENT) naming the
field and its bounds; ``emsd.protocol.local`` and ``emsd.protocol.peer`` call them.
"""

from __future__ import annotations

from typing import Any

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
