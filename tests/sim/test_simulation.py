"""The deterministic simulation of a cluster (tests/sim/world.py), run over many seeds.

By default ``DEFAULT_SEEDS`` seeds of ``DEFAULT_STEPS`` steps each run, one
test per seed. ``EMS_SIM_SEED=N`` replays seed N alone (the number a failure
prints); ``EMS_SIM_SEEDS=K`` runs seeds 0..K-1 instead; ``EMS_SIM_STEPS=S``
changes the steps per seed.

The other tests show that the simulation replays a seed exactly and that
its checks fail when the code under test misbehaves (a corrupted copy, a
leaked pin, a membership notification that never arrives).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import membership
import network
import numpy as np
import pytest
from client import SimFailure
from clock import SimDeadlock, VirtualLoop
from world import Simulation

from emsd.pool.store import BlockStore

DEFAULT_SEEDS = 24
DEFAULT_STEPS = 80


def _seeds() -> list[int]:
    one = os.environ.get("EMS_SIM_SEED")
    if one:
        return [int(one)]
    return list(range(int(os.environ.get("EMS_SIM_SEEDS", DEFAULT_SEEDS))))


STEPS = int(os.environ.get("EMS_SIM_STEPS", DEFAULT_STEPS))


@pytest.mark.parametrize("seed", _seeds())
def test_simulated_cluster_keeps_its_invariants(seed: int) -> None:
    sim = Simulation(seed, STEPS)
    sim.run()
    c = sim.counts
    assert c["saves"] and c["loads"] and c["events"] and c["pushed"], c  # the run did something
    assert c["hits"], f"seed {seed}: no load found anything: {c}"


def test_a_seed_replays_exactly() -> None:
    first = Simulation(3, 20)
    digest = first.run()
    assert Simulation(3, 20).run() == digest
    assert Simulation(4, 20).run() != digest
    assert len(first.trace) > 40


def test_a_seed_replays_exactly_in_another_process_with_another_hash_seed() -> None:
    """What ``EMS_SIM_SEED`` relies on: nothing depends on str hashing or on the process."""
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path[:0] = [{str(here.parents[1])!r}, {str(here)!r}]; "
            "import logging; logging.disable(logging.CRITICAL); "
            "from world import Simulation; print(Simulation(3, 15).run())")
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        digests.add(out.stdout.strip())
    assert digests == {Simulation(3, 15).run()}


def test_the_virtual_loop_jumps_to_the_next_timer_and_reports_a_hang() -> None:
    loop = VirtualLoop()

    async def main() -> tuple[float, int]:
        await asyncio.sleep(3600)
        slow = asyncio.ensure_future(asyncio.sleep(100))
        done, _ = await asyncio.wait([slow], timeout=5)
        slow.cancel()
        return loop.time(), len(done)

    try:
        wall = time.monotonic()
        assert loop.run_until_complete(main()) == (3605.0, 0)
        assert time.monotonic() - wall < 60  # an hour of virtual time passed; a real one did not
        with pytest.raises(SimDeadlock):
            loop.run_until_complete(asyncio.Event().wait())
    finally:
        loop.close()


def test_a_corrupted_copy_fails_with_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = network._copy

    def corrupt(src: memoryview, so: np.ndarray, dst: memoryview, do: np.ndarray, n: np.ndarray) -> None:
        real(src, so, dst, do, n)
        for off in do.tolist():
            dst[off] ^= 0xFF

    monkeypatch.setattr(network, "_copy", corrupt)
    with pytest.raises(SimFailure, match=r"seed=5 step=.*(wrong bytes|calm load).*EMS_SIM_SEED=5"):
        Simulation(5, 40).run()


def test_a_leaked_pin_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = BlockStore.release
    calls = [0]

    def leaky(self: BlockStore, handles: np.ndarray) -> int:
        calls[0] += 1
        return 0 if calls[0] % 7 == 0 else real(self, handles)

    monkeypatch.setattr(BlockStore, "release", leaky)
    with pytest.raises(SimFailure, match=r"seed=6 step=.*pinned"):
        Simulation(6, 40).run()


def test_a_lost_membership_notification_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = membership.Coordinator._deliver

    def forgetful(self: membership.Coordinator, member: membership.SimMembership) -> None:
        if member.me.node_id == "n1" and len(self.registered) > 1:
            self.in_flight -= 1  # n1 never hears of the others
            return
        real(self, member)

    monkeypatch.setattr(membership.Coordinator, "_deliver", forgetful)
    with pytest.raises(SimFailure, match=r"seed=2 step=-1: n1 sees members"):
        Simulation(2, 5).run()


@pytest.mark.parametrize(("seed", "steps"), [(8, 30)])
def test_seeds_that_found_bugs_stay_fixed(seed: int, steps: int) -> None:
    """Runs that failed before a fix (named in its commit). A change to the harness's draws
    changes what a seed does, so tests/sim/test_cluster_links.py pins each case down as well."""
    Simulation(seed, steps).run()
