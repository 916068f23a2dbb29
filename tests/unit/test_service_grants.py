"""GRANT and PUT through ``Service.handle`` in one process: a save in one round trip into
chunks granted ahead of time, only by the session they were granted to, within the bounds,
and nothing left behind when the session ends."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.pool.store import Status as SlotStatus
from emsd.protocol.local import (
    CommitRequest,
    GrantAnswer,
    GrantRequest,
    PutAnswer,
    PutRequest,
    ReserveAnswer,
    ReserveRequest,
)
from emsd.service import GRANT_SESSION_SHARE, GRANT_TOTAL_SHARE, Service, Session
from emsd.transport.frames import Op, Status
from tests.messages import handled, opened, request

POOL, PAGE, BLOCK = 8 << 20, 1 << 20, 4096
NEW, PRESENT, FAILED = int(SlotStatus.NEW), int(SlotStatus.PRESENT), int(SlotStatus.FAILED)


def _setup(grants: bool = True) -> tuple[Service, Session, int]:
    svc = Service(BlockStore(POOL, PAGE), "t", "shm", Metrics())
    svc.grants = grants
    s, ns = opened(svc)
    return svc, s, ns


def _grant(svc: Service, s: Session, k: int, size: int = BLOCK, back: np.ndarray | None = None) -> np.ndarray:
    grant = GrantRequest(size, k) if back is None else GrantRequest(size, k, back=back.astype(np.uint64))
    resp, payload = handled(svc, s, Op.GRANT, grant)
    assert resp["st"] == Status.OK, resp
    return GrantAnswer.decode(resp, payload, k).offsets


def _put_request(ns: int, keys: list[int], at: np.ndarray, sizes: list[int] | None = None) -> PutRequest:
    n = len(keys)
    sz = np.array(sizes if sizes is not None else [BLOCK] * n, np.uint64)
    return PutRequest(ns, KeyBatch.from_user(keys), at.astype(np.uint64), sz)


def _put(svc: Service, s: Session, ns: int, keys: list[int], at: np.ndarray,
         sizes: list[int] | None = None) -> tuple[dict, np.ndarray]:
    resp, payload = handled(svc, s, Op.PUT, _put_request(ns, keys, at, sizes))
    if resp["st"] != Status.OK:
        return resp, np.zeros(0, np.uint8)
    return resp, PutAnswer.decode(resp, payload, len(keys)).status


def _save(svc: Service, s: Session, ns: int, keys: list[int], size: int) -> None:
    """RESERVE and COMMIT of ``keys`` in blocks of ``size`` bytes (those found are left be)."""
    n = len(keys)
    resp, payload = handled(svc, s, Op.RESERVE, ReserveRequest(ns, KeyBatch.from_user(keys),
                                                               np.full(n, size, np.uint64)))
    reserved = ReserveAnswer.decode(resp, payload, n)
    handled(svc, s, Op.COMMIT, CommitRequest(reserved.handles[reserved.status == NEW]))


def _loadable(svc: Service, ns: int, keys: list[int]) -> int:
    return svc.store.exists(ns, KeyBatch.from_user(keys))


def test_a_put_into_granted_chunks_stores_and_commits_in_one_request() -> None:
    svc, s, ns = _setup()
    at = _grant(svc, s, 3)
    assert at.size == 3 and svc.store.stats().granted == 3 * BLOCK and s.granted_bytes == 3 * BLOCK
    resp, status = _put(svc, s, ns, [1, 2, 3], at)
    assert resp["st"] == Status.OK and status.tolist() == [NEW] * 3
    assert _loadable(svc, ns, [1, 2, 3]) == 3
    pinned = svc.store.pin(ns, KeyBatch.from_user([1, 2, 3]))
    assert pinned.offsets.tolist() == at.tolist()  # each block is where the client wrote it
    st = svc.store.stats()
    assert (st.granted, st.pending, st.ns_bytes[ns]) == (0, 0, 3 * BLOCK)
    assert s.granted == {} and s.granted_bytes == 0


def test_a_present_key_keeps_its_chunk_granted_for_the_next_save() -> None:
    svc, s, ns = _setup()
    at = _grant(svc, s, 2)
    _put(svc, s, ns, [7], at[:1])
    more = _grant(svc, s, 1)
    resp, status = _put(svc, s, ns, [7, 8], np.array([at[1], more[0]]))
    assert status.tolist() == [PRESENT, NEW]
    assert list(s.granted) == [int(at[1])] and svc.store.stats().granted == BLOCK
    assert _put(svc, s, ns, [9], at[1:])[1].tolist() == [NEW]  # and it can be used again


@pytest.mark.parametrize("case", ["not granted", "named twice", "another session's", "wrong size",
                                  "size past its chunk", "short payload"])
def test_a_bad_put_is_refused_and_changes_nothing(case: str) -> None:
    svc, s, ns = _setup()
    other, _ = opened(svc)
    mine, theirs = _grant(svc, s, 2), _grant(svc, other, 1)
    at, sizes, keys = mine, [BLOCK, BLOCK], [1, 2]
    if case == "not granted":
        at = np.array([mine[0], mine[1] + np.uint64(POOL)])
    elif case == "named twice":
        at = np.array([mine[0], mine[0]])
    elif case == "another session's":
        at = np.array([mine[0], theirs[0]])
    elif case == "wrong size":
        sizes = [BLOCK, BLOCK - 64]  # another chunk size: another class
    elif case == "size past its chunk":
        sizes = [BLOCK, BLOCK + 1]
    before = svc.store.stats()
    if case == "short payload":
        header, payload = request(Op.PUT, _put_request(ns, keys, mine))
        resp, _ = svc.handle(s, header, payload[:-16])  # no sizes
    else:
        resp, _ = _put(svc, s, ns, keys, at, sizes)
    assert resp["st"] == Status.INVALID_ARGUMENT and resp["msg"]
    after = svc.store.stats()
    assert (after.entries, after.granted, after.bytes_used) == \
        (before.entries, before.granted, before.bytes_used)
    assert sorted(s.granted) == sorted(mine.tolist()) and _loadable(svc, ns, keys) == 0
    assert _put(svc, s, ns, keys, mine)[1].tolist() == [NEW, NEW]  # the chunks still work


def test_a_closed_session_gives_its_grants_back() -> None:
    svc, s, ns = _setup()
    _grant(svc, s, 5)
    used = svc.store.stats().bytes_used
    svc.close(s)
    st = svc.store.stats()
    assert st.granted == 0 and st.bytes_used == used - 5 * BLOCK and s.granted == {}


def test_chunks_given_back_with_a_grant_are_free_again() -> None:
    svc, s, _ = _setup()
    at = _grant(svc, s, 4)
    again = _grant(svc, s, 0, back=at[:3])
    assert again.size == 0 and list(s.granted) == [int(at[3])]
    resp, _ = handled(svc, s, Op.GRANT, GrantRequest(BLOCK, 0, back=at[:1]))  # given back twice: refused
    assert resp["st"] == Status.INVALID_ARGUMENT and svc.store.stats().granted == BLOCK


def test_grants_are_bounded_per_session_and_in_all() -> None:
    svc, s, _ = _setup()
    per_session = POOL // GRANT_SESSION_SHARE // BLOCK
    assert _grant(svc, s, per_session + 10).size == per_session
    assert _grant(svc, s, 1).size == 0
    others = [opened(svc)[0] for _ in range(GRANT_SESSION_SHARE)]
    total = sum(_grant(svc, o, per_session).size for o in others) + per_session
    assert total == POOL // GRANT_TOTAL_SHARE // BLOCK
    assert svc.store.stats().granted == POOL // GRANT_TOTAL_SHARE


def test_a_grant_that_cannot_give_what_the_next_save_needs_gives_nothing() -> None:
    svc, s, _ = _setup()
    per_session = POOL // GRANT_SESSION_SHARE // BLOCK
    k = per_session + 4
    resp, payload = handled(svc, s, Op.GRANT, GrantRequest(BLOCK, k, need=per_session + 1))
    assert resp["st"] == Status.OK and GrantAnswer.decode(resp, payload, k).offsets.size == 0
    assert svc.store.stats().granted == 0
    resp, payload = handled(svc, s, Op.GRANT, GrantRequest(BLOCK, k, need=per_session))
    assert GrantAnswer.decode(resp, payload, k).offsets.size == per_session  # as many as fit: enough


@pytest.mark.parametrize("header", [{"size": 0, "k": 1}, {"size": PAGE + 1, "k": 1}, {"size": "4096", "k": 1},
                                    {"size": BLOCK, "k": -1}, {"size": BLOCK, "k": True}, {"k": 1},
                                    {"size": BLOCK, "k": 1, "need": -1},
                                    {"size": BLOCK, "k": 1, "need": "2"}])
def test_a_bad_grant_is_refused(header: dict) -> None:
    svc, s, _ = _setup()
    resp, _ = svc.handle(s, {"op": int(Op.GRANT), "id": 2, **header}, b"")
    assert resp["st"] == Status.INVALID_ARGUMENT and svc.store.stats().granted == 0


def test_grants_off_refuse_grant_and_say_so_in_hello() -> None:
    svc, s, _ = _setup(grants=False)
    resp, _ = handled(svc, s, Op.GRANT, GrantRequest(BLOCK, 1))
    assert resp["st"] == Status.INVALID_ARGUMENT and "pool.grants" in resp["msg"]
    assert svc.hello(Session(), {"op": int(Op.HELLO)})["grants"] is False


def test_granted_chunks_are_never_evicted_and_their_page_never_stolen() -> None:
    svc, s, ns = _setup()
    at = _grant(svc, s, 8)
    pool = svc.store
    other, ons = opened(svc)
    # fill the rest of the pool with 4 KiB blocks, then with blocks of another size
    for batch in range(POOL // BLOCK // 64 + 4):
        _save(svc, other, ons, list(range(1000 + 64 * batch, 1000 + 64 * (batch + 1))), BLOCK)
    for batch in range(16):
        _save(svc, other, ons, list(range(90000 + 8 * batch, 90000 + 8 * (batch + 1))), PAGE)
    assert pool.stats().evictions.get("page", 0) > 0  # pages did move between classes
    live = pool.index.live_ids()
    starts = set((pool.index.offset[live].astype(np.uint64) * np.uint64(pool.slabs.align)).tolist())
    assert not starts & set(at.tolist())  # no block was placed in a granted chunk
    assert _put(svc, s, ns, list(range(8)), at)[1].tolist() == [NEW] * 8
    assert _loadable(svc, ns, list(range(8))) == 8


@pytest.mark.parametrize("case", ["not granted", "another session's", "wrong size", "size past its chunk",
                                  "short payload"])
def test_a_bad_one_block_put_is_refused_and_changes_nothing(case: str) -> None:
    svc, s, ns = _setup()
    other, _ = opened(svc)
    mine, theirs = _grant(svc, s, 1), _grant(svc, other, 1)
    at, sizes = mine, [BLOCK]
    if case == "not granted":
        at = mine + np.uint64(POOL)
    elif case == "another session's":
        at = theirs
    elif case == "wrong size":
        sizes = [BLOCK - 64]
    elif case == "size past its chunk":
        sizes = [BLOCK + 1]
    before = svc.store.stats()
    if case == "short payload":
        header, payload = request(Op.PUT, _put_request(ns, [1], mine))
        resp, _ = svc.handle(s, header, payload[:-8])  # no size
    else:
        resp, _ = _put(svc, s, ns, [1], at, sizes)
    assert resp["st"] == Status.INVALID_ARGUMENT and resp["msg"]
    after = svc.store.stats()
    assert (after.entries, after.granted, after.bytes_used) == \
        (before.entries, before.granted, before.bytes_used)
    assert list(s.granted) == mine.tolist() and _loadable(svc, ns, [1]) == 0
    assert _put(svc, s, ns, [1], mine)[1].tolist() == [NEW]  # the chunk still works


_PUT_STEPS = st.lists(st.one_of(
    st.tuples(st.just("grant"), st.integers(1, 3), st.sampled_from([BLOCK, 3000])),
    st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 7), st.sampled_from([0, 1, -64, 1 << 30])),
    st.tuples(st.just("pin"), st.integers(0, 9)),
), max_size=40)


def _run_puts(svc: Service, s: Session, ns: int, steps: list[tuple[int | str, ...]]) -> list[object]:
    """Carry out ``steps`` (GRANTs, one-block PUTs into a granted chunk, of a size off by the
    step's amount, or into an offset never granted; PINs); every answer and the state after."""
    out: list[object] = []
    granted: list[tuple[int, int]] = []  # (offset, block size) granted and not used
    for op, *args in steps:
        if op == "grant":
            k, size = args
            granted += [(int(o), size) for o in _grant(svc, s, k, size)]
            out.append(len(granted))
        elif op == "put":
            key, pick, off = args
            at, size = granted[pick % len(granted)] if granted else (0, BLOCK)
            at = at + POOL if off == 1 << 30 else at
            resp, status = _put(svc, s, ns, [key], np.array([at]), [size + off if off != 1 << 30 else size])
            out.append((resp["st"], status.tolist()))
            if status.tolist() == [NEW]:
                granted.remove((at, size))
        else:
            p = svc.store.pin(ns, KeyBatch.from_user([args[0]]))
            svc.store.release(p.handles)
            out.append((p.count, p.offsets.tolist()))
        st_ = svc.store.stats()
        idx = svc.store.index
        counts = svc.metrics.requests
        out.append((st_.bytes_used, st_.pending, st_.granted, st_.ns_bytes, sorted(s.granted.items()),
                    s.granted_bytes, counts.bytes.get("put", 0), counts.save_failed,
                    [getattr(idx, f)[: idx.high_water].tolist()
                     for f in ("w0", "state", "offset", "length", "last_used")]))
    return out


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["lru", "prefix"]), _PUT_STEPS)
def test_a_one_block_put_answers_and_changes_state_as_the_batch_path_does(policy: str, steps: list) -> None:
    runs = []
    for scalar in (True, False):
        svc = Service(BlockStore(POOL, PAGE, eviction=policy), "t", "shm", Metrics())
        svc.store.scalar_paths = scalar
        s, ns = opened(svc)
        runs.append(_run_puts(svc, s, ns, steps))
    assert runs[0] == runs[1]
