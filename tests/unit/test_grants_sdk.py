"""The SDK's grant pool (``ems.grants``) against a scripted daemon: what it asks for, when it
stops asking, and that chunks it gets late or back from a save are not lost."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ems.common.exception import EmsErrorCode, EmsException
from ems.context_caching import _one_put_success, _put_success
from ems.grants import IDLE_AFTER_NONE, REFILL_BYTES, Grants, refill
from emsd.transport.frames import Op

POOL = 1 << 30


class FakeDaemon:
    """``submit``/``wait`` as ``DaemonClient`` has them; each GRANT answered by ``answer(fields)``:
    a list of offsets, or an ``EmsException`` to raise."""

    def __init__(self, answer: Any, grants: bool = True) -> None:
        self.info = {"grants": grants}
        self.pool_size = POOL
        self.asked: list[dict[str, Any]] = []
        self.answer = answer
        self.late: list[Any] = []
        self.answered = True  # whether a GRANT's answer is in by the next save (a quick daemon)
        self.waited = 0  # waits for a GRANT's answer

    def submit(self, op: Op, fields: dict[str, Any], payload: Any = (), late: Any = None) -> Any:
        assert op == Op.GRANT
        self.asked.append(fields)
        self.late.append(late)
        return Asked(fields, self)

    def wait(self, pending: Any, timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        self.waited += 1
        got = self.answer(pending.fields)
        if isinstance(got, EmsException):
            raise got
        return {"k": len(got)}, np.array(got, dtype="<u8").tobytes()


class Asked:
    """A GRANT sent to a ``FakeDaemon``: ``answered`` as the daemon says at the time asked."""

    def __init__(self, fields: dict[str, Any], daemon: FakeDaemon) -> None:
        self.fields, self._daemon = fields, daemon

    @property
    def answered(self) -> bool:
        return self._daemon.answered


def test_a_save_with_chunks_at_hand_does_not_wait_for_the_next_grant() -> None:
    """A GRANT still being handled is collected once it is in, or when the chunks at hand are
    too few for the save; a save that has its chunks never waits for it."""
    size = 64 << 10
    d = FakeDaemon(lambda f: list(range(0, size * f["k"], size)))
    g = Grants(d)  # type: ignore[arg-type]
    g.ask(size, 1)
    assert g.take(size, 1, None) is not None and d.waited == 1  # none at hand: waits for it
    while len(d.asked) == 1:  # saves, until the chunks at hand fall to half and it asks again
        assert g.take(size, 1, None) is not None
        g.ask(size, 1)
    d.answered = False  # the daemon is still granting
    for _ in range(refill(size, 1, POOL) // 2 - 1):  # the chunks at hand serve the next saves
        assert g.take(size, 1, None) is not None
    assert d.waited == 1  # none of them waited
    assert g.take(size, 1, None) is not None and d.waited == 2  # none left: waits for the GRANT


def test_refill_holds_one_save_and_small_blocks_up_to_a_bound() -> None:
    assert refill(2 << 20, 32, POOL) == 32
    assert refill(64 << 10, 1, POOL) == (POOL // 1024) // (64 << 10)  # 1 MiB of 64 KiB chunks
    assert refill(64 << 10, 1, 1 << 40) == REFILL_BYTES // (64 << 10)
    assert refill(4096, 3, 1 << 20) == 3  # a tiny pool: only what a save takes


def test_a_save_takes_granted_chunks_only_when_there_are_enough() -> None:
    big = 2 << 20  # refill: just a save's worth
    d = FakeDaemon(lambda f: list(range(0, big * f["k"], big)))
    g = Grants(d)  # type: ignore[arg-type]
    assert g.take(big, 4, None) is None  # nothing granted yet
    g.ask(big, 4)
    assert d.asked == [{"size": big, "k": 4, "need": 4}]
    got = g.take(big, 4, None)
    assert got is not None and sorted(got.tolist()) == [0, big, 2 * big, 3 * big]
    assert g.take(big, 1, None) is None
    g.give_back(big, got[:2])  # a save's unused chunks (present keys) serve the next save
    assert g.take(big, 2, None) is not None
    g.ask(big, 4)  # none at hand: asks for the next save's worth
    assert d.asked[-1] == {"size": big, "k": 4, "need": 4}


def test_small_blocks_are_asked_for_in_bulk_and_topped_up_at_half() -> None:
    d = FakeDaemon(lambda f: list(range(0, 64 * f["k"], 64)))
    g = Grants(d)  # type: ignore[arg-type]
    want = refill(64, 1, POOL)
    g.ask(64, 1)
    assert d.asked == [{"size": 64, "k": want, "need": 1}]
    for _ in range(want // 2):
        assert g.take(64, 1, None) is not None
        g.ask(64, 1)
    assert len(d.asked) == 1  # half is still at hand
    assert g.take(64, 1, None) is not None
    g.ask(64, 1)
    assert len(d.asked) == 2 and d.asked[1]["k"] == want - (want // 2 - 1)


def test_no_grant_asks_again_only_after_a_while_and_a_refused_size_never() -> None:
    d = FakeDaemon(lambda f: [])
    g = Grants(d)  # type: ignore[arg-type]
    g.ask(64, 2)
    assert g.take(64, 2, None) is None  # the daemon had none to spare
    for _ in range(IDLE_AFTER_NONE):
        g.ask(64, 2)
    assert len(d.asked) == 1
    g.ask(64, 2)
    assert len(d.asked) == 2
    d.answer = lambda f: EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "size too large")
    assert g.take(64, 2, None) is None
    for _ in range(3 * IDLE_AFTER_NONE):
        g.ask(64, 2)
    assert len(d.asked) == 2


def test_a_grant_answered_after_its_wait_gave_up_is_kept() -> None:
    d = FakeDaemon(lambda f: EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "late"))
    g = Grants(d)  # type: ignore[arg-type]
    g.ask(64, 2)
    assert g.take(64, 2, 0.0) is None
    d.late[0]({"k": 2}, np.array([640, 704], dtype="<u8").tobytes())  # the answer arrives
    got = g.take(64, 2, None)
    assert got is not None and sorted(got.tolist()) == [640, 704]


def test_a_daemon_with_grants_off_is_never_asked() -> None:
    d = FakeDaemon(lambda f: [0], grants=False)
    Grants(d).ask(64, 2)  # type: ignore[arg-type]
    assert d.asked == []


class _Holder:
    """What ``_put_success`` needs of a ``DaemonClient``: its grant pool."""

    def __init__(self) -> None:
        self.grants = Grants(FakeDaemon(lambda _f: []))  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [0, 1, 2])  # NEW, PRESENT, FAILED
@pytest.mark.parametrize("reached", [None, b"\0", b"\1", b""])
def test_a_one_block_put_answer_counts_and_gives_back_as_the_batch_tail_does(
        status: int, reached: bytes | None) -> None:
    answer = {} if reached is None else {"reached": reached}
    results: list[object] = []
    for done in (_one_put_success, _put_success):
        holder = _Holder()
        try:
            success = done(answer, bytes((status,)), holder, 4096, np.array([8192], dtype=np.uint64))  # type: ignore[arg-type]
        except EmsException as exc:  # a reached that is not one byte per NEW block: broken
            results.append(exc.status_code())
            continue
        results.append((success, holder.grants.take(4096, 1, None) is not None))
    assert results[0] == results[1]
    if reached is not None and len(reached) != int(status == 0):
        assert results[0] == EmsErrorCode.EMS_IO_ERROR
    else:
        assert results[0][1] == (status != 0)  # type: ignore[index]  # a chunk the block did not take is free again


def test_a_malformed_one_block_put_answer_is_an_io_error() -> None:
    with pytest.raises(EmsException) as err:
        _one_put_success({}, b"", _Holder(), 4096, np.array([8192], dtype=np.uint64))  # type: ignore[arg-type]
    assert err.value.status_code() == EmsErrorCode.EMS_IO_ERROR
