"""Quotas and the per-connection bound count uncommitted bytes (issue 25 item 3), through
``Service.handle`` in one process: random RESERVE, COMMIT, abort, GRANT, PUT and closes of
several connections of two tenants (one with a quota) keep the books exact and the bounds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.protocol.local import (
    CommitRequest,
    GrantAnswer,
    GrantRequest,
    NamespaceAnswer,
    NamespaceRequest,
    PutAnswer,
    PutRequest,
    ReserveAnswer,
    ReserveRequest,
)
from emsd.service import Service, Session
from emsd.tenants import Tenant, Tenants
from emsd.transport.frames import Op, Status
from tests.messages import Message, handled

POOL, PAGE, BLOCK = 8 << 20, 1 << 20, 64 << 10
QUOTA = 1 << 20
KEYS = {"q": "Q" * 44, "free": "F" * 44}
CAP = 2 << 20  # connection_uncommitted

ops = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "abort", "grant", "put", "close"]),
                         st.integers(0, 3),  # which connection
                         st.integers(1, 12)),  # how many blocks
               min_size=1, max_size=60)


def _service() -> Service:
    tenants = Tenants([Tenant("q", KEYS["q"], QUOTA), Tenant("free", KEYS["free"], None)])
    svc = Service(BlockStore(POOL, PAGE), "t", "shm", Metrics(), tenants)
    svc.connection_uncommitted = CAP
    return svc


class Conn:
    def __init__(self, svc: Service, tenant: str) -> None:
        self.svc, self.s = svc, Session()
        svc.hello(self.s, {"op": int(Op.HELLO), "access_id": tenant, "access_key": KEYS[tenant]})
        self.ns = NamespaceAnswer.decode(*self.call(Op.NAMESPACE, NamespaceRequest("m"))).ns
        self.held: list[int] = []  # handles reserved, not ended
        self.chunks: list[int] = []  # granted offsets, not used

    def call(self, op: Op, message: Message) -> tuple[dict, bytes]:
        resp, payload = handled(self.svc, self.s, op, message)
        assert resp["st"] == Status.OK, resp
        return resp, payload


def _step(c: Conn, kind: str, n: int, key: int) -> int:
    keys, sizes = np.arange(key, key + n, dtype=np.uint64), np.full(n, BLOCK, np.uint64)
    if kind == "reserve":
        reserve = ReserveRequest(c.ns, KeyBatch.from_ints(keys), sizes)
        reserved = ReserveAnswer.decode(*c.call(Op.RESERVE, reserve), n)
        c.held += reserved.handles[reserved.status == 0].tolist()
    elif kind in ("commit", "abort") and c.held:
        hs, c.held = np.array(c.held[:n], np.uint32), c.held[n:]
        none = np.zeros(0, np.uint32)
        c.call(Op.COMMIT, CommitRequest(hs, none) if kind == "commit" else CommitRequest(none, hs))
    elif kind == "grant":
        c.chunks += GrantAnswer.decode(*c.call(Op.GRANT, GrantRequest(BLOCK, n)), n).offsets.tolist()
    elif kind == "put" and c.chunks:
        at, c.chunks = c.chunks[:n], c.chunks[n:]
        m = len(at)
        put = PutRequest(c.ns, KeyBatch.from_ints(keys[:m]), np.array(at, np.uint64), sizes[:m])
        status = PutAnswer.decode(*c.call(Op.PUT, put), m).status
        c.chunks += [o for o, st_ in zip(at, status.tolist(), strict=True) if st_]
    return key + n


@settings(max_examples=60, deadline=None)
@given(ops)
def test_uncommitted_books_stay_exact_and_bounds_hold(steps: list[tuple[str, int, int]]) -> None:
    svc = _service()
    tenant_of = ["q", "q", "free", "free"]
    conns = [Conn(svc, t) for t in tenant_of]
    key = 0
    for kind, i, n in steps:
        if kind == "close":
            svc.close(conns[i].s)
            conns[i] = Conn(svc, tenant_of[i])
            continue
        key = _step(conns[i], kind, n, key)
        idx = svc.store.index
        for c in conns:  # each connection's own books, and its bound
            assert c.s.pending_bytes == int(idx.length[np.array(sorted(c.s.pending), dtype=np.int64)].sum())
            assert c.s.uncommitted <= CAP
        for t in ("q", "free"):  # each tenant's total is its connections' sum
            assert svc.quotas.uncommitted.get(t, 0) == sum(c.s.uncommitted for c in conns if c.s.tenant == t)
        assert svc.quotas.held("q") <= QUOTA
    for c in conns:
        svc.close(c.s)
    assert svc.quotas.uncommitted == {}
    st_ = svc.store.stats()
    assert st_.pending == 0 and st_.granted == 0
