"""The handoff (emsd.handoff) on two real nodes over the virtual loop and the simulated network.

A node saves blocks while alone, then another joins and the ring gives it part of them. The
tests follow each block: handed to its new owner and kept here as a read-cache copy, or kept
as owned when the owner cannot be reached, until a later ring change hands it over.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from client import Client  # noqa: E402
from clock import VirtualLoop  # noqa: E402
from membership import Coordinator  # noqa: E402
from network import Network, Weather  # noqa: E402
from world import NS, PAGE, Params, SimNode  # noqa: E402

from emsd.handoff import SETTLE  # noqa: E402
from emsd.pool.index import FIRST_ID  # noqa: E402
from emsd.pool.keys import KeyBatch  # noqa: E402

KEYS = list(range(1, 17))


def _nodes(loop: asyncio.AbstractEventLoop, n: int = 2) -> tuple[list[SimNode], Network]:
    """Nodes a, b, ... on one simulated network, none started."""
    rng = random.Random(0)
    params = Params(nodes=n, max_nodes=n, replicas=1, peer_connections=1, capacities=(32 * PAGE,))
    coordinator, net = Coordinator(rng, loop, 0.0), Network(rng)
    nodes = [SimNode(name, f"10.0.0.{i + 1}:11000", 32 * PAGE, params, coordinator, net, handoff=True)
             for i, name in enumerate("abc"[:n])]
    for node in nodes:
        net.attach(node.addr, node)
    return nodes, net


def _pair(loop: asyncio.AbstractEventLoop) -> tuple[SimNode, SimNode, Network]:
    (a, b), net = _nodes(loop)
    return a, b, net


def _held(node: SimNode) -> tuple[list[int], list[int]]:
    """Of ``KEYS``: those ``node`` holds as owned blocks, and those it holds as copies."""
    idx = node.store.index
    ids = idx.find(node.service.namespace_id(NS), KeyBatch.from_user(KEYS)).tolist()
    held = [(k, bool(idx.cached[i])) for k, i in zip(KEYS, ids, strict=True) if i >= FIRST_ID]
    return [k for k, copy in held if not copy], [k for k, copy in held if copy]


@pytest.mark.parametrize("chunk", [1 << 16, 3, 1])
def test_a_joining_node_gets_its_share_and_the_old_holder_keeps_copies(chunk: int) -> None:
    """Also with the owned blocks looked up a few at a time (``Handoff.chunk``)."""
    loop = VirtualLoop()

    async def main() -> None:
        a, b, _ = _pair(loop)
        a.handoff.chunk = chunk
        await a.start()
        saver = Client(a.service, NS)
        assert (await saver.save(KEYS, 1000)).count == len(KEYS)  # alone: a owns them all
        saver.close()
        await b.start()
        await asyncio.sleep(2 * SETTLE + 1.0)  # a's join and b's make one burst
        share = [k for k, o in zip(KEYS, a.cluster.placement.owner_ids(NS, KeyBatch.from_user(KEYS)),
                                   strict=True) if o == ["b"]]
        assert 0 < len(share) < len(KEYS)
        assert _held(a) == ([k for k in KEYS if k not in share], share)
        assert _held(b) == (share, [])
        handed = a.cluster.handed
        assert (handed["passes"], handed["moved"], handed["kept"]) == (1, len(share), 0)
        assert handed["seconds"] > 0
        assert not a.handoff.running and b.cluster.handed["moved"] == 0  # b had nothing of a's

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_blocks_no_owner_took_stay_owned_until_the_next_ring_change_hands_them_over() -> None:
    loop = VirtualLoop()

    async def main() -> None:
        (a, b, c), net = _nodes(loop, 3)
        await a.start()
        saver = Client(a.service, NS)
        assert (await saver.save(KEYS, 1000)).count == len(KEYS)
        saver.close()
        net.weather = Weather(fail=1.0)  # every peer message is lost
        await b.start()
        await asyncio.sleep(2 * SETTLE + 1.0)  # a's join and b's make one burst
        handed = dict(a.cluster.handed)
        assert handed["passes"] == 1 and handed["moved"] == 0 and handed["kept"] > 0
        assert _held(a) == (KEYS, []) and _held(b) == ([], [])  # nothing lost, nothing marked a copy
        net.weather = Weather()
        await asyncio.sleep(2.0)  # the backoffs are over
        a.handoff.changed()  # a view that places every key as before: no pass
        await asyncio.sleep(SETTLE + 1.0)
        assert a.cluster.handed == handed
        await c.start()  # the next ring change
        await asyncio.sleep(SETTLE + 1.0)
        away = [k for k, o in zip(KEYS, a.cluster.placement.owner_ids(NS, KeyBatch.from_user(KEYS)),
                                  strict=True) if o != ["a"]]
        assert a.cluster.handed["moved"] == len(away) and a.cluster.handed["passes"] == 2
        assert _held(a) == ([k for k in KEYS if k not in away], away)
        assert sorted(_held(b)[0] + _held(c)[0]) == away and not _held(b)[1] and not _held(c)[1]

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_ring_that_changes_and_changes_back_before_it_settles_still_hands_over() -> None:
    """b leaves, a saves alone (every block a's), and b is back before a's ring has stood
    ``SETTLE`` seconds: the ring is the one a's last pass was over, but b's share of what a
    saved meanwhile must still go to b."""
    loop = VirtualLoop()

    async def main() -> None:
        (a, b), net = _nodes(loop)
        await a.start()
        await b.start()
        await asyncio.sleep(2 * SETTLE + 1.0)  # a pass over the ring of a and b: nothing to move
        passes = a.cluster.handed["passes"]
        b.alive = False
        b.handoff.cancel()
        await b.cluster.stop()  # deregisters at once, as a clean shutdown does
        await asyncio.sleep(0.1)
        assert a.cluster.placement.alone()
        saver = Client(a.service, NS)
        assert (await saver.save(KEYS, 1000)).count == len(KEYS)
        saver.close()
        back = SimNode("b", b.addr, 32 * PAGE, Params(2, 2, 1, 1, (32 * PAGE,)), b.membership.coordinator,
                       net, handoff=True)
        net.attach(back.addr, back)
        await back.start()  # within SETTLE of b's leaving
        await asyncio.sleep(2 * SETTLE + 1.0)
        share = [k for k, o in zip(KEYS, a.cluster.placement.owner_ids(NS, KeyBatch.from_user(KEYS)),
                                   strict=True) if o == ["b"]]
        assert 0 < len(share) < len(KEYS) and a.cluster.handed["passes"] > passes
        assert _held(back) == (share, []) and _held(a) == ([k for k in KEYS if k not in share], share)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
