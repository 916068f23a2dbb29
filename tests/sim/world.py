"""The deterministic simulation: several real daemons in one process, driven by one seed.

Each ``SimNode`` is the real daemon core: a ``BlockStore`` over a small pool
in anonymous memory, a ``Service`` (the request handlers) and a ``Cluster``
(placement ring, membership view, peer jobs with deadlines and backoff).
Only the edges are simulated: membership is a ``Coordinator``
(tests/sim/membership.py) and the peer transport a ``Network`` of
``SimLink``s (tests/sim/network.py). Everything runs on a ``VirtualLoop``
(tests/sim/clock.py), so timeouts, backoffs, slow hops and session expiry
cost no wall-clock time, and every choice comes from one
``random.Random(seed)``: the same seed replays the same run, event for event
(``Simulation.trace`` is the record; its digest is compared in a test).

A run is ``steps`` steps. In each step a few cluster events (a node joins,
leaves cleanly, crashes, restarts empty, loses or regains its ZooKeeper
session, or drains: leaves the ring, pushing what it owns; a partition; a
storm of dropped, slow and lost messages; a heal) fire at random virtual
times while clients on random nodes save and load batches of keys (loads
mostly of batches saved recently, elsewhere; half of them bringing at most
a few keys here, as a cluster SDK's ``PinRequest.bring``). When the step's
calls have all returned, the invariants are checked:

- no load returned a byte that differs from what was saved under its key
  (checked as each load returns: block bytes encode their key);
- every call returned within its timeout, in virtual time;
- every node's handoff pass (``emsd.handoff``) ends, and then no pin and no
  PENDING reservation is left on any live node, and the allocator's
  accounting holds (``check_invariants`` of tests/unit/test_store.py);
- after a heal (and every ``settle_every`` steps, and at the end): once the
  network is whole, sessions restored and every membership notification
  delivered, every live node has the same view and the same ring, holding
  exactly the live registered nodes, and every key's owners are live
  members; then, in that calm, a save on one node reaches every owner,
  every PUT goes to a current owner of its keys (never to a node that left),
  and a load of those keys on another node finds them all.

A broken invariant raises ``SimFailure`` with the seed, the step and how to
replay it (``EMS_SIM_SEED=<seed>``).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from client import CallResult, Client, SimFailure
from clock import VirtualLoop
from membership import Coordinator, SimMembership
from network import Network, Weather

from emsd.cluster import BACKOFF, Cluster
from emsd.config import ClusterConfig
from emsd.handoff import Handoff
from emsd.membership.base import MembershipState, NodeInfo
from emsd.metrics import Metrics
from emsd.pool.keys import KeyBatch
from emsd.pool.store import BlockStore
from emsd.remote import Remote
from emsd.service import Service
from emsd.transport.peer import PEER_PROTOCOL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_store import check_invariants  # noqa: E402

NS = "sim"
PAGE = 8 * 1024
KEYSPACE = 160  # workload keys 1..KEYSPACE: pools hold a fraction, so eviction runs
FRESH_KEYS = 1_000_000  # keys of the calm rounds start here: never saved before
SESSION_TIMEOUT = 2.0
NOTIFY_DELAY = 0.3  # a membership change reaches each watcher within this
STEP_WINDOW = 1.0  # events and calls of a step start within this many virtual seconds
TIMEOUTS_MS = (50, 200, 1000, 3000)
HANDOFF_LIMIT = 120.0  # virtual seconds for every handoff pass to end once a step's calls returned


@dataclass
class Params:
    """A run's shape, itself drawn from the seed."""

    nodes: int
    max_nodes: int
    replicas: int
    peer_connections: int
    capacities: tuple[int, ...]  # pool bytes to draw from for each new node

    @classmethod
    def draw(cls, rng: random.Random) -> Params:
        n = rng.randint(3, 5)
        return cls(nodes=n, max_nodes=n + 2, replicas=rng.choice((1, 1, 2, 3)),
                   peer_connections=rng.choice((1, 2)),
                   capacities=tuple(rng.choice((12, 16, 24)) * PAGE for _ in range(3)))


