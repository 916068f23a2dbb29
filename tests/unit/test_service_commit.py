"""RESERVE and COMMIT through ``Service.handle`` in one process: a session commits only
what it reserved, a handle listed twice counts once, and aborts stay apart."""

from __future__ import annotations

from typing import Any

import numpy as np

from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.protocol.local import CommitRequest, ReserveAnswer, ReserveRequest
from emsd.service import Service, Session
from emsd.transport.frames import Op, Status
from tests.messages import handled, opened


def _setup() -> tuple[Service, Session, int]:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    return svc, s, ns


def _reserve(svc: Service, s: Session, ns: int, keys: list[int]) -> np.ndarray:
    n = len(keys)
    resp, payload = handled(svc, s, Op.RESERVE,
                          ReserveRequest(ns, KeyBatch.from_user(keys), np.full(n, 4096, np.uint64)))
    assert resp["st"] == Status.OK
    answer = ReserveAnswer.decode(resp, payload, n)
    assert not answer.status.any()
    return answer.handles.copy()


def _commit(svc: Service, s: Session, commit: np.ndarray, abort: np.ndarray) -> dict[str, Any]:
    return handled(svc, s, Op.COMMIT, CommitRequest(commit.astype(np.uint32), abort.astype(np.uint32)))[0]


def test_a_handle_listed_twice_is_committed_once() -> None:
    svc, s, ns = _setup()
    h = _reserve(svc, s, ns, [1, 2, 3])
    resp = _commit(svc, s, np.array([h[0], h[1], h[0]]), h[2:])
    assert resp["st"] == Status.OK and resp["committed"] == 2
    st = svc.store.stats()
    assert (st.entries, st.pending, st.ns_bytes[ns]) == (2, 0, 2 * 4096)
    assert s.pending == set()


def test_a_handle_in_both_lists_is_committed_and_not_aborted() -> None:
    svc, s, ns = _setup()
    h = _reserve(svc, s, ns, [1])
    assert _commit(svc, s, h, h)["committed"] == 1
    assert svc.store.stats().entries == 1


def test_committing_what_another_session_reserved_is_refused_and_changes_nothing() -> None:
    svc, s, ns = _setup()
    other = Session()
    other.authenticated = True
    other.namespaces.add(ns)
    h = _reserve(svc, other, ns, [1])
    resp = _commit(svc, s, h, h[:0])
    assert resp["st"] == Status.INVALID_ARGUMENT and "not reserved here" in resp["msg"]
    assert svc.store.stats().pending == 1
    assert _commit(svc, other, h, h[:0])["committed"] == 1
