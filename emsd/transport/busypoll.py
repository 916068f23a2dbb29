"""Busy polling after answers: the event loop's thread stays awake a few microseconds for the
next request of its clients.

A daemon idle in ``epoll_wait`` is woken by the kernel when a request arrives. On a
virtual machine that wake-up (an interrupt to a halted virtual CPU) costs tens of
microseconds: on the 2-core development VM a Unix-socket echo between two processes
takes 60 us when both sides sleep, 19 us when the server polls for up to 100 us
before sleeping, and 4 us when both do. A call of the SDK is often followed at once
by another (a load's RELEASE, a save's GRANT, the next layer's or request's call), so
after answering, the loop polls its client connections (``poll`` with no timeout,
which lets go of the GIL) until one has a request or ``budget`` has passed, and only
then goes back to ``epoll_wait``. Not after a request whose answer waits for other
nodes (a PIN of blocks another node owns): that client's next request comes only after
the answer, so the poll would spin in vain (a daemon that polled there too used about a
quarter more CPU a single remote get, on the core its peer needed); the answer polls
when it goes, and the wait for the owner's answer polls for that answer (below). A request that
arrives in the window is read without a wake-up. The cost is CPU: at most ``budget``
of one core after each burst of answers, none while requests keep arriving (the poll
ends at the first). Every client connection is polled, not only the one answered, so
a request of another client never waits for the window to close. ``node.busy_poll`` sets the budget
(microseconds; 0 turns it off). The SDK polls its side the same way while it waits
for an answer (``ems.client``).

The window adapts (``emsd.transport.pollwindow``): a poll that a request ends, or
a request that comes soon after an idle poll, keeps it at the budget; requests that
come later than twice the budget shrink it, down to no polling at all, so that a
daemon whose clients are slow to send (more busy processes than cores) does not
spin in vain on a core they need. The next request that comes soon grows it again.

And on a crowded host (more tasks runnable than cores, ``emsd.transport.runqueue``)
the budget is ``1/CROWDED_SHARE`` of itself, for the poll and for adapting the
window: there the spin holds a core that a client needs to send the very request
it waits for (and, likely, a thread that spins loses the head start the scheduler
gives a sleeper that wakes). With the default budget (200 us) that is 50 us, the
budget before 2026-11-28. On the 2-core development host that day, one client
saving and loading single 64 KiB blocks (``benchmarks/bench_clients.py --batch 1``)
made 7,200-8,800 calls a second against 5,900-6,900 with a plain 50 us budget, in
six alternating pairs: its work between two calls, 30-50 us there, often outlasts
a 50 us window, and the daemon then sleeps. With four clients, or beside two
CPU-bound processes, the host is crowded and the rate is that of 50 us; a plain
200 us budget there lost up to two thirds of the calls.

Timers, peer connections and the HTTP endpoint wait for at most ``budget`` meanwhile.

The same poll runs while the loop waits for another node's answer (``awaiting``, around a
peer request: a GET of blocks a client asked for, a forwarded save): the peer socket
joins the polled set until its answer has been read, and the poll ends at that answer or
at any client's request. Its window adapts apart from the one after answers, by the same
rule. An answer written to a node that sleeps costs the writer its wake-up: on the 2-core
development VM, polling for the owner's answer took one 64 KiB remote get from 656 to
about 580 us p50 (p90 710 to 610-650) and the owner's CPU a get from 175 to 155-160 us,
for about 40 us more of this node's (``benchmarks/bench_remote_one.py``, 2026-11-29).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections.abc import Callable, Iterator

from emsd.transport import runqueue
from emsd.transport.pollwindow import next_window

CROWDED_SHARE = 4  # on a crowded host a poll lasts at most this share of the budget


class BusyPoll:
    """Keeps one event loop awake for ``budget`` seconds after answers (see the module)."""

    def __init__(self, budget: float, crowded: Callable[[float], bool] | None = None) -> None:
        """``crowded(now)``: whether the host has more runnable tasks than cores (default:
        ``emsd.transport.runqueue``'s reading; ``now`` is ``time.perf_counter()``)."""
        self.budget = budget
        self._crowded = crowded if crowded is not None else runqueue.shared().crowded
        self.window = budget  # seconds the next poll lasts (at most the budget; adapts)
        self._cap = budget  # the budget of the last poll: a share of it on a crowded host
        self._slept_at: float | None = None  # when the loop went to sleep after an idle poll
        self._poller = select.poll()
        self._fds: set[int] = set()
        self._expected: set[int] = set()  # peer sockets with a request out (``awaiting``)
        self.answer_window = budget  # seconds a poll for a peer's answer lasts (adapts)
        self._due = False
        self.spins = 0  # polls that ended with a request waiting
        self.idle = 0  # polls that ran their whole budget

    def add(self, fd: int) -> None:
        """Poll client connection ``fd`` from now on (until ``remove``)."""
        if fd >= 0 and fd not in self._fds:
            self._expected.discard(fd)  # a peer socket closed while awaited: its number reused
            self._fds.add(fd)
            self._poller.register(fd, select.POLLIN | select.POLLRDHUP)

    def remove(self, fd: int) -> None:
        """Connection ``fd`` is closing: poll it no more."""
        if fd in self._fds:
            self._fds.discard(fd)
            self._poller.unregister(fd)

    @contextlib.contextmanager
    def awaiting(self, fd: int) -> Iterator[Callable[[], None]]:
        """Around a request to another node on socket ``fd``: gives ``poll``, to call once the
        request is sent, which polls (in this thread, holding the loop) until the answer or a
        client's request is readable, for at most the answer window. When the block ends (the
        answer read, or the request failed), ``fd`` leaves the polled set and the window adapts
        to how long the answer took. Requests out on several sockets at once: an answer on
        any of them ends the poll."""
        if self.budget <= 0 or fd < 0 or fd in self._fds or fd in self._expected:
            yield no_poll
            return
        self._expected.add(fd)
        self._poller.register(fd, select.POLLIN | select.POLLRDHUP)
        spun: list[tuple[float, float, bool]] = []  # (start, cap, caught) of the poll

        def poll() -> None:
            start = time.perf_counter()
            cap = self._budget_at(start)
            window = min(self.answer_window, cap)
            self.answer_window = window
            spun.append((start, cap, self._poll_until(start + window)))

        try:
            yield poll
        finally:
            if fd in self._expected:  # else closed meanwhile, and the number is a client's now
                self._expected.discard(fd)
                self._poller.unregister(fd)
            if spun:
                start, cap, caught = spun[0]
                self.answer_window = next_window(self.answer_window, cap, caught,
                                                 time.perf_counter() - start)

    def after_answer(self) -> None:
        """A connection has just been answered: poll once the loop has run its ready callbacks."""
        if self.budget > 0 and self._fds and not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self._spin)

    def heard(self) -> None:
        """A request has arrived: after an idle poll, adapt the window to how long it took."""
        if self._slept_at is not None:
            waited = time.perf_counter() - self._slept_at
            self.window = next_window(self.window, self._cap, False, waited)
            self._slept_at = None

    def _spin(self) -> None:
        self._due = False
        start = time.perf_counter()
        self._cap = self._budget_at(start)
        self.window = min(self.window, self._cap)
        if self._poll_until(start + self.window):
            self.window = next_window(self.window, self._cap, True, 0.0)
        else:
            self._slept_at = start

    def _budget_at(self, now: float) -> float:
        """The budget of a poll starting ``now``: on a crowded host a share of itself, for the
        poll and for adapting its window."""
        return self.budget / CROWDED_SHARE if self._crowded(now) else self.budget

    def _poll_until(self, end: float) -> bool:
        """Poll every socket of the set until one is readable (True) or ``end`` has passed
        (False; one look at least); counts it in ``spins`` or ``idle``."""
        poll = self._poller.poll
        while True:
            if poll(0):
                self.spins += 1
                return True
            if time.perf_counter() >= end:
                self.idle += 1
                return False


def no_poll() -> None:
    """``BusyPoll.awaiting``'s poll when it does not poll (no budget, or ``fd`` polled already)."""
