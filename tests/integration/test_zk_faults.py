"""The ``zk.session`` fault site against a real ZooKeeper: an expired session and a dropped connection.

Each test arms the site on one member (``emsd.membership.zookeeper.FAULTS``),
waits until it has fired once, disarms it, and checks what the other member
saw and that the faulted member is back in the view.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zk  # noqa: E402
from test_membership import ids, info, wait_for  # noqa: E402

from emsd.faults import Faults  # noqa: E402
from emsd.membership import MembershipState  # noqa: E402
from emsd.membership.zookeeper import ZooKeeperMembership  # noqa: E402

pytestmark = pytest.mark.skipif(zk.available() is not None, reason=str(zk.available()))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ZooKeeperMembership, ZooKeeperMembership]]:
    server = zk.ZooKeeperServer(tmp_path / "zk").start()
    a = ZooKeeperMembership(server.hosts, "faults", info("a"), session_timeout=4.0)
    b = ZooKeeperMembership(server.hosts, "faults", info("b"), session_timeout=4.0)
    a.start()
    b.start()
    wait_for(lambda: ids(a) == ["a", "b"] and ids(b) == ["a", "b"])
    yield a, b
    a.stop()
    b.stop()
    server.stop()


def fire_once(m: ZooKeeperMembership, spec: str) -> None:
    """Arm ``spec`` on ``m``'s membership worker until it fires once, then disarm it."""
    faults = Faults.parse(spec)
    m.faults = faults
    wait_for(lambda: faults.fired.get("zk.session", 0) >= 1)
    m.faults = None


def views_of(m: ZooKeeperMembership) -> list[list[str]]:
    seen: list[list[str]] = []
    m.on_change(lambda view: seen.append([n.node_id for n in view]))
    return seen


def session(m: ZooKeeperMembership) -> int:
    return int(m._zk.client_id[0])


def test_an_expired_session_drops_the_node_and_it_rejoins(
        pair: tuple[ZooKeeperMembership, ZooKeeperMembership]) -> None:
    a, b = pair
    seen_by_b = views_of(b)
    before = session(a)
    fire_once(a, "zk.session=error:1.0")
    wait_for(lambda: MembershipState.LOST in a.transitions)
    wait_for(lambda: a.state is MembershipState.JOINED and ids(b) == ["a", "b"] and session(a) != before)
    assert a.transitions[-2:] == [MembershipState.LOST, MembershipState.JOINED]
    # b watched a's znode go (ZooKeeper really ended the session) and come back.
    assert ["b"] in seen_by_b and seen_by_b[-1] == ["a", "b"]
    assert ids(a) == ["a", "b"] and b.state is MembershipState.JOINED


def test_a_dropped_connection_keeps_the_session_and_the_view(
        pair: tuple[ZooKeeperMembership, ZooKeeperMembership]) -> None:
    a, b = pair
    seen_by_b = views_of(b)
    before = session(a)
    fire_once(a, "zk.session=drop:1.0")
    wait_for(lambda: MembershipState.SUSPENDED in a.transitions)
    wait_for(lambda: a.state is MembershipState.JOINED)
    assert session(a) == before  # reconnected to the same session: the znode never went
    assert ["b"] not in seen_by_b and ids(b) == ["a", "b"]
    assert MembershipState.LOST not in a.transitions


def test_a_stalled_worker_delays_but_keeps_membership(
        pair: tuple[ZooKeeperMembership, ZooKeeperMembership]) -> None:
    a, b = pair
    fire_once(a, "zk.session=delay:1.0:1.5")
    assert a.state is MembershipState.JOINED and ids(b) == ["a", "b"]
    b.stop()
    wait_for(lambda: ids(a) == ["a"])  # a's worker resumed and saw b leave