class SimNode:
    """One daemon: store, service and cluster, over the simulated membership and network."""

    def __init__(self, node_id: str, addr: str, capacity: int, params: Params, coordinator: Coordinator,
                 net: Network, handoff: bool = False) -> None:
        """``handoff``: hand stranded blocks to their owners after ring changes, as emsd.server
        wires it (the simulation's nodes do; the link tests' do not, to see only their calls)."""
        self.node_id = node_id
        self.addr = addr
        self.alive = True
        self.drained = False  # left the ring with DRAIN: still serves, owns nothing
        self.store = BlockStore(capacity, PAGE)
        # Fetched copies are kept as the daemon keeps them (copy=True: they take at most
        # copy_floor from owned blocks). A pool of a dozen 8 KiB pages with four size classes
        # holds too few copies at the default 1/16 for a calm load to always find room (the
        # policy's own tests are tests/unit/test_store.py and test_cluster.py): the largest
        # pool.read_cache_share the config allows.
        self.store.copy_floor = capacity // 2
        self.service = Service(self.store, node_id, "sim", Metrics())
        self.pool = memoryview(bytearray(capacity))
        self.drops = True  # answers a peer's DROP (tests set False: a node that refuses it)
        cfg = ClusterConfig(name="sim", zookeeper="sim", peer_listen=addr, replicas=params.replicas,
                            vnodes=32, peer_connections=params.peer_connections)
        me = NodeInfo(node_id, addr, capacity, PEER_PROTOCOL)
        self.membership = SimMembership(coordinator, me)
        self.cluster = Cluster(cfg, node_id, capacity, self.service, self.pool, b"sim-secret",
                               dialer=lambda: net.dialer(self), membership=self.membership)
        self.service.cluster = self.cluster
        self.handoff = Handoff(Remote(self.service))
        if handoff:
            self.cluster.on_ring = self.handoff.changed
        else:
            self.handoff.cancel()

    async def start(self) -> None:
        await self.cluster.join()
        self.handoff.changed()


