"""DROP through ``Service.handle`` in one process: a dropped namespace is found no more by any
session, saves store afresh, and what a load or a save still holds is left alone."""

from __future__ import annotations

import numpy as np

from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.protocol import local
from emsd.service import RETIRED, Service, Session
from emsd.transport.frames import Op, Status
from tests.messages import handled, opened

SIZE = 4096


def _keys(keys: list[int]) -> KeyBatch:
    return KeyBatch.from_user(keys)


def _reserve(svc: Service, s: Session, ns: int, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
    n = len(keys)
    reserve = local.ReserveRequest(ns, _keys(keys), np.full(n, SIZE, np.uint64))
    resp, payload = handled(svc, s, Op.RESERVE, reserve)
    assert resp["st"] == Status.OK
    reserved = local.ReserveAnswer.decode(resp, payload, n)
    return reserved.handles.copy(), reserved.status.copy()


def _commit(svc: Service, s: Session, handles: np.ndarray) -> int:
    resp, payload = handled(svc, s, Op.COMMIT, local.CommitRequest(handles))
    assert resp["st"] == Status.OK
    return local.CommitAnswer.decode(resp, payload, handles.size).committed


def _save(svc: Service, s: Session, ns: int, keys: list[int]) -> np.ndarray:
    handles, status = _reserve(svc, s, ns, keys)
    assert not status.any()  # all NEW
    assert _commit(svc, s, handles) == len(keys)
    return handles


def _exists(svc: Service, s: Session, ns: int, keys: list[int]) -> int:
    resp, payload = handled(svc, s, Op.EXISTS, local.ExistsRequest(ns, _keys(keys)))
    assert resp["st"] == Status.OK
    return local.CountAnswer.decode(resp, payload, len(keys)).held


def _drop(svc: Service, s: Session, ns: int) -> tuple[dict, int]:
    """DROP of ``ns``: the answer's header and, when OK, the blocks it evicted."""
    resp, payload = handled(svc, s, Op.DROP, local.DropRequest(ns))
    return resp, local.DropAnswer.decode(resp, payload).dropped if resp["st"] == Status.OK else 0


def _pin(svc: Service, s: Session, ns: int, keys: list[int]) -> local.PinAnswer:
    resp, payload = handled(svc, s, Op.PIN, local.PinRequest(ns, _keys(keys)))
    assert resp["st"] == Status.OK
    return local.PinAnswer.decode(resp, payload, len(keys))


def test_a_drop_hides_the_blocks_from_every_session_and_saves_store_afresh() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    a, ns = opened(svc)
    b, ns_b = opened(svc)
    other, ns_other = opened(svc, "other")
    assert ns_b == ns
    _save(svc, a, ns, [1, 2, 3])
    _save(svc, other, ns_other, [1, 2, 3])
    resp, dropped = _drop(svc, a, ns)
    assert resp["st"] == Status.OK and dropped == 3
    assert _exists(svc, a, ns, [1, 2, 3]) == 0 and _exists(svc, b, ns, [1]) == 0
    assert _exists(svc, other, ns_other, [1, 2, 3]) == 3  # another namespace is untouched
    _save(svc, b, ns, [1, 2])  # NEW again under the old id: it goes to the name's new one
    c, ns_c = opened(svc)
    assert ns_c != ns and _exists(svc, c, ns_c, [1, 2, 3]) == 2 and _exists(svc, a, ns, [1, 2]) == 2
    stats, _ = svc.handle(a, {"op": int(Op.STATS), "id": 2}, b"")
    assert sorted(stats["namespace_names"]) == ["n", "other"]
    assert stats["evictions"]["dropped"] == 3 and stats["entries"] == 5


def test_pinned_and_pending_blocks_stay_put_but_are_never_found_again() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    _save(svc, s, ns, [1, 2])
    pinned = _pin(svc, s, ns, [1, 2])
    assert len(pinned.handles) == 2
    handles, status = _reserve(svc, s, ns, [7])  # a save under way: reserved, not committed
    resp, dropped = _drop(svc, s, ns)
    assert resp["st"] == Status.OK and dropped == 0  # all held: nothing to evict now
    at = svc.store.index.offset[pinned.handles].astype(np.uint64) * svc.store._unit
    assert (at == pinned.offsets).all()  # the load reads on
    assert _commit(svc, s, handles) == 1
    assert handled(svc, s, Op.RELEASE, local.ReleaseRequest(pinned.handles))[0]["st"] == Status.OK
    assert _exists(svc, s, ns, [1]) == 0 and _exists(svc, s, ns, [7]) == 0
    assert svc.store.stats().entries == 3  # unreachable, evicted when room is needed


def test_dropping_a_namespace_not_opened_is_refused_and_changes_nothing() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    _save(svc, s, ns, [1])
    stranger = Session()
    stranger.authenticated = True
    resp, _ = _drop(svc, stranger, ns)
    assert resp["st"] == Status.INVALID_ARGUMENT and "not opened" in resp["msg"]
    assert handled(svc, s, Op.DROP, local.DropRequest(ns), ns=True)[0]["st"] == Status.INVALID_ARGUMENT
    assert _exists(svc, s, ns, [1]) == 1
    assert svc.drop_namespace("never-opened") == 0


def test_a_restart_never_brings_back_a_dropped_namespace() -> None:
    store = BlockStore(8 << 20, 1 << 20)
    svc = Service(store, "t", "shm", Metrics())
    s, ns = opened(svc)
    _save(svc, s, ns, [1, 2])
    _save(svc, s, ns, [3])
    # What a restart reads back from the ledger: the old id renamed RETIRED, its blocks still
    # there (they were pinned at the drop), and the name under a new id.
    after = Service(store, "t", "shm", Metrics())
    after.restore_namespaces({ns: RETIRED, ns + 1: "n"})
    assert store.stats().entries == 0  # the retired id's blocks are evicted at once
    t, ns_t = opened(after)
    assert ns_t == ns + 1 and _exists(after, t, ns_t, [1]) == 0
    sneaky, ns_sneaky = opened(after, RETIRED)  # the ledger's marker is no way in
    assert _exists(after, sneaky, ns_sneaky, [1]) == 0


def test_a_drain_never_moves_what_is_left_of_a_dropped_namespace() -> None:
    svc = Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics())
    s, ns = opened(svc)
    other, ns_other = opened(svc, "other")
    _save(svc, s, ns, [1, 2])
    kept = _save(svc, other, ns_other, [1])
    pinned = _pin(svc, s, ns, [1, 2])
    assert len(pinned.handles) == 2
    assert sorted(svc.owned_here().tolist()) == sorted([*pinned.handles.tolist(), *kept])
    _drop(svc, s, ns)  # the pinned pair stays READY under the old id
    assert svc.owned_here().tolist() == kept.tolist()
