"""CcResult values; CcFuture: done() never blocks, result() raises only EmsException."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from ems.common.exception import EmsErrorCode, EmsException
from ems.result import CcFuture, CcResult


def test_result_fields_repr_and_equality() -> None:
    r = CcResult(3, 5)
    assert (r.success, r.total) == (3, 5)
    assert repr(r) == "CcResult(success=3, total=5)"
    assert r == CcResult(3, 5) and r != CcResult(5, 5) and hash(r) == hash(CcResult(3, 5))
    assert r != (3, 5)


@pytest.mark.parametrize(("success", "total"), [(-1, 0), (0, -1), (2, 1), (1.0, 2), (True, 2)])
def test_result_refuses_impossible_counts(success: object, total: object) -> None:
    with pytest.raises(EmsException) as info:
        CcResult(success, total)  # type: ignore[arg-type]
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def test_future_returns_the_result() -> None:
    f: Future[CcResult] = Future()
    cf = CcFuture(f)
    assert not cf.done()
    f.set_result(CcResult(1, 1))
    assert cf.done() and cf.result() == CcResult(1, 1)
    assert cf._future is f


def test_future_done_never_blocks_while_running() -> None:
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        cf = CcFuture(pool.submit(lambda: (release.wait(), CcResult(0, 1))[1]))
        assert cf.done() is False
        release.set()
        assert cf.result(timeout=10) == CcResult(0, 1)
        assert cf.done()


def test_future_raises_the_operations_ems_exception() -> None:
    f: Future[CcResult] = Future()
    err = EmsException(EmsErrorCode.EMS_IO_ERROR, "daemon gone")
    f.set_exception(err)
    with pytest.raises(EmsException) as info:
        CcFuture(f).result()
    assert info.value is err


def test_future_own_timeout_is_ems_io_timeout() -> None:
    with pytest.raises(EmsException) as info:
        CcFuture(Future()).result(timeout=0)
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT


def test_future_operation_failing_with_timeout_error_is_internal() -> None:
    f: Future[CcResult] = Future()
    f.set_exception(TimeoutError("inner"))
    with pytest.raises(EmsException) as info:
        CcFuture(f).result(timeout=0)
    assert info.value.status_code() is EmsErrorCode.EMS_INTERNAL_ERROR


def test_future_other_exceptions_become_internal_errors() -> None:
    f: Future[CcResult] = Future()
    f.set_exception(RuntimeError("bug"))
    with pytest.raises(EmsException) as info:
        CcFuture(f).result()
    assert info.value.status_code() is EmsErrorCode.EMS_INTERNAL_ERROR
    assert "RuntimeError: bug" in info.value.message()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_future_cancelled_is_internal_error() -> None:
    f: Future[CcResult] = Future()
    f.cancel()
    cf = CcFuture(f)
    assert cf.done()
    with pytest.raises(EmsException) as info:
        cf.result()
    assert info.value.status_code() is EmsErrorCode.EMS_INTERNAL_ERROR


@pytest.mark.parametrize("bad", [-1, "1", True])
def test_future_result_refuses_bad_timeout(bad: object) -> None:
    with pytest.raises(EmsException) as info:
        CcFuture(Future()).result(timeout=bad)  # type: ignore[arg-type]
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def test_future_wraps_only_futures() -> None:
    with pytest.raises(EmsException):
        CcFuture(CcResult(0, 0))  # type: ignore[arg-type]


def test_future_repr_states() -> None:
    f: Future[CcResult] = Future()
    assert repr(CcFuture(f)) == "CcFuture(pending)"
    f.set_result(CcResult(2, 3))
    assert repr(CcFuture(f)) == "CcFuture(CcResult(success=2, total=3))"
