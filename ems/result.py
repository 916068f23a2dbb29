"""Call results: ``CcResult`` (a count of keys) and ``CcFuture`` (one in flight).

``CcResult(success, total)``: ``total`` is the number of keys in the request,
``success`` the number that succeeded consecutively from the first one. A
partial failure or a cache miss is never an exception, only
``success < total``.

``CcFuture`` wraps the ``concurrent.futures.Future`` of an ``async_save`` or
``async_load``. The wrapped future resolves to a ``CcResult`` or raises an
``EmsException``; ``CcFuture.result`` turns everything else into an
``EmsException`` too, so callers only ever catch one type:

- its own ``timeout`` passing -> ``EMS_IO_TIMEOUT`` (the operation keeps
  running; ask again later);
- a cancelled operation -> ``EMS_INTERNAL_ERROR`` (the SDK never cancels a
  started operation, so this only happens to work dropped at shutdown);
- any other exception -> ``EMS_INTERNAL_ERROR``, chained to the original.
"""

from __future__ import annotations

from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from ems.common.exception import EmsErrorCode, EmsException, invalid


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 0:
        raise invalid(f"CcResult: {name} must be an int >= 0, got {value!r}")
    return int(value)


class CcResult:
    """``success`` consecutive keys from the first succeeded, out of ``total``."""

    __slots__ = ("success", "total")

    def __init__(self, success: int, total: int) -> None:
        self.success = _count(success, "success")
        self.total = _count(total, "total")
        if self.success > self.total:
            raise invalid(f"CcResult: success ({self.success}) must be <= total ({self.total})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CcResult):
            return NotImplemented
        return self.success == other.success and self.total == other.total

    def __hash__(self) -> int:
        return hash((self.success, self.total))

    def __repr__(self) -> str:
        return f"CcResult(success={self.success}, total={self.total})"


class CcFuture:
    """An ``async_save``/``async_load`` in flight.

    ``done()`` never blocks; ``result(timeout=None)`` waits (``timeout`` in
    seconds, ``None`` = as long as it takes) and returns the ``CcResult`` or
    raises ``EmsException`` (see the module docstring). ``_future`` is the
    wrapped ``concurrent.futures.Future``.
    """

    __slots__ = ("_future",)

    def __init__(self, future: Future[CcResult]) -> None:
        if not isinstance(future, Future):
            raise invalid(f"CcFuture wraps a concurrent.futures.Future, "
                          f"got {type(future).__name__}")
        self._future = future

    def done(self) -> bool:
        """True once the operation finished, successfully or not; never blocks."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CcResult:
        """Wait for the result; raises ``EmsException`` if the operation failed."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise invalid(f"CcFuture.result: timeout must be None or seconds >= 0, got {timeout!r}")
        try:
            # exception(timeout) raises TimeoutError only when the wait itself ran
            # out, never for an operation that failed with a TimeoutError.
            exc = self._future.exception(timeout)
        except TimeoutError:
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"the operation did not finish within {timeout} s") from None
        except CancelledError:
            raise EmsException(EmsErrorCode.EMS_INTERNAL_ERROR,
                               "the operation was cancelled before it finished") from None
        if exc is None:
            return self._future.result()
        if isinstance(exc, EmsException):
            raise exc
        raise _internal(exc) from exc

    def __repr__(self) -> str:
        if not self._future.done():
            return "CcFuture(pending)"
        if self._future.cancelled():
            return "CcFuture(cancelled)"
        exc = self._future.exception()
        if exc is not None:
            return f"CcFuture(failed: {exc!r})"
        return f"CcFuture({self._future.result()!r})"


def _internal(exc: BaseException) -> EmsException:
    return EmsException(EmsErrorCode.EMS_INTERNAL_ERROR,
                        f"the operation failed inside the SDK: {type(exc).__name__}: {exc}")
