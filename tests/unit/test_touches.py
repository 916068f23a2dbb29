"""The SDK's batches of touches (``ems.touches``): loads' keys reach the daemon as one TOUCH,
with the next request, when enough have gathered, or at the latest ``TOUCH_DELAY`` after the
batch's first load; a batch of another namespace or connection goes first; close sends what
is pending."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ems.touches import TOUCH_DELAY, TOUCH_KEYS, Touches
from emsd.transport.frames import Op


class Recorder:
    """Stands in for a ``DaemonClient``: records what would be written, and how."""

    def __init__(self) -> None:
        self.broken = False
        self.sent: list[tuple[str, dict[str, int], bytes]] = []
        self.lock = threading.Lock()

    def send_noreply(self, op: Op, fields: dict[str, Any], payload: Any = ()) -> None:
        assert op == Op.TOUCH
        with self.lock:
            self.sent.append(("alone", fields, b"".join(payload)))

    def send_later(self, op: Op, fields: dict[str, Any], payload: Any = ()) -> None:
        assert op == Op.TOUCH
        with self.lock:
            self.sent.append(("later", fields, b"".join(payload)))


def keys(*ks: int) -> bytes:
    return np.array(ks, dtype="<u8").tobytes()


def wait_for(cond: Any, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_batch_goes_alone_after_the_delay_with_every_load_s_keys() -> None:
    c, t = Recorder(), Touches()
    try:
        t.add(c, 3, 0, 1, keys(1))  # type: ignore[arg-type]
        t.add(c, 3, 0, 2, keys(2, 3))  # type: ignore[arg-type]
        assert c.sent == []
        start = time.monotonic()
        wait_for(lambda: c.sent)
        assert time.monotonic() - start < 10 * TOUCH_DELAY
        assert c.sent == [("alone", {"ns": 3, "n": 3, "kt": 0}, keys(1, 2, 3))]
    finally:
        t.close()


def test_a_full_batch_goes_at_once_and_the_next_request_takes_the_rest() -> None:
    c, t = Recorder(), Touches()
    try:
        for k in range(TOUCH_KEYS + 1):
            t.add(c, 0, 0, 1, keys(k))  # type: ignore[arg-type]
        assert c.sent == [("alone", {"ns": 0, "n": TOUCH_KEYS, "kt": 0}, keys(*range(TOUCH_KEYS)))]
        t.send_with_next(c)  # type: ignore[arg-type]
        assert c.sent[1:] == [("later", {"ns": 0, "n": 1, "kt": 0}, keys(TOUCH_KEYS))]
        time.sleep(3 * TOUCH_DELAY)
        assert len(c.sent) == 2, "nothing was left to send late"
    finally:
        t.close()


def test_another_namespace_or_connection_sends_the_batch_before() -> None:
    a, b, t = Recorder(), Recorder(), Touches()
    try:
        t.add(a, 1, 0, 1, keys(1))  # type: ignore[arg-type]
        t.add(a, 2, 0, 1, keys(2))  # type: ignore[arg-type]
        assert a.sent == [("alone", {"ns": 1, "n": 1, "kt": 0}, keys(1))]
        t.add(b, 2, 0, 1, keys(3))  # type: ignore[arg-type]
        assert a.sent[1:] == [("alone", {"ns": 2, "n": 1, "kt": 0}, keys(2))]
        t.send_with_next(a)  # type: ignore[arg-type]  # b's batch: not a's next write
        assert b.sent == [("alone", {"ns": 2, "n": 1, "kt": 0}, keys(3))]
    finally:
        t.close()


def test_close_sends_what_is_pending_and_a_lost_connection_drops_it() -> None:
    c, t = Recorder(), Touches()
    t.add(c, 0, 0, 1, keys(9))  # type: ignore[arg-type]
    t.close()
    assert c.sent == [("alone", {"ns": 0, "n": 1, "kt": 0}, keys(9))]
    lost, t2 = Recorder(), Touches()
    lost.broken = True
    t2.add(lost, 0, 0, 1, keys(9))  # type: ignore[arg-type]
    t2.close()
    assert lost.sent == []


def test_exists_found_in_the_table_are_counted_in_the_batch() -> None:
    c, t = Recorder(), Touches()
    try:
        t.add(c, 4, 0, 0, b"", exists=5)  # type: ignore[arg-type]
        t.add(c, 4, 0, 1, keys(7), exists=0)  # type: ignore[arg-type]
        t.send_with_next(c)  # type: ignore[arg-type]
        assert c.sent == [("later", {"ns": 4, "n": 1, "kt": 0, "x": 5}, keys(7))]
        t.add(c, 4, 0, 0, b"", exists=2)  # type: ignore[arg-type]
        wait_for(lambda: len(c.sent) == 2)
        assert c.sent[1] == ("alone", {"ns": 4, "n": 0, "kt": 0, "x": 2}, b"")
    finally:
        t.close()


class CountingCondition:
    """A ``threading.Condition`` that counts its ``notify`` calls."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.notified = 0

    def __enter__(self) -> bool:
        return self._cond.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._cond.__exit__(*exc)

    def wait(self, timeout: float | None = None) -> bool:
        return self._cond.wait(timeout)

    def notify(self) -> None:
        self.notified += 1
        self._cond.notify()


def test_loads_between_requests_wake_the_sender_once_a_delay_not_at_every_load() -> None:
    """A load then a save, over and over (one block a call): each load starts a batch that the
    next request takes. The sender thread is woken for a batch only when it waits for none,
    so a few times a ``TOUCH_DELAY``; it used to be woken at every load (a thread switch in
    the caller's path each time)."""
    c, t = Recorder(), Touches()
    cond = t._cond = CountingCondition()  # type: ignore[assignment]
    try:
        t.add(c, 0, 0, 1, keys(0))  # type: ignore[arg-type]  # starts the sender thread
        start, rounds = time.monotonic(), 200
        for k in range(1, rounds + 1):
            t.send_with_next(c)  # type: ignore[arg-type]  # a save takes the batch
            t.add(c, 0, 0, 1, keys(k))  # type: ignore[arg-type]  # the next load starts one
        delays = (time.monotonic() - start) / TOUCH_DELAY
        assert cond.notified <= 2 + 2 * delays < rounds, (cond.notified, delays)
        assert [s[0] for s in c.sent] == ["later"] * rounds
        wait_for(lambda: len(c.sent) == rounds + 1)  # the last batch still goes, alone
        assert c.sent[-1] == ("alone", {"ns": 0, "n": 1, "kt": 0}, keys(rounds))
    finally:
        t.close()
