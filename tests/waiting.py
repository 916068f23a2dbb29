"""Waiting in tests for something that happens in another thread or process."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition not reached in time") -> None:
    """Return once ``cond()`` is true; fail the test with ``what`` after ``timeout`` seconds.
    ``cond`` is asked every ``interval`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(interval)
