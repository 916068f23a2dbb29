"""Who may change the cluster (``Service.operator``): DRAIN and PLACEMENT, and the operator
session a daemon of tenants only gives emsctl, decided by the tenant and SO_PEERCRED's uid."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emsd.metrics import Metrics
from emsd.pool.store import BlockStore
from emsd.service import OPERATOR_OPS, OPERATOR_SESSION_OPS, RequestError, Service, Session
from emsd.tenants import Tenant, Tenants
from emsd.transport.frames import Op, Status

KEY = "K" * 44
ME = os.geteuid()
OTHER = ME + 4242 if ME else 4242  # neither root nor the daemon's user


def _service(tenants: bool, allow_default: bool = False) -> Service:
    t = Tenants([Tenant("team-a", KEY, None)] if tenants else [], allow_default)
    return Service(BlockStore(8 << 20, 1 << 20), "t", "shm", Metrics(), t)


def _session(svc: Service, uid: int, hello: dict[str, object]) -> Session:
    session = Session(peer_uid=uid)
    svc.hello(session, {"op": int(Op.HELLO), "id": 1, **hello})
    return session


def _refusal(svc: Service, session: Session, op: Op) -> str | None:
    """The message of ``op``'s refusal, or None if it got past the operator checks."""
    resp, _, _ = svc.serve_sync(session, {"op": int(op), "id": 2}, b"")
    msg = str(resp.get("msg", ""))
    if resp["st"] == Status.INVALID_ARGUMENT and ("operator" in msg):
        return msg
    return None


@given(st.sampled_from([0, ME, OTHER]), st.booleans())
def test_without_tenants_every_client_is_the_operator(uid: int, operator_hello: bool) -> None:
    svc = _service(tenants=False)
    session = _session(svc, uid, {"operator": True} if operator_hello else {})
    assert svc.operator(session) and not session.operator_only


@pytest.mark.parametrize("uid", [0, ME, OTHER])
def test_a_tenants_connection_is_never_the_operator(uid: int) -> None:
    svc = _service(tenants=True, allow_default=True)
    session = _session(svc, uid, {"access_id": "team-a", "access_key": KEY})
    assert not svc.operator(session)
    for op in OPERATOR_OPS:
        assert "is the operator's" in (_refusal(svc, session, op) or "")


def test_the_default_tenant_is_the_operator_only_from_root_or_the_daemons_user() -> None:
    svc = _service(tenants=True, allow_default=True)
    assert svc.operator(_session(svc, ME, {}))
    assert not svc.operator(_session(svc, OTHER, {}))
    assert _refusal(svc, _session(svc, OTHER, {}), Op.DRAIN) is not None


def test_a_daemon_of_tenants_only_gives_an_operator_session_to_emsctl_of_its_own_user() -> None:
    svc = _service(tenants=True)
    with pytest.raises(RequestError):  # the SDK without a tenant: refused as before
        _session(svc, ME, {})
    with pytest.raises(RequestError):  # emsctl of another user
        _session(svc, OTHER, {"operator": True})
    session = _session(svc, ME, {"operator": True})
    assert session.operator_only and svc.operator(session)
    for op in (Op.NAMESPACE, Op.RESERVE, Op.PIN, Op.DROP, Op.GRANT, Op.PUT, Op.EXISTS):
        assert op not in OPERATOR_SESSION_OPS
        assert "only run operator commands" in (_refusal(svc, session, op) or "")
    for op in OPERATOR_SESSION_OPS:
        assert _refusal(svc, session, op) is None
