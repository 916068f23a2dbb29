"""Busy polling after answers (daemon) and while waiting for one (SDK): settings and behaviour."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from ems.client import BUSY_POLL_DEFAULT_US, BUSY_POLL_ENV, busy_poll_budget
from emsd.config import ConfigError, config_from_dict
from emsd.transport.busypoll import BusyPoll
from emsd.transport.pollwindow import FLOOR


async def test_the_poll_ends_when_any_client_connection_has_a_request() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        busy = BusyPoll(5.0)  # long: only a request can end it
        busy.add(a.fileno())
        busy.add(c.fileno())
        threading.Timer(0.02, d.send, (b"another client's request",)).start()
        busy.after_answer()  # a was answered; c's client sends next
        busy.after_answer()  # twice in one turn of the loop: one poll
        await asyncio.sleep(0)  # the loop runs the poll
        assert (busy.spins, busy.idle) == (1, 0)
    finally:
        for s in (a, b, c, d):
            s.close()


async def test_the_poll_gives_up_after_its_budget_and_a_removed_connection_is_not_polled() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        busy = BusyPoll(0.001)
        busy.add(a.fileno())
        busy.after_answer()
        await asyncio.sleep(0)
        assert (busy.spins, busy.idle) == (0, 1)
        busy.add(c.fileno())
        busy.remove(a.fileno())
        b.send(b"from a connection that is closing")  # not polled any more
        busy.after_answer()
        await asyncio.sleep(0)
        assert (busy.spins, busy.idle) == (0, 2)
        d.send(b"request")
        busy.after_answer()
        await asyncio.sleep(0)
        assert (busy.spins, busy.idle) == (1, 2)
    finally:
        for s in (a, b, c, d):
            s.close()


async def test_the_window_shrinks_while_requests_come_late_and_grows_when_they_come_soon() -> None:
    a, b = socket.socketpair()
    try:
        busy = BusyPoll(0.001)
        busy.add(a.fileno())
        shrinks = 0
        while busy.window > 0:  # every request comes 3 ms after an idle poll of at most 1 ms
            busy.after_answer()
            await asyncio.sleep(0)
            time.sleep(0.003)
            busy.heard()
            shrinks += 1
            assert shrinks <= 8  # halving from 1 ms to below 10 us
        busy.after_answer()  # no window: one look, then sleep
        await asyncio.sleep(0)
        busy.heard()  # the next request came at once: polling would have caught it
        assert busy.window == FLOOR
        b.send(b"a request already waiting")
        busy.after_answer()
        await asyncio.sleep(0)
        assert busy.window == 2 * FLOOR and busy.spins == 1
    finally:
        for s in (a, b):
            s.close()


async def test_no_budget_or_no_connection_no_poll() -> None:
    busy = BusyPoll(0.0)
    busy.add(0)
    busy.after_answer()
    await asyncio.sleep(0)
    assert (busy.spins, busy.idle) == (0, 0)
    empty = BusyPoll(1.0)
    empty.after_answer()
    await asyncio.sleep(0)
    assert (empty.spins, empty.idle) == (0, 0)


@pytest.mark.parametrize(("value", "us"), [(None, BUSY_POLL_DEFAULT_US), ("0", 0), ("200", 200),
                                           ("10000", 10_000), ("10001", BUSY_POLL_DEFAULT_US),
                                           ("-5", BUSY_POLL_DEFAULT_US), ("fast", BUSY_POLL_DEFAULT_US)])
def test_the_sdk_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                   us: int) -> None:
    if value is None:
        monkeypatch.delenv(BUSY_POLL_ENV, raising=False)
    else:
        monkeypatch.setenv(BUSY_POLL_ENV, value)
    assert busy_poll_budget() == us / 1e6


def test_the_daemon_budget_is_read_and_checked() -> None:
    assert config_from_dict({}).node.busy_poll == 50
    assert config_from_dict({"node": {"busy_poll": 0}}).node.busy_poll == 0
    for bad in (-1, 10_001, 1.5, True, "50"):
        with pytest.raises(ConfigError, match="node.busy_poll"):
            config_from_dict({"node": {"busy_poll": bad}})
