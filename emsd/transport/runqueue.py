"""Whether the host is crowded: more tasks runnable now than this process has cores.

A daemon that busy-polls for its clients' next requests (``emsd.transport.busypoll``)
holds a core while it spins. On a host with a core to spare that costs nothing the
clients need, and a longer window catches requests a short one misses (a client's own
work between two calls). On a crowded host (more runnable tasks than cores: CPU-bound
engines, more client processes than cores) the spin takes the core a client needs to
send the request it waits for. ``RunQueue.crowded`` tells the two apart.

It reads the fourth field of ``/proc/loadavg`` (``running/total``: the tasks runnable
at this instant, system-wide, this one included) at most every ``INTERVAL`` seconds,
keeps an exponential average of the readings (each a snapshot: a task that just woke
counts, one about to sleep too, a kernel worker passing by), and calls the host
crowded while that average is above the cores this process may run on
(``os.sched_getaffinity``) by more than ``MARGIN``. Where the file cannot be read
(not Linux), the host is never crowded: polling behaves as before this check
existed.
"""

from __future__ import annotations

import os

LOADAVG = "/proc/loadavg"
INTERVAL = 0.01  # seconds between two readings of the run queue
SMOOTHING = 0.25  # weight of a new reading in the running average
MARGIN = 0.5  # crowded: the average count of runnable tasks above the cores by more than this


def parse_running(text: str) -> int | None:
    """The count of runnable tasks in a ``/proc/loadavg`` line (its fourth field, before
    the slash), or None when the line does not have one."""
    fields = text.split()
    if len(fields) < 4:
        return None
    running = fields[3].partition("/")[0]
    return int(running) if running.isdigit() else None


class RunQueue:
    """``crowded(now)``: on average more runnable tasks than ``cores`` (by ``MARGIN``), read at
    most every ``interval``."""

    def __init__(self, cores: int | None = None, path: str = LOADAVG, interval: float = INTERVAL) -> None:
        self.cores = cores if cores is not None else len(os.sched_getaffinity(0))
        self.interval = interval
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        self._read_at = float("-inf")
        self.average = 0.0  # runnable tasks, an exponential average of the readings
        self._crowded = False

    def crowded(self, now: float) -> bool:
        """Whether the average of the readings is above ``cores + MARGIN``, with a reading
        taken anew when ``now`` (seconds, any monotonic clock) is ``interval`` past the one
        before. A reading that fails leaves the host not crowded."""
        if self._fd is None:
            return False
        if now - self._read_at >= self.interval:
            self._read_at = now
            try:
                running = parse_running(os.pread(self._fd, 128, 0).decode("ascii", "replace"))
            except OSError:
                running = None
            if running is None:
                self._crowded = False
            else:
                self.average += SMOOTHING * (running - self.average)
                self._crowded = self.average > self.cores + MARGIN
        return self._crowded

    def close(self) -> None:
        """Release the file; ``crowded`` is False from now on."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_SHARED: RunQueue | None = None


def shared() -> RunQueue:
    """The process's one ``RunQueue`` (the run queue is the host's; one open file serves all)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = RunQueue()
    return _SHARED
