"""An asyncio event loop on a virtual clock: time moves only when nothing is ready.

``VirtualLoop`` is the stock selector loop with three edges replaced:

- ``time()`` reads a virtual clock that starts at 0;
- the selector never waits: when the loop would block until its next timer,
  the clock jumps to that timer instead (``asyncio.sleep(30)`` costs
  nothing), and when it would block with no timer at all it raises
  ``SimDeadlock`` (in a world without real I/O nothing could ever wake it);
- ``run_in_executor`` runs the function at once in the loop's thread, so
  that no worker thread's timing can change what happens next.

Everything else (task scheduling, ``asyncio.wait`` timeouts, cancellation)
is asyncio's own code, whose order is deterministic given the same calls.
The loop uses no file descriptor: ``call_soon_threadsafe`` works only from
the loop's own thread, which is the only thread a simulation has.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


class SimDeadlock(RuntimeError):
    """The loop would wait for ever: nothing is ready and no timer is set."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _JumpSelector(selectors.BaseSelector):
    """A selector with nothing to select: ``select(timeout)`` moves the clock by ``timeout``."""

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise RuntimeError(f"the virtual loop has no real I/O (register of {fileobj!r})")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimDeadlock("nothing is ready and no timer is set: the simulation would hang")
        self._clock.now += max(0.0, timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual (see the module docstring)."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(_JumpSelector(self._clock))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._clock.now

    # no self-pipe: there are no other threads to wake the loop
    def _make_self_pipe(self) -> None:
        pass

    def _close_self_pipe(self) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        """Run ``func(*args)`` now, in this thread; the future is done on return."""
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as exc:  # handed to the awaiting caller, as an executor would
            fut.set_exception(exc)
        return fut
