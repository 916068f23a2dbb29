"""A tiny workload replay through the SDK against real daemons matches the in-process store, and a
3-node cluster hits as the same ring and stores in process do."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.workload import sim
from benchmarks.workload.generator import Mix, generate
from benchmarks.workload.replay import BLOCK, BLOCK_BYTES, replay

PAGE = 64 << 10


@pytest.mark.parametrize("eviction", ["lru", "prefix"])
def test_replay_hits_match_the_daemons_own_store_in_process(emsd_factory: Any, eviction: str) -> None:
    from ems import CcConfig, EmsConfig
    from ems.client import DaemonClient
    from ems.context_caching import ContextCaching
    from ems.profiling import Profiler

    trace = generate(Mix(sessions=30, span_s=60.0, agent_steps=(3, 8)), 11)
    chained = sim.chain(trace, BLOCK)
    pool = 1 << 20  # the smallest pool: 256 blocks, under pressure for this trace
    assert sim.working_set(chained) > 2 * pool // BLOCK_BYTES
    d = emsd_factory(pool={"size": pool, "page_size": PAGE, "eviction": eviction, "prefault": False,
                           "grants": False})  # as the benchmark runs: see daemons.start
    client = DaemonClient(d.socket_dir / "emsd.sock")
    client.connect({})
    try:
        cc = ContextCaching(lambda: client, EmsConfig(cc_config=CcConfig(
            rank_id=0, device_id=0, model_id="wl")).validate(), None, Profiler(False))
        got = replay(trace, [cc])
    finally:
        client.close()
    want = sim.in_store(chained, pool, BLOCK_BYTES, PAGE, eviction) * BLOCK
    assert np.array_equal(got.hit, want)
    assert 0 < got.hit.sum() < (sim.infinite(chained) * BLOCK).sum()  # evictions cost hits


def test_a_cluster_replay_hits_within_a_few_points_of_the_same_cluster_in_process(zookeeper: Any) -> None:
    """Three real daemons of the smallest pool (1 MiB each, ``write_rcache`` off, as the
    benchmark's cluster) against ``sim.in_cluster``, the same ring and stores in process: the
    real cluster also holds, for a while, copies of what its loads fetch and its saves forward,
    so it may hit a little less, never a large part less (loads larger than a node's room for
    copies stopped where the room ran out: 0.27 against 0.69 in the benchmark's quick run,
    until they were pinned in parts)."""
    from benchmarks.workload import daemons
    from ems import CcKvOption

    trace = generate(Mix(sessions=30, span_s=60.0, agent_steps=(3, 8)), 11)
    chained = sim.chain(trace, BLOCK)
    pool = 1 << 20
    work = Path(tempfile.mkdtemp(prefix="wlc-"))  # short: socket paths under pytest's tmp_path run long
    try:
        dep = daemons.start(work, 3, pool, "prefix", zookeeper, name="c")
        try:
            got = replay(trace, daemons.connect(dep, "wl"), CcKvOption(write_rcache=False))
        finally:
            dep.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    want = sim.in_cluster(chained, 3, pool, BLOCK_BYTES, PAGE, "prefix", 512) * BLOCK
    assert want.sum() > 0
    # equal here (2026-12-01); without the parts it was 0.84 of it
    assert got.hit.sum() >= 0.97 * want.sum(), (got.hit.sum(), want.sum())
