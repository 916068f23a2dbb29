"""Membership against a real ZooKeeper server (Debian's package, started per test)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402 - the fixture helper lives beside the tests
from kazoo.client import KazooClient  # noqa: E402
from kazoo.exceptions import ConnectionLoss  # noqa: E402

from emsd.membership import DuplicateNodeError, MembershipState, NodeInfo, StaticMembership  # noqa: E402
from emsd.membership.zookeeper import ZooKeeperMembership  # noqa: E402

pytestmark = pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))
SESSION = 2.0
# Clients whose start() must reach ZooKeeper in time (to be refused there): kazoo gives the
# connect handshake the session timeout, so a short one fails on a busy machine's slow JVM.
PATIENT = 10.0


@pytest.fixture
def members(zookeeper: zk.ZooKeeperServer) -> Iterator[Callable[..., ZooKeeperMembership]]:
    made: list[ZooKeeperMembership] = []

    def make(node_id: str, start: bool = True, hosts: str | None = None) -> ZooKeeperMembership:
        m = ZooKeeperMembership(hosts or zookeeper.hosts, "test", info(node_id), session_timeout=SESSION)
        made.append(m)
        if start:
            m.start()
        return m

    yield make
    for m in made:
        m.stop()


def info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, f"127.0.0.1:{1000 + len(node_id)}", 4 << 30, 1)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def ids(m: ZooKeeperMembership) -> list[str]:
    return [n.node_id for n in m.members()]


def test_members_see_each_other_and_a_leaver_disappears(members: Callable[..., ZooKeeperMembership]) -> None:
    a, b, c = members("a"), members("b"), members("c")
    for m in (a, b, c):
        wait_for(lambda m=m: ids(m) == ["a", "b", "c"])
        assert m.state is MembershipState.JOINED
    assert {n.node_id: n for n in a.members()}["b"] == info("b")
    c.stop()
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])


def test_change_callbacks_fire(members: Callable[..., ZooKeeperMembership]) -> None:
    a = members("a")
    seen: list[list[str]] = []
    a.on_change(lambda view: seen.append([n.node_id for n in view]))
    members("b")
    wait_for(lambda: ["a", "b"] in seen)


def test_a_duplicate_node_id_is_refused(zookeeper: zk.ZooKeeperServer,
                                        members: Callable[..., ZooKeeperMembership]) -> None:
    members("a")
    twin = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=PATIENT)
    try:
        with pytest.raises(DuplicateNodeError, match="already registered"):
            twin.start(timeout=30)
    finally:
        twin.stop()


def test_a_refused_duplicate_that_stops_leaves_the_live_registration_alone(
        zookeeper: zk.ZooKeeperServer, members: Callable[..., ZooKeeperMembership]) -> None:
    a, b = members("a"), members("b")
    wait_for(lambda: ids(b) == ["a", "b"])
    twin = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=PATIENT)
    with pytest.raises(DuplicateNodeError):
        twin.start(timeout=30)
    twin.stop()  # as the daemon does when it refuses to start
    client = KazooClient(hosts=zookeeper.hosts, timeout=PATIENT)
    client.start(timeout=30)
    try:
        stat = client.exists("/emsd/test/nodes/a")
        assert stat is not None and stat.ephemeralOwner == a._zk.client_id[0]
    finally:
        client.stop()
        client.close()
    time.sleep(0.5)  # a deletion would reach b's watch by now
    assert ids(b) == ["a", "b"]


def test_a_restarted_node_replaces_its_dead_predecessors_registration(
        zookeeper: zk.ZooKeeperServer) -> None:
    old = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=30)
    old.start(timeout=30)  # "killed": its session lives on for 30 s
    try:
        # registered before the others try (a first connect that stalls takes kazoo a whole
        # session timeout to give up on: the join may then finish in the background)
        wait_for(lambda: old.state is MembershipState.JOINED, 90)
        other_endpoint = NodeInfo("a", "127.0.0.1:4242", 4 << 30, 1)
        stranger = ZooKeeperMembership(zookeeper.hosts, "test", other_endpoint, session_timeout=PATIENT,
                                       endpoint_is_mine=True)
        with pytest.raises(DuplicateNodeError):
            stranger.start(timeout=30)  # another endpoint: a different live daemon, refused
        stranger.stop()
        again = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=PATIENT,
                                    endpoint_is_mine=True)
        again.start(timeout=30)  # same endpoint, which the caller has bound: the old process is dead
        try:
            assert again.state is MembershipState.JOINED and ids(again) == ["a"]
        finally:
            again.stop()
    finally:
        old.stop()


def test_a_predecessor_whose_session_ends_mid_registration_is_no_obstacle(
        zookeeper: zk.ZooKeeperServer) -> None:
    """The race a chaos run met (a node restarted after kill -9): the old process's znode is
    there when the new one creates its own, and gone when it reads it (the old session ended
    in between). The new process registers; it used to exit on ``NoNodeError``."""
    old = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=30)
    old.start(timeout=30)
    again = ZooKeeperMembership(zookeeper.hosts, "test", info("a"), session_timeout=PATIENT,
                                endpoint_is_mine=True)
    try:
        wait_for(lambda: old.state is MembershipState.JOINED, 90)
        real_get = again._zk.get
        ended: list[bool] = []

        def get_after_the_old_session_ends(path: str, *args: Any, **kwargs: Any) -> Any:
            if not ended:
                old.stop()  # deletes its znode and closes its session, between create and get
                ended.append(True)
            return real_get(path, *args, **kwargs)

        again._zk.get = get_after_the_old_session_ends  # type: ignore[method-assign]
        again.start(timeout=30)
        assert ended and again.state is MembershipState.JOINED and ids(again) == ["a"]
    finally:
        again.stop()
        old.stop()


def test_zookeeper_down_keeps_the_view_and_rejoin_follows(
        zookeeper: zk.ZooKeeperServer, members: Callable[..., ZooKeeperMembership]) -> None:
    a, b = members("a"), members("b")
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])
    zookeeper.stop()
    wait_for(lambda: a.state is MembershipState.SUSPENDED)
    assert ids(a) == ["a", "b"]  # serving on with the last view
    zookeeper.start()
    wait_for(lambda: a.state is MembershipState.JOINED and b.state is MembershipState.JOINED)
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])
    c = members("c")
    wait_for(lambda: ids(a) == ["a", "b", "c"] and ids(c) == ["a", "b", "c"])


def test_an_expired_session_re_registers(zookeeper: zk.ZooKeeperServer,
                                         members: Callable[..., ZooKeeperMembership]) -> None:
    a, b = members("a"), members("b")
    wait_for(lambda: ids(b) == ["a", "b"])
    # kazoo's own trick: a second client on the same session closes it, which
    # expires the session for the first one (its ephemeral znode goes too).
    twin = KazooClient(hosts=zookeeper.hosts, client_id=a._zk.client_id)
    twin.start(timeout=10)
    twin.stop()
    twin.close()
    wait_for(lambda: MembershipState.LOST in a.transitions)
    wait_for(lambda: a.state is MembershipState.JOINED)
    wait_for(lambda: ids(b) == ["a", "b"] and ids(a) == ["a", "b"])
    assert a._zk.exists(a.path) is not None


def test_start_with_zookeeper_down_returns_and_joins_later(
        zookeeper: zk.ZooKeeperServer, members: Callable[..., ZooKeeperMembership]) -> None:
    zookeeper.stop()
    t0 = time.monotonic()
    a = members("a")
    assert time.monotonic() - t0 < 10
    assert a.state is MembershipState.CONNECTING
    assert ids(a) == ["a"]
    zookeeper.start()
    b = members("b")
    wait_for(lambda: a.state is MembershipState.JOINED)
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])


def test_a_connection_lost_while_joining_does_not_fail_start_and_the_join_completes(
        members: Callable[..., ZooKeeperMembership]) -> None:
    """A heartbeat missed on a busy host drops the connection between start()'s connect and
    its registration (kazoo raises ConnectionLoss from the create): start() returns and the
    worker joins once the connection is back, as it does when ZooKeeper is down at start."""
    a = members("a", start=False)
    create = a._zk.create
    failed: list[str] = []

    def create_once_lost(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == a.path and not failed:
            failed.append(path)
            raise ConnectionLoss()
        return create(path, *args, **kwargs)

    a._zk.create = create_once_lost  # type: ignore[method-assign]
    a.start()  # raised ConnectionLoss before the fix
    assert failed == [a.path]
    wait_for(lambda: a.state is MembershipState.JOINED)
    b = members("b")
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])
    assert a._zk.exists(a.path) is not None


def test_node_info_round_trip_and_malformed_data() -> None:
    n = NodeInfo("x", "10.0.0.1:11000", 1 << 30, 1, {"rdma": {"gid": "fe80::1"}})
    assert NodeInfo.decode(n.encode()) == n
    for bad in (b"", b"\xc1", b"\x93\x01\x02\x03", NodeInfo("x", "p", 1, 1).encode().replace(b"cap", b"cup"),
                b"\x00" * 20000):
        with pytest.raises(ValueError):
            NodeInfo.decode(bad)


def test_static_membership_is_standalone_without_others() -> None:
    alone = StaticMembership(info("solo"))
    alone.start()
    assert alone.state is MembershipState.STANDALONE and ids(alone) == ["solo"]  # type: ignore[arg-type]
    pair = StaticMembership(info("a"), (info("b"),))
    pair.start()
    assert pair.state is MembershipState.JOINED
    with pytest.raises(ValueError):
        StaticMembership(info("a"), (info("a"),))


def test_leaving_logs_no_lost_session(members: Callable[..., ZooKeeperMembership],
                                      caplog: pytest.LogCaptureFixture) -> None:
    """``stop`` closes the session, which kazoo reports as lost: a daemon stopping must not
    warn that it lost its session and will re-register (it did, on every clean stop)."""
    a = members("a")
    wait_for(lambda: a.state is MembershipState.JOINED)
    with caplog.at_level("WARNING", logger="emsd.membership"):
        a.stop()
    assert a.state is MembershipState.LOST
    assert [r.getMessage() for r in caplog.records if r.name == "emsd.membership"] == []
