"""The work with other nodes as data: what ``Service`` returns (``emsd.effects``) and what the
coordinator does with it (``emsd.remote``), on a pool in this process with a fake cluster.

The fake stands in for ``Cluster`` where the service and ``Remote`` reach it: it owns every
key (this node owns none), records what is pushed and answers as told.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from emsd.coordinator import Coordinator
from emsd.effects import AskOwners, Drain, DropElsewhere, Fetch, Forward, Promote, RefreshOwners
from emsd.membership.base import MembershipState
from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.protocol import local
from emsd.service import Response, Service, Session
from emsd.transport.frames import Op, Status
from tests.messages import handled, opened, request

POOL, PAGE, BLOCK = 8 << 20, 1 << 20, 4096


class FakePlacement:
    def owned_here(self, _name: str, keys: KeyBatch) -> np.ndarray:
        return np.zeros(len(keys), dtype=bool)

    lonely = False  # True: the view holds this node only (the others left)

    def alone(self) -> bool:
        return self.lonely


class FakeCluster:
    """Owns every key elsewhere; ``fail``: every push raises; ``fetch`` stores the keys here."""

    shares_placement = True
    state = MembershipState.JOINED

    def __init__(self, svc: Service, fail: bool = False) -> None:
        self.svc = svc
        self.fail = fail
        self.placement = FakePlacement()
        self.pushed: list[tuple[str, list[int]]] = []

    async def push(self, name: str, keys: KeyBatch, _offsets: np.ndarray, _lengths: np.ndarray,
                   _deadline: float) -> np.ndarray:
        if self.fail:
            raise ConnectionError("peer gone")
        self.pushed.append((name, [int(k) for k in keys.words[:, 0]]))
        return np.ones(len(keys), dtype=bool)

    async def fetch(self, name: str, keys: KeyBatch, _deadline: float) -> np.ndarray:
        store, ns = self.svc.store, self.svc.namespace_id(name)
        res = store.reserve(ns, keys, np.full(len(keys), BLOCK, dtype=np.uint64))
        store.commit_reserved(res.handles)
        return np.ones(len(keys), dtype=bool)  # all owned elsewhere

    async def exists(self, _name: str, keys: KeyBatch, _here: np.ndarray, _deadline: float) -> int:
        return len(keys)


def _service(cluster: bool = True, fail: bool = False) -> tuple[Service, Session, int]:
    svc = Service(BlockStore(POOL, PAGE), "t", "shm", Metrics())
    if cluster:
        svc.cluster = FakeCluster(svc, fail)  # type: ignore[assignment]
    s, ns = opened(svc)
    return svc, s, ns


def _keys(keys: list[int]) -> KeyBatch:
    return KeyBatch.from_user(keys)


def _sizes(n: int) -> np.ndarray:
    return np.full(n, BLOCK, dtype=np.uint64)


def _put(svc: Service, s: Session, ns: int, keys: list[int], wr: bool = True) -> tuple[dict[str, Any], bytes]:
    """A PUT of ``keys`` into chunks granted now (not sent yet): its header and payload."""
    n = len(keys)
    at = local.GrantAnswer.decode(*handled(svc, s, Op.GRANT, local.GrantRequest(BLOCK, n)), n).offsets
    return request(Op.PUT, local.PutRequest(ns, _keys(keys), at, _sizes(n), wr=wr))


def _save(svc: Service, ns: int, keys: list[int]) -> np.ndarray:
    res = svc.store.reserve(ns, KeyBatch.from_user(keys), np.full(len(keys), BLOCK, dtype=np.uint64))
    svc.store.commit_reserved(res.handles)
    return res.handles


def _served(coord: Coordinator, s: Session, header: dict[str, Any], payload: bytes) -> Response:
    async def main() -> Response:
        answer = coord.serve(s, header, payload)
        return answer if isinstance(answer, tuple) else await answer

    return asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3])
def test_a_put_in_a_cluster_names_the_forward_of_the_blocks_it_committed(n: int) -> None:
    svc, s, ns = _service()
    resp, parts, effects = svc.serve_sync(s, *_put(svc, s, ns, list(range(10, 10 + n)), wr=False))
    assert resp["st"] == Status.OK
    assert local.PutAnswer.decode(resp, b"".join(parts), n).reached == bytes(n)  # none until the forward says
    assert len(effects) == 1 and isinstance(effects[0], Forward)
    forward = effects[0]
    committed = svc.store.index.find(ns, KeyBatch.from_user(list(range(10, 10 + n))))
    assert forward.handles.tolist() == committed.tolist() and forward.keep is False


def test_a_commit_in_a_cluster_names_the_forward_of_its_committed_handles_only() -> None:
    svc, s, ns = _service()
    reserve = local.ReserveRequest(ns, _keys([1, 2, 3]), _sizes(3))
    handles = local.ReserveAnswer.decode(*handled(svc, s, Op.RESERVE, reserve), 3).handles
    commit = local.CommitRequest(handles[:2], handles[2:], to=1000)
    resp, _, effects = svc.serve_sync(s, *request(Op.COMMIT, commit))
    assert local.CommitAnswer.decode(resp, b"", 2) == local.CommitAnswer(2, b"\0\0")
    (forward,) = effects
    assert isinstance(forward, Forward) and forward.handles.tolist() == handles[:2].tolist()
    assert forward.keep is True and forward.budget == pytest.approx(0.9)


def test_a_commit_listing_a_handle_twice_answers_a_reached_per_handle_listed() -> None:
    svc, s, ns = _service()
    reserve = local.ReserveRequest(ns, _keys([1, 2]), _sizes(2))
    handles = local.ReserveAnswer.decode(*handled(svc, s, Op.RESERVE, reserve), 2).handles
    listed = np.array([handles[0], handles[0], handles[1]], dtype=np.uint32)
    resp, _, _ = svc.serve_sync(s, *request(Op.COMMIT, local.CommitRequest(listed)))
    assert local.CommitAnswer.decode(resp, b"", 3) == local.CommitAnswer(2, b"\0\0\0")  # decodes


def test_a_pin_of_absent_keys_names_a_fetch_of_the_missing_tail() -> None:
    svc, s, ns = _service()
    _save(svc, ns, [1])
    fetch = svc.before(s, *request(Op.PIN, local.PinRequest(ns, _keys([1, 2, 3]), wr=False)))
    assert isinstance(fetch, Fetch) and fetch.keep is False and fetch.ns == ns
    assert fetch.keys.words[:, 0].tolist() == [2, 3]
    here_only = local.PinRequest(ns, _keys([1, 2, 3]), lo=True, wr=False)
    assert svc.before(s, *request(Op.PIN, here_only)) is None  # read_local_only
    assert svc.before(s, *request(Op.PIN, local.PinRequest(ns, _keys([1]), wr=False))) is None  # all here


def test_an_exists_in_a_cluster_asks_the_owners_of_what_is_not_here() -> None:
    svc, s, ns = _service()
    _save(svc, ns, [1])
    resp, _, effects = svc.serve_sync(s, *request(Op.EXISTS, local.ExistsRequest(ns, _keys([1, 2]))))
    (ask,) = effects
    assert local.CountAnswer.decode(resp, b"", 2).held == 1 and isinstance(ask, AskOwners)
    assert ask.name == "n" and ask.here.tolist() == [True, False]
    assert svc.serve_sync(s, *request(Op.EXISTS, local.ExistsRequest(ns, _keys([1, 2]), lo=True)))[2] == ()
    assert svc.serve_sync(s, *request(Op.EXISTS, local.ExistsRequest(ns, _keys([1]))))[2] == ()


def test_a_save_of_read_cache_copies_names_a_check_with_their_owners() -> None:
    svc, s, ns = _service()
    _save(svc, ns, [5])
    svc.store.mark_cached(ns, KeyBatch.from_user([5]))
    reserve = local.ReserveRequest(ns, _keys([5, 6]), _sizes(2))
    resp, _, effects = svc.serve_sync(s, *request(Op.RESERVE, reserve))
    (refresh,) = effects
    assert isinstance(refresh, RefreshOwners) and refresh.keys.words[:, 0].tolist() == [5]


def test_drop_and_drain_in_a_cluster_name_the_other_members() -> None:
    svc, s, ns = _service()
    _, _, effects = svc.serve_sync(s, *request(Op.DROP, local.DropRequest(ns)))
    assert effects == (DropElsewhere("n", pytest.approx(4.9)),)
    _, _, effects = svc.serve_sync(s, {"op": int(Op.DRAIN), "to": 2000}, b"")
    assert effects == (Drain(pytest.approx(1.9)),)


def test_a_standalone_service_names_no_work_and_is_answered_at_once() -> None:
    svc, s, ns = _service(cluster=False)
    resp, _, effects = svc.serve_sync(s, *_put(svc, s, ns, [1]))
    assert effects == () and "reached" not in resp
    assert svc.before(s, *request(Op.PIN, local.PinRequest(ns, _keys([9])))) is None
    assert svc.serve_sync(s, *request(Op.EXISTS, local.ExistsRequest(ns, _keys([9]))))[2] == ()
    header, payload = _put(svc, s, ns, [2])
    assert isinstance(Coordinator(svc).serve(s, header, payload), tuple)  # no task, no await


def test_a_node_alone_in_its_cluster_names_no_work_as_a_standalone_one() -> None:
    svc, s, ns = _service()
    svc.cluster.placement.lonely = True  # type: ignore[union-attr]
    resp, _, effects = svc.serve_sync(s, *_put(svc, s, ns, [1]))
    assert resp["st"] == Status.OK and effects == () and "reached" not in resp
    assert svc.before(s, *request(Op.PIN, local.PinRequest(ns, _keys([9])))) is None
    assert svc.serve_sync(s, *request(Op.EXISTS, local.ExistsRequest(ns, _keys([9]))))[2] == ()
    svc.cluster.placement.lonely = False  # type: ignore[union-attr]
    assert svc.serve_sync(s, *_put(svc, s, ns, [2]))[2] != ()


def test_a_standalone_service_is_a_cluster_of_itself() -> None:
    svc, s, _ = _service(cluster=False)
    stats, _ = svc.handle(s, {"op": int(Op.STATS), "id": 2}, b"")
    assert stats["membership"] == "standalone" and stats["members"] == ["t"]
    assert stats["view"] == [{"id": "t", "capacity": POOL, "peer": ""}] and stats["share"] == {"t": 1.0}
    owners = local.OwnerAnswer.decode(*handled(svc, s, Op.OWNER, local.OwnerRequest("n", _keys([1, 2]))), 2)
    assert owners.owners == [["t"], ["t"]]
    refused, _ = svc.handle(s, {"op": int(Op.DRAIN), "id": 4}, b"")
    assert refused["st"] == Status.INVALID_ARGUMENT


def test_an_error_answer_names_no_work() -> None:
    svc, s, ns = _service()
    not_reserved = local.CommitRequest(np.zeros(1, dtype=np.uint32))
    resp, _, effects = svc.serve_sync(s, *request(Op.COMMIT, not_reserved))
    assert resp["st"] == Status.INVALID_ARGUMENT and effects == ()


def test_the_coordinator_merges_the_forwards_result_into_the_answer() -> None:
    svc, s, ns = _service()
    header, payload = _put(svc, s, ns, [20, 21])
    resp, parts = _served(Coordinator(svc), s, {**header, "id": 7}, payload)
    assert resp["st"] == Status.OK and resp["id"] == 7
    assert local.PutAnswer.decode(resp, b"".join(parts), 2).reached == b"\1\1"
    assert svc.cluster.pushed == [("n", [20, 21])]  # type: ignore[union-attr]
    assert svc.store.index.cached[svc.store.index.find(ns, KeyBatch.from_user([20]))].tolist() == [1]


def test_peers_failing_leave_the_answer_as_the_handler_made_it() -> None:
    svc, s, ns = _service(fail=True)
    header, payload = _put(svc, s, ns, [30])
    resp, parts = _served(Coordinator(svc), s, header, payload)
    assert resp["st"] == Status.OK and local.PutAnswer.decode(resp, b"".join(parts), 1).reached == b"\0"
    assert svc.store.stats().pinned == 0  # released after the failed push


def test_copies_fetched_with_wr_off_stay_only_while_the_pin_holds_them() -> None:
    svc, s, ns = _service()
    pin = local.PinRequest(ns, _keys([40, 41]), wr=False, to=1000)
    resp, parts = _served(Coordinator(svc), s, *request(Op.PIN, pin))
    handles = local.PinAnswer.decode(resp, b"".join(parts), 2).handles
    assert len(handles) == 2 and s.transient == set(handles.tolist())
    handled(svc, s, Op.RELEASE, local.ReleaseRequest(handles))
    assert svc.store.exists(ns, KeyBatch.from_user([40, 41])) == 0 and not s.transient


def test_the_session_carries_no_data_between_a_handler_and_its_work() -> None:
    assert not {"put", "copies", "fetched"} & set(Session.__dataclass_fields__)


class ShortCluster(FakeCluster):
    """Its owners hold the first ``held`` keys of a fetch; of those, the first ``room`` find room
    here (``reserve_arriving``, as a GET's blocks do) and the rest are refused."""

    def __init__(self, svc: Service, held: int, room: int) -> None:
        super().__init__(svc)
        self.held, self.room = held, room

    async def fetch(self, name: str, keys: KeyBatch, _deadline: float) -> np.ndarray:
        ns, sent = self.svc.namespace_id(name), min(self.held, len(keys))
        res = self.svc.reserve_arriving(ns, keys.take(slice(0, sent)), _sizes(sent), copy=True)
        if sent > self.room:  # what the pool refuses: the same status a full read-cache room gives
            self.svc.store.abort(res.handles[self.room :])
            res.status[self.room :] = 2
            self.svc.copies_refused += sent - self.room
        self.svc.commit_arrived(res.handles[: min(sent, self.room)])
        return np.ones(len(keys), dtype=bool)


@pytest.mark.parametrize(("held", "room", "count", "more"), [
    (4, 4, 4, False),  # all found, all stored: a whole answer
    (2, 4, 2, False),  # the owners lack the rest: a miss ends the load
    (4, 2, 2, True),  # stored two, refused two for room: ask again for the rest
])
def test_a_pin_says_more_only_when_what_it_fetched_found_no_room(held: int, room: int, count: int,
                                                                 more: bool) -> None:
    svc, s, ns = _service()
    svc.cluster = ShortCluster(svc, held, room)  # type: ignore[assignment]
    pin = local.PinRequest(ns, _keys([60, 61, 62, 63]), to=1000)
    resp, parts = _served(Coordinator(svc), s, *request(Op.PIN, pin))
    answer = local.PinAnswer.decode(resp, b"".join(parts), 4)
    assert (len(answer.handles), answer.more) == (count, more)


class AskedCluster(FakeCluster):
    """Its owners hold every key but those ``nowhere``; records the keys of each fetch."""

    def __init__(self, svc: Service, nowhere: set[int]) -> None:
        super().__init__(svc)
        self.nowhere, self.asked = nowhere, list[list[int]]()

    async def fetch(self, name: str, keys: KeyBatch, deadline: float) -> np.ndarray:
        asked = [int(k) for k in keys.words[:, 0]]
        self.asked.append(asked)
        held = next((i for i, k in enumerate(asked) if k in self.nowhere), len(asked))
        if held:
            await super().fetch(name, keys.take(slice(0, held)), deadline)
        return np.ones(len(keys), dtype=bool)


@pytest.mark.parametrize(("here", "nowhere", "bring", "asked", "count", "more"), [
    ([1, 2], set(), 2, [[3, 4]], 4, True),  # brought two: ask again for the rest
    ([1, 2, 5], set(), 2, [[3, 4]], 5, True),  # and pinned the next one, here already
    ([1, 2], {4}, 2, [[3, 4]], 3, False),  # a key that is nowhere, within the bound: the end
    ([1, 2, 3, 4, 5, 6], set(), 2, [], 6, False),  # all here: pinned however many
    ([1, 2], set(), None, [[3, 4, 5, 6]], 6, False),  # no bound
])
def test_a_pin_brings_at_most_its_bring_here_and_says_more_when_it_stopped_there(
        here: list[int], nowhere: set[int], bring: int | None, asked: list[list[int]], count: int,
        more: bool) -> None:
    svc, s, ns = _service()
    svc.cluster = cluster = AskedCluster(svc, nowhere)  # type: ignore[assignment]
    _save(svc, ns, here)
    pin = local.PinRequest(ns, _keys([1, 2, 3, 4, 5, 6]), to=1000, bring=bring)
    resp, parts = _served(Coordinator(svc), s, *request(Op.PIN, pin))
    answer = local.PinAnswer.decode(resp, b"".join(parts), 6)
    assert (cluster.asked, len(answer.handles), answer.more) == (asked, count, more)


def test_a_pins_promotion_from_the_disk_tier_is_bounded_by_its_bring_too() -> None:
    svc, s, ns = _service()
    _save(svc, ns, [1])
    svc.tiers = SimpleNamespace(wanted=lambda *_: True)  # type: ignore[assignment]
    pin = local.PinRequest(ns, _keys([1, 2, 3, 4, 5]), bring=2)
    promote = svc.before(s, *request(Op.PIN, pin))
    assert isinstance(promote, Promote) and (promote.count, promote.upto) == (1, 3)
    assert promote.keys.words[:, 0].tolist() == [1, 2, 3]


def test_reserve_arriving_counts_the_copies_it_refuses() -> None:
    svc, s, ns = _service()
    svc.store.copy_floor = 0  # copies may take no owned room: a pool full of owned blocks refuses them
    fill = svc.store.reserve(ns, _keys(list(range(10_000, 10_000 + POOL // BLOCK + 1))),
                             _sizes(POOL // BLOCK + 1))
    svc.store.commit_reserved(fill.handles[fill.status == 0])
    assert (fill.status == 2).any()  # the pool is full of owned blocks
    res = svc.reserve_arriving(ns, _keys([1, 2]), _sizes(2), copy=True)
    assert res.status.tolist() == [2, 2] and svc.copies_refused == 2
    assert svc.refusals() == 2  # no disk tier: the copies alone
    svc.abort_arriving(res.handles[res.status == 0])
