"""The tests' port picker: outside the ephemeral range, never the same port twice, never a bound one."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ports  # noqa: E402


def test_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < ports._ephemeral_start() for p in got)


def test_a_port_held_by_a_listener_is_skipped() -> None:
    held = ports._next
    with socket.socket() as s:
        s.bind(("127.0.0.1", held))
        s.listen()
        got = ports.free_port()
    assert got != held
