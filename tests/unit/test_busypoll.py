"""Busy polling after answers (daemon) and while waiting for one (SDK): settings and behaviour."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from ems.client import BUSY_POLL_DEFAULT_US, BUSY_POLL_ENV, busy_poll_budget
from emsd.config import ConfigError, config_from_dict
from emsd.pool.keys import KeyBatch
from emsd.protocol.local import PinRequest, ReleaseRequest
from emsd.service import Session
from emsd.transport.busypoll import CROWDED_SHARE, BusyPoll
from emsd.transport.frames import PROTOCOL_VERSION, Op, encode
from emsd.transport.pollwindow import FLOOR
from emsd.transport.runqueue import LOADAVG, MARGIN, RunQueue, parse_running
from emsd.transport.unix import ControlProtocol
from tests.messages import Message, request


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


def test_an_answer_from_another_node_ends_its_poll_and_the_socket_leaves_the_set_after() -> None:
    a, b = socket.socketpair()  # a: this node's end of a peer link, b: the peer's
    c, d = socket.socketpair()  # c: a client connection
    try:
        busy = BusyPoll(5.0, crowded=lambda now: False)  # long: only the answer can end it
        busy.add(c.fileno())
        with busy.awaiting(a.fileno()) as poll:
            threading.Timer(0.02, b.send, (b"the peer's answer",)).start()
            poll()
            assert (busy.spins, busy.idle) == (1, 0)
            assert a.recv(100) == b"the peer's answer"
        assert busy.answer_window == 5.0
        b.send(b"a late byte on the link, not awaited any more")
        busy.budget = busy.window = 0.001
        busy._spin()  # the poll after answering a client polls the clients alone again
        assert (busy.spins, busy.idle) == (1, 1)
    finally:
        for s in (a, b, c, d):
            s.close()


def test_a_peer_socket_closed_while_awaited_whose_number_a_client_takes_stays_the_clients() -> None:
    busy = BusyPoll(0.001, crowded=lambda now: False)
    a, b = socket.socketpair()
    c = d = None
    try:
        with busy.awaiting(a.fileno()) as poll:
            poll()
            fd = a.fileno()
            a.close()  # the link hung up by another task while its request was out
            c, d = socket.socketpair()
            if fd not in (c.fileno(), d.fileno()):
                pytest.skip("the kernel did not hand the closed socket's number out again")
            mine = c if c.fileno() == fd else d
            busy.add(fd)  # a new client connection under that number
        other = d if mine is c else c
        other.send(b"the client's request")
        busy._spin()  # the client's connection is still polled
        assert busy.spins == 1
        busy.remove(fd)  # and it leaves cleanly (this raised KeyError)
    finally:
        for s in (a, b, c, d):
            if s is not None:
                s.close()


def test_a_clients_request_ends_a_poll_for_an_answer() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        busy = BusyPoll(5.0, crowded=lambda now: False)
        busy.add(c.fileno())
        with busy.awaiting(a.fileno()) as poll:
            threading.Timer(0.02, d.send, (b"a client's request",)).start()
            poll()
            assert (busy.spins, busy.idle) == (1, 0)
    finally:
        for s in (a, b, c, d):
            s.close()


def test_the_answer_window_shrinks_while_answers_come_late_and_apart_from_the_clients_window() -> None:
    a, b = socket.socketpair()
    try:
        busy = BusyPoll(0.001, crowded=lambda now: False)
        shrinks = 0
        while busy.answer_window > 0:  # every answer comes 3 ms after a poll of at most 1 ms
            with busy.awaiting(a.fileno()) as poll:
                poll()
                time.sleep(0.003)
            shrinks += 1
            assert shrinks <= 8  # halving from 1 ms to below 10 us
        assert busy.idle == shrinks and busy.window == 0.001  # the clients' window did not move
        b.send(b"an answer already there")
        with busy.awaiting(a.fileno()) as poll:
            poll()  # no window: one look, which finds it
        assert busy.spins == 1 and busy.answer_window == FLOOR
    finally:
        for s in (a, b):
            s.close()


def test_no_budget_no_poll_for_answers() -> None:
    a, b = socket.socketpair()
    try:
        busy = BusyPoll(0.0)
        b.send(b"answer")
        with busy.awaiting(a.fileno()) as poll:
            poll()
        assert (busy.spins, busy.idle) == (0, 0)
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
    assert config_from_dict({}).node.busy_poll == 200
    assert config_from_dict({"node": {"busy_poll": 0}}).node.busy_poll == 0
    for bad in (-1, 10_001, 1.5, True, "50"):
        with pytest.raises(ConfigError, match="node.busy_poll"):
            config_from_dict({"node": {"busy_poll": bad}})


async def test_on_a_crowded_host_the_budget_is_a_share_of_itself() -> None:
    a, b = socket.socketpair()
    try:
        crowded = [True]
        busy = BusyPoll(0.4, crowded=lambda _now: crowded[0])
        share = 0.4 / CROWDED_SHARE
        busy.add(a.fileno())
        t0 = time.perf_counter()
        busy.after_answer()
        await asyncio.sleep(0)  # crowded: a poll of a share of the budget
        assert time.perf_counter() - t0 >= share and (busy.spins, busy.idle) == (0, 1)
        assert busy.window == share
        busy.heard()  # a request soon after: the window grows, but not past the share
        assert busy.window == share
        crowded[0] = False
        for want in (2 * share, 4 * share, 0.4):  # a core to spare: back to the whole budget
            busy.after_answer()
            await asyncio.sleep(0)
            busy.heard()
            assert busy.window == want
    finally:
        for s in (a, b):
            s.close()


@pytest.mark.parametrize(("line", "running"), [
    ("0.52 0.58 0.59 3/1043 58311\n", 3),
    ("1.00 1.00 1.00 12/99 1", 12),
    ("0.00 0.00 0.00 /99 1", None),
    ("0.00 0.00 0.00", None),
    ("", None),
    ("a b c x/y z", None),
])
def test_the_run_queue_count_is_read_from_loadavg(line: str, running: int | None) -> None:
    assert parse_running(line) == running


def test_the_run_queue_is_crowded_while_its_average_is_above_its_cores(tmp_path: Path) -> None:
    f = tmp_path / "loadavg"
    f.write_text("0.10 0.20 0.30 5/100 42\n")
    rq = RunQueue(cores=2, path=str(f), interval=1.0)
    seen = [rq.crowded(t) for t in (10.0, 10.5, 11.0, 12.0)]  # 10.5: within the interval, not read
    assert seen == [False, False, False, True]  # the average of 5s rises past 2 cores + MARGIN
    assert rq.average > 2 + MARGIN
    f.write_text("0.10 0.20 0.30 1/100 42\n")
    assert rq.crowded(13.0) is False and rq.average < 2 + MARGIN  # one quiet reading
    f.write_text("garbage\n")
    assert rq.crowded(14.0) is False  # unreadable: not crowded
    rq.close()
    assert rq.crowded(15.0) is False
    missing = RunQueue(cores=1, path=str(tmp_path / "absent"))
    assert missing.crowded(0.0) is False  # not Linux: polling as before


def test_the_host_run_queue_is_readable_here() -> None:
    rq = RunQueue(cores=10_000)  # this machine's /proc/loadavg: read, never above 10,000 tasks
    assert rq.crowded(0.0) is False
    assert parse_running(Path(LOADAVG).read_text()) is not None
    rq.close()


class _Counting(BusyPoll):
    """A ``BusyPoll`` that counts the polls asked for instead of polling."""

    def __init__(self) -> None:
        super().__init__(5.0)
        self.asked = 0

    def after_answer(self) -> None:
        self.asked += 1


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.written.append(b"".join(bytes(d) for d in data))


class _Coordinator:
    """Answers RELEASE with nothing (no reply asked), STATS at once, PIN when ``later`` is set."""

    def __init__(self) -> None:
        self.later: asyncio.Future[tuple[dict[str, object], list[bytes]]] = asyncio.Future()

    def serve(self, session: object, header: dict[str, object], payload: bytes) -> object:
        if header["op"] == Op.PIN:
            return self.later
        return {"id": header["id"], "st": 0}, []


def _frame(op: Op, message: Message, rid: int, **extra: object) -> bytes:
    """``message`` as a frame of ``op`` with id ``rid`` (``extra``: more header fields)."""
    header, payload = request(op, message, rid)
    return encode({"v": PROTOCOL_VERSION, **header, **extra}, payload)


async def test_the_daemon_polls_after_an_answer_not_while_a_request_waits_for_its_peers() -> None:
    busy = _Counting()
    proto = ControlProtocol(None, Session(), lambda _: None, busy)  # type: ignore[arg-type]
    coordinator = _Coordinator()
    proto.coordinator = coordinator  # type: ignore[assignment]
    transport = _Transport()
    proto.connection_made(transport)
    proto.data_received(_frame(Op.PIN, PinRequest(0, KeyBatch.from_user([1])), 1))
    assert busy.asked == 0  # the owner serving the fetch needs the cores: no poll yet
    proto.data_received(_frame(Op.RELEASE, ReleaseRequest(np.ones(1, np.uint32)), 2, nr=True))
    assert busy.asked == 1 and transport.written == []  # nothing to answer: the next request may come soon
    proto.data_received(encode({"v": PROTOCOL_VERSION, "id": 3, "op": int(Op.STATS)}))
    assert busy.asked == 2 and len(transport.written) == 1
    coordinator.later.set_result(({"id": 1, "st": 0}, []))
    for _ in range(3):
        await asyncio.sleep(0)
    assert busy.asked == 3 and len(transport.written) == 2  # the fetched PIN's answer, then a poll
