"""DROP through ``Service.handle`` in one process: a dropped namespace is found no more by any
session, saves store afresh, and what a load or a save still holds is left alone."""

from __future__ import annotations

from typing import Any

import numpy as np

from emsd.metrics import Metrics
from emsd.pool.store import BlockStore
from emsd.service import RETIRED, Service, Session
from emsd.transport.frames import Op, Status

SIZE = 4096


def _session(svc: Service, name: str = "n") -> tuple[Session, int]:
    s = Session()
    s.authenticated = True
    resp, _ = svc.handle(s, {"op": int(Op.NAMESPACE), "name": name, "id": 1}, b"")
    return s, resp["ns"]


def _call(svc: Service, s: Session, op: Op, payload: bytes = b"", **fields: Any) -> tuple[dict, list]:
    return svc.handle(s, {"op": int(op), "id": 2, **fields}, payload)


def _keys(keys: list[int]) -> bytes:
    return np.array(keys, "<u8").tobytes()


def _reserve(svc: Service, s: Session, ns: int, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
    resp, parts = _call(svc, s, Op.RESERVE, _keys(keys) + np.full(len(keys), SIZE, "<u8").tobytes(),
                        ns=ns, n=len(keys), kt=0)
    assert resp["st"] == Status.OK
    return np.frombuffer(parts[1], "<u4").copy(), np.frombuffer(parts[2], np.uint8).copy()


def _save(svc: Service, s: Session, ns: int, keys: list[int]) -> np.ndarray:
    handles, status = _reserve(svc, s, ns, keys)
    assert not status.any()  # all NEW
    resp, _ = _call(svc, s, Op.COMMIT, handles.astype("<u4").tobytes(), c=handles.size, a=0)
    assert resp["committed"] == len(keys)
    return handles


def _exists(svc: Service, s: Session, ns: int, keys: list[int]) -> int:
    resp, _ = _call(svc, s, Op.EXISTS, _keys(keys), ns=ns, n=len(keys), kt=0)
    assert resp["st"] == Status.OK
    return int(resp["count"])


def test_a_drop_hides_the_blocks_from_every_session_and_saves_store_afresh() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    a, ns = _session(svc)
    b, ns_b = _session(svc)
    other, ns_other = _session(svc, "other")
    assert ns_b == ns
    _save(svc, a, ns, [1, 2, 3])
    _save(svc, other, ns_other, [1, 2, 3])
    resp, _ = _call(svc, a, Op.DROP, ns=ns)
    assert resp["st"] == Status.OK and resp["dropped"] == 3
    assert _exists(svc, a, ns, [1, 2, 3]) == 0 and _exists(svc, b, ns, [1]) == 0
    assert _exists(svc, other, ns_other, [1, 2, 3]) == 3  # another namespace is untouched
    _save(svc, b, ns, [1, 2])  # NEW again under the old id: it goes to the name's new one
    c, ns_c = _session(svc)
    assert ns_c != ns and _exists(svc, c, ns_c, [1, 2, 3]) == 2 and _exists(svc, a, ns, [1, 2]) == 2
    stats, _ = _call(svc, a, Op.STATS)
    assert sorted(stats["namespace_names"]) == ["n", "other"]
    assert stats["evictions"]["dropped"] == 3 and stats["entries"] == 5


def test_pinned_and_pending_blocks_stay_put_but_are_never_found_again() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = _session(svc)
    _save(svc, s, ns, [1, 2])
    resp, parts = _call(svc, s, Op.PIN, _keys([1, 2]), ns=ns, n=2, kt=0)
    assert resp["count"] == 2
    offsets, pinned = np.frombuffer(parts[0], "<u8"), parts[2]
    handles, status = _reserve(svc, s, ns, [7])  # a save under way: reserved, not committed
    assert _call(svc, s, Op.DROP, ns=ns)[0]["dropped"] == 0  # all held: nothing to evict now
    idx = svc.store.index
    ids = np.frombuffer(pinned, "<u4")
    assert (idx.offset[ids].astype(np.uint64) * svc.store._unit == offsets).all()  # the load reads on
    assert _call(svc, s, Op.COMMIT, handles.astype("<u4").tobytes(), c=1, a=0)[0]["committed"] == 1
    assert _call(svc, s, Op.RELEASE, pinned)[0]["st"] == Status.OK
    assert _exists(svc, s, ns, [1]) == 0 and _exists(svc, s, ns, [7]) == 0
    assert svc.store.stats().entries == 3  # unreachable, evicted when room is needed


def test_dropping_a_namespace_not_opened_is_refused_and_changes_nothing() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = _session(svc)
    _save(svc, s, ns, [1])
    stranger = Session()
    stranger.authenticated = True
    resp, _ = _call(svc, stranger, Op.DROP, ns=ns)
    assert resp["st"] == Status.INVALID_ARGUMENT and "not opened" in resp["msg"]
    assert _call(svc, s, Op.DROP, ns=True)[0]["st"] == Status.INVALID_ARGUMENT
    assert _exists(svc, s, ns, [1]) == 1
    assert svc.drop_namespace("never-opened") == 0


def test_a_restart_never_brings_back_a_dropped_namespace() -> None:
    store = BlockStore(8 << 20, 1 << 20)
    svc = Service(store, "t", "shm", Metrics())
    s, ns = _session(svc)
    _save(svc, s, ns, [1, 2])
    _save(svc, s, ns, [3])
    # What a restart reads back from the ledger: the old id renamed RETIRED, its blocks still
    # there (they were pinned at the drop), and the name under a new id.
    after = Service(store, "t", "shm", Metrics())
    after.restore_namespaces({ns: RETIRED, ns + 1: "n"})
    assert store.stats().entries == 0  # the retired id's blocks are evicted at once
    t, ns_t = _session(after)
    assert ns_t == ns + 1 and _exists(after, t, ns_t, [1]) == 0
    sneaky, ns_sneaky = _session(after, RETIRED)  # the ledger's marker is no way in
    assert _exists(after, sneaky, ns_sneaky, [1]) == 0


def test_a_drain_never_moves_what_is_left_of_a_dropped_namespace() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = _session(svc)
    other, ns_other = _session(svc, "other")
    _save(svc, s, ns, [1, 2])
    kept = _save(svc, other, ns_other, [1])
    resp, parts = _call(svc, s, Op.PIN, _keys([1, 2]), ns=ns, n=2, kt=0)
    assert resp["count"] == 2
    assert sorted(svc.owned_here().tolist()) == sorted([*np.frombuffer(parts[2], "<u4").tolist(), *kept])
    _call(svc, s, Op.DROP, ns=ns)  # the pinned pair stays READY under the old id
    assert svc.owned_here().tolist() == kept.tolist()
