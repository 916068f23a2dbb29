"""A tiny workload replay through the SDK against a real daemon matches the in-process store."""

from __future__ import annotations

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
