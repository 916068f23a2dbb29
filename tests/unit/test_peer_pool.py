"""``emsd.transport.pool.PeerPool``: links per peer, round robin, a retry on a fresh link, backoff.

The links are scripted in-process objects with the ``PeerLink`` calls the pool
uses (``connect``, ``close``, ``closed``, and one request); the pool's use of
real TCP links is covered by tests/sim/test_cluster_links.py and the cluster
integration tests.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from emsd.transport.peer import PeerError
from emsd.transport.pool import PeerPool


class Link:
    """A link whose requests answer as asked until it is in ``world.broken``."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.closed = False
        self.requests = 0
        world.dialed.append(self)

    async def connect(self, host: str, port: int, timeout: float = 5.0) -> None:
        await asyncio.sleep(0)
        if self.world.unreachable:
            raise PeerError("connection refused")
        self.addr = (host, port)

    async def request(self, answer: int) -> int:
        await asyncio.sleep(0.001)
        self.requests += 1
        if self in self.world.broken:
            self.close()
            raise PeerError("connection reset")
        return answer

    def close(self) -> None:
        self.closed = True


class World:
    def __init__(self) -> None:
        self.dialed: list[Link] = []
        self.broken: set[Link] = set()
        self.unreachable = False
        self.members = {"b": "10.0.0.2:7000"}

    def pool(self, size: int) -> PeerPool:
        return PeerPool(lambda: Link(self), self.members.get, size)  # type: ignore[arg-type, return-value]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_parallel_requests_open_at_most_size_links_and_share_them_round_robin() -> None:
    world = World()

    async def main() -> list[int]:
        pool = world.pool(size=2)
        return await asyncio.gather(*(pool.call("b", "get", lambda c: c.request(3)) for _ in range(10)))

    assert run(main()) == [3] * 10
    assert len(world.dialed) == 2
    assert [link.addr for link in world.dialed] == [("10.0.0.2", 7000)] * 2
    assert all(link.requests >= 4 for link in world.dialed)  # 10 requests over 2 links, round robin


def test_a_stale_pooled_link_is_replaced_by_a_fresh_one_and_the_peer_stays_up() -> None:
    world = World()

    async def main() -> tuple[int, PeerPool]:
        pool = world.pool(size=1)
        assert await pool.call("b", "get", lambda c: c.request(1)) == 1
        world.broken.add(world.dialed[0])  # the peer restarted: the pooled link is dead
        return await pool.call("b", "get", lambda c: c.request(2)), pool

    got, pool = run(main())
    assert got == 2
    assert len(world.dialed) == 2 and world.dialed[0].closed and not world.dialed[1].closed
    assert pool.down == set()


def test_a_fresh_link_that_fails_backs_the_peer_off() -> None:
    world = World()

    async def main() -> tuple[int, int, PeerPool]:
        pool = world.pool(size=1)
        task = asyncio.ensure_future(pool.call("b", "get", lambda c: c.request(1)))
        while not world.dialed:  # break the link as soon as it is dialed
            await asyncio.sleep(0)
        world.broken.add(world.dialed[0])
        failed = await task
        again = await pool.call("b", "get", lambda c: c.request(1))  # within BACKOFF: not even dialed
        return failed, again, pool

    failed, again, pool = run(main())
    assert (failed, again) == (0, 0)
    assert len(world.dialed) == 1
    assert pool.down == {"b"}


def test_an_unreachable_peer_or_one_outside_the_view_costs_zero_not_an_error() -> None:
    world = World()
    world.unreachable = True

    async def main() -> tuple[int, int, PeerPool]:
        pool = world.pool(size=1)
        return (await pool.call("b", "get", lambda c: c.request(1)),
                await pool.call("gone", "get", lambda c: c.request(1)), pool)

    refused, gone, pool = run(main())
    assert (refused, gone) == (0, 0)
    assert len(world.dialed) == 1  # "gone" has no address: never dialed
    assert pool.down == {"b"}


def test_retain_closes_the_links_of_departed_nodes_only() -> None:
    world = World()
    world.members["c"] = "10.0.0.3:7000"

    async def main() -> tuple[list[str], PeerPool]:
        pool = world.pool(size=1)
        await pool.call("b", "get", lambda c: c.request(1))
        await pool.call("c", "get", lambda c: c.request(1))
        return pool.retain({"a", "c"}), pool

    gone, pool = run(main())
    assert gone == ["b"]
    by_addr = {link.addr[0]: link for link in world.dialed}
    assert by_addr["10.0.0.2"].closed and not by_addr["10.0.0.3"].closed
    pool.close()
    assert by_addr["10.0.0.3"].closed


@pytest.mark.parametrize("answer", [0, 5])
def test_metrics_count_what_moved_and_nothing_for_an_empty_answer(answer: int) -> None:
    world = World()
    seen: list[tuple[str, str, int, int, bool]] = []

    class Counted:
        def peer(self, node: str, op: str, blocks: int, nbytes: int, ok: bool) -> None:
            seen.append((node, op, blocks, nbytes, ok))

    async def main() -> int:
        pool = PeerPool(lambda: Link(world), world.members.get, 1, Counted())  # type: ignore[arg-type]
        return await pool.call("b", "put", lambda c: c.request(answer), moved=lambda c, n: 100 * n)

    assert run(main()) == answer
    assert seen == ([("b", "put", 5, 500, True)] if answer else [])
