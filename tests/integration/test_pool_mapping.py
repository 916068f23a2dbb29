"""How an SDK connection maps the pool (``ems.client.DaemonClient``): its page tables are
filled in the background only once KV caches are registered or a block is copied, by a
thread at the lowest CPU priority, so that a connection that only asks ``exists`` (a
connector's scheduler side) spends nothing on it and the filling yields to the engine."""

from __future__ import annotations

from typing import Any

import torch

from ems.cc_v1.cc_config import CcConfig_v1
from ems.client import DaemonClient
from ems.context_caching import ContextCaching
from ems.profiling import Profiler

BLOCKS, TOKENS = 4, 4
SLOTS = list(range(BLOCKS * TOKENS))
KEYS = [700 + k for k in range(BLOCKS)]


def test_page_tables_are_filled_once_kv_caches_are_registered_at_the_lowest_priority(emsd: Any) -> None:
    client = DaemonClient(emsd.socket_dir / "emsd.sock")
    client.connect({})
    try:
        config = CcConfig_v1(rank_id=0, device_id=0, model_id="mapping")
        lookups = ContextCaching(lambda: client, config, None, Profiler.from_env())
        assert lookups.exists(KEYS).success == 0
        assert client._populator is None  # lookups alone never fill the page tables
        cc = ContextCaching(lambda: client, config, None, Profiler.from_env())
        cc.register_kvcache([[torch.ones((BLOCKS, TOKENS, 8, 64)) for _ in range(2)]])
        populator = client._populator
        assert populator is not None
        populator._thread.join(timeout=60)
        assert not populator._thread.is_alive()
        assert populator.priority == 19
        assert cc.save(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS
        assert cc.load(SLOTS, hashes=KEYS, offsets=[TOKENS] * BLOCKS).success == BLOCKS
        assert client._populator is populator  # one per connection
    finally:
        client.close()
    assert client._populator is None