class Simulation:
    """One seeded run (see the module docstring)."""

    def __init__(self, seed: int, steps: int, settle_every: int = 10) -> None:
        self.seed = seed
        self.steps = steps
        self.settle_every = settle_every
        self.rng = random.Random(seed)
        self.params = Params.draw(self.rng)
        self.trace: list[str] = []
        self.step = -1
        self.counts = {"saves": 0, "loads": 0, "hits": 0, "misses": 0, "settles": 0, "events": 0}
        self._fresh = FRESH_KEYS
        self._next_id = 0
        self._recent: list[tuple[int, ...]] = []  # batches saved lately: what loads mostly ask for

    # -- running -----------------------------------------------------------------

    def run(self) -> str:
        """Run every step; returns the trace's digest. Raises ``SimFailure`` naming seed and step."""
        loop = VirtualLoop()
        try:
            loop.run_until_complete(self._main(loop))
        except Exception as exc:  # an invariant, or an exception out of the code under test
            what = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            raise SimFailure(f"simulation seed={self.seed} step={self.step}: {what} "
                             f"(replay: EMS_SIM_SEED={self.seed})") from exc
        finally:
            for node in getattr(self, "nodes", {}).values():  # a failed run stops mid-pass
                node.handoff.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
        return self.digest()

    def digest(self) -> str:
        return hashlib.blake2b("\n".join(self.trace).encode(), digest_size=16).hexdigest()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.coordinator = Coordinator(self.rng, loop, NOTIFY_DELAY)
        self.net = Network(self.rng)
        self.nodes: dict[str, SimNode] = {}
        for _ in range(self.params.nodes):
            await self._join()
        await self._settle()
        for step in range(self.steps):
            self.step = step
            healed = await self._run_step()
            await self._quiesce()
            if healed or (self.step + 1) % self.settle_every == 0:
                await self._settle()
        self.step = self.steps
        await self._settle()
        for node in self.nodes.values():
            await node.handoff.close()
        self.counts.update(fetched=self.net.moved["get"], pushed=self.net.moved["put"])

    async def _run_step(self) -> bool:
        rng = self.rng
        jobs: list[Awaitable[object]] = []
        healed = False
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            event = self._pick_event()
            healed |= event == "heal"
            jobs.append(self._later(rng.uniform(0, STEP_WINDOW), self._event(event)))
        for _ in range(rng.randint(1, 6)):
            jobs.append(self._later(rng.uniform(0, STEP_WINDOW), self._call()))
        await asyncio.gather(*jobs)
        return healed

    async def _later(self, delay: float, job: Awaitable[object]) -> None:
        await asyncio.sleep(delay)
        await job

    def _live(self) -> list[SimNode]:
        """Nodes whose process runs (drained ones included)."""
        return [self.nodes[k] for k in sorted(self.nodes) if self.nodes[k].alive]

    def _members(self) -> list[SimNode]:
        """Live nodes in the ring: not drained."""
        return [n for n in self._live() if not n.drained]

    def _log(self, line: str) -> None:
        self.trace.append(f"{self.loop.time():.6f} {line}")

    # -- cluster events ------------------------------------------------------------------

    def _pick_event(self) -> str:
        n, members = len(self._live()), len(self._members())
        choices = ["partition", "storm", "heal", "expire", "restore", "restart"]
        if members < self.params.max_nodes and n < self.params.max_nodes + 2:
            choices += ["join", "join"]
        if members > 2 or n > members:  # a drained node may go as well
            choices += ["leave", "crash"]
        if members > 2:
            choices += ["drain"]
        return self.rng.choice(choices)

    async def _event(self, event: str) -> None:
        live = self._live()
        if len(live) < 2 and event in ("leave", "crash", "restart", "partition", "expire"):
            return  # the node that made the choice possible has gone since
        self.counts["events"] += 1
        rng = self.rng
        if event == "join":
            node = await self._join()
            self._log(f"join {node.node_id}")
        elif event == "leave":
            node = rng.choice(live)
            self._log(f"leave {node.node_id}")
            self._kill(node)
            await node.cluster.stop()  # deregisters at once, as a clean shutdown does
        elif event in ("crash", "restart"):
            node = rng.choice(live)
            self._log(f"{event} {node.node_id}")
            self._kill(node)
            old = node.membership
            if event == "crash":  # its registration lasts until the session times out
                self.loop.call_later(SESSION_TIMEOUT, self.coordinator.expire, old)
            else:  # the same id and address, an empty pool; it takes over its stale registration
                self.coordinator.deregister(old)
                await self._join(node.node_id, node.addr)
        elif event == "partition":
            ids = [n.node_id for n in live]
            side = rng.sample(ids, rng.randint(1, len(ids) - 1))
            self._log(f"partition {side}")
            self.net.partition(side, [i for i in ids if i not in side])
        elif event == "storm":
            self.net.weather = Weather(fail=rng.uniform(0, 0.25), lost_reply=rng.uniform(0, 0.15),
                                       slow=rng.uniform(0, 0.15))
            self._log(f"storm {self.net.weather}")
        elif event == "drain":
            members = self._members()
            if len(members) < 3:
                return
            node = rng.choice(members)
            node.drained = True
            client = Client(node.service, NS)
            try:
                resp, res = await client.drain(rng.choice(TIMEOUTS_MS))
            finally:
                client.close()
            self._log(f"drain {node.node_id}: moved {resp['moved']} failed {resp['failed']} "
                      f"remaining {resp['remaining']} in {res.elapsed:.6f}")
            self._check_timely(res)
        elif event == "heal":
            self._log("heal")
            self.net.heal()
        elif event == "expire":
            node = rng.choice(live)
            self._log(f"expire {node.node_id}")
            self.coordinator.expire(node.membership)
        elif event == "restore":
            lost = [n for n in live if n.membership.state is MembershipState.LOST]
            if lost:
                node = rng.choice(lost)
                self._log(f"restore {node.node_id}")
                self.coordinator.restore(node.membership)

    async def _join(self, node_id: str | None = None, addr: str | None = None) -> SimNode:
        if node_id is None or addr is None:
            self._next_id += 1
            node_id, addr = f"n{self._next_id}", f"10.0.0.{self._next_id}:11000"
        node = SimNode(node_id, addr, self.rng.choice(self.params.capacities), self.params,
                       self.coordinator, self.net, handoff=True)
        self.nodes[node_id] = node
        self.net.attach(addr, node)
        await node.start()
        return node

    def _kill(self, node: SimNode) -> None:
        node.alive = False
        node.handoff.cancel()
        self.net.detach(node.addr)

    # -- the workload -----------------------------------------------------------------------

    async def _call(self) -> None:
        rng = self.rng
        live = self._live()
        if not live:
            return
        node = rng.choice(live)
        start = rng.randint(1, KEYSPACE)
        keys = [(start + i - 1) % KEYSPACE + 1 for i in range(rng.randint(1, 8))]
        if rng.random() < 0.3:
            rng.shuffle(keys)
        save = rng.random() < 0.45
        if not save and self._recent and rng.random() < 0.7:
            keys = list(rng.choice(self._recent))
        timeout_ms = rng.choice(TIMEOUTS_MS)
        keep = rng.random() < 0.8
        client = Client(node.service, NS)
        try:
            if save:
                res = await client.save(keys, timeout_ms, keep, die_before_commit=rng.random() < 0.05)
                self.counts["saves"] += 1
                self._recent = [*self._recent[-15:], tuple(keys)]
            else:
                bring = None if rng.random() < 0.5 else rng.randint(1, len(keys))  # a cluster SDK's bound
                res = await client.load(keys, timeout_ms, keep, die_holding_pins=rng.random() < 0.05,
                                        bring=bring)
                self.counts["loads"] += 1
                self.counts["hits"] += res.count
                self.counts["misses"] += len(keys) - res.count
        finally:
            client.close()
        self._log(f"{res.op} {res.node} {res.keys} -> {res.count} {res.reached} in {res.elapsed:.6f}")
        self._check_timely(res)

    def _check_timely(self, res: CallResult) -> None:
        if res.elapsed > res.timeout:
            raise SimFailure(f"{res.op} of {len(res.keys)} keys on {res.node} took {res.elapsed:.3f} s "
                             f"(virtual), beyond its timeout of {res.timeout:.3f} s")

    # -- invariants ---------------------------------------------------------------------------

    async def _quiesce(self) -> None:
        """Let every live node's handoff pass end (background work that pins what it sends), in
        virtual time, then ``_check_quiescent``. A pass that has not ended in ``HANDOFF_LIMIT``
        is a failure: a handoff must end."""
        deadline = self.loop.time() + HANDOFF_LIMIT
        while busy := [n.node_id for n in self._live() if n.handoff.running]:
            if self.loop.time() > deadline:
                raise SimFailure(f"the handoffs of {busy} did not end in {HANDOFF_LIMIT:g} s")
            await asyncio.sleep(NOTIFY_DELAY)
        self._check_quiescent()

    def _check_quiescent(self) -> None:
        """No calls running: nothing pinned or reserved anywhere, the allocator consistent."""
        for node in self._live():
            st = node.store.stats()
            if st.pinned or st.pending:
                raise SimFailure(f"node {node.node_id} holds {st.pinned} pinned and {st.pending} PENDING "
                                 f"blocks with no call running")
            try:
                check_invariants(node.store)
            except AssertionError as exc:
                raise SimFailure(f"allocator accounting on {node.node_id}: {exc}") from None

    async def _settle(self) -> None:
        """Heal everything, let membership settle, then check agreement and a calm round."""
        self.counts["settles"] += 1
        self.net.heal()
        for node in self._live():
            self.coordinator.restore(node.membership)
        await asyncio.sleep(SESSION_TIMEOUT + BACKOFF)  # crashed sessions expire, backoffs end
        while self.coordinator.in_flight:
            await asyncio.sleep(NOTIFY_DELAY)
        self._log("settled")
        self._check_agreement()
        await self._calm_round()
        await self._quiesce()

    def _check_agreement(self) -> None:
        live = self._members()
        alive = [n.node_id for n in live]
        registered = sorted(self.coordinator.registered)
        if not live and not registered:
            return  # every node left or drained: nothing to agree on
        if registered != alive:
            raise SimFailure(f"registered members {registered} are not the live undrained nodes {alive}")
        ref = live[0].cluster.placement.ring
        for node in live:
            c = node.cluster
            if c.state is not MembershipState.JOINED:
                raise SimFailure(f"{node.node_id} is {c.state.value} after the network healed")
            view = [n.node_id for n in c.placement.members]
            if view != alive:
                raise SimFailure(f"{node.node_id} sees members {view}; live nodes are {alive}")
            ring = c.placement.ring
            if ring.view != ref.view or not np.array_equal(ring.points, ref.points) \
                    or not np.array_equal(ring.owners_at, ref.owners_at):
                raise SimFailure(f"{node.node_id}'s ring differs from {live[0].node_id}'s")
        every = KeyBatch.from_ints(np.arange(1, KEYSPACE + 1, dtype=np.uint64))
        owners = {o for row in ref.owner_ids(NS, every) for o in row}
        if not owners <= set(alive):
            raise SimFailure(f"keys are owned by {sorted(owners - set(alive))}, which are not live")

    async def _calm_round(self) -> None:
        """Save fresh keys on one node, load them on another: every owner gets them, every load hits.

        Drained nodes take no part: they stopped following the membership when they left the ring.
        """
        live = self._members()
        if len(live) < 2:
            return
        ring = live[0].cluster.placement.ring
        for _ in range(2):
            saver, loader = self.rng.sample(live, 2)
            keys = [self._fresh + i for i in range(self.rng.randint(1, 4))]
            self._fresh += len(keys)
            since = len(self.net.puts)
            client = Client(saver.service, NS)
            try:
                res = await client.save(keys, 3000, keep=self.rng.random() < 0.5)
            finally:
                client.close()
            self._log(f"calm save {saver.node_id} {keys} -> {res.count} {res.reached}")
            self._check_timely(res)
            if res.count != len(keys) or not all(res.reached):
                raise SimFailure(f"calm save of {keys} on {saver.node_id}: {res.count} committed, "
                                 f"reached {res.reached}")
            owners = ring.owner_ids(NS, KeyBatch.from_ints(np.array(keys, dtype=np.uint64)))
            owner_of = dict(zip(keys, owners, strict=True))
            got: dict[int, set[str]] = {k: set() for k in keys}
            for put in self.net.puts[since:]:  # the save's, and handoffs' of earlier keys
                for k in put.keys:
                    if k not in owner_of:
                        owner_of[k] = ring.owner_ids(NS, KeyBatch.from_ints(np.array([k], np.uint64)))[0]
                        got[k] = set()
                    if put.receiver not in owner_of[k]:
                        raise SimFailure(f"{put.sender} pushed key {k} to {put.receiver}, not one of "
                                         f"its owners {owner_of[k]}")
                    got[k].add(put.receiver)
            for k in keys:
                if got[k] != set(owner_of[k]) - {saver.node_id}:
                    raise SimFailure(f"key {k} saved on {saver.node_id} was pushed to {sorted(got[k])}; "
                                     f"its other owners are {sorted(set(owner_of[k]) - {saver.node_id})}")
            client = Client(loader.service, NS)
            try:
                res = await client.load(keys, 3000, keep=self.rng.random() < 0.5)
            finally:
                client.close()
            self._log(f"calm load {loader.node_id} {keys} -> {res.count}")
            self._check_timely(res)
            if res.count != len(keys):
                raise SimFailure(f"calm load of {keys} on {loader.node_id} found {res.count} of "
                                 f"{len(keys)}, saved on {saver.node_id}, owners {owners}")
