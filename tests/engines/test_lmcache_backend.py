"""EmsdConnector inside LMCache: loaded through LMCache's plugin mechanism, against a real emsd.

Runs where LMCache imports (``scripts/test-engines.sh`` builds that venv);
skipped elsewhere. LMCache's CPU ``LocalCPUBackend`` allocates the chunks,
as in an engine; no GPU is involved.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="LMCache tests need torch (scripts/setup-engines.sh)")
pytest.importorskip("lmcache.v1.storage_backend.connector",
                    reason="LMCache is not installed here (scripts/setup-engines.sh installs it)")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from ems.integrations.lmcache import EmsdConnector  # noqa: E402

CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K/V, chunk tokens, heads, head size


def lmcache_config(**extra: Any) -> Any:
    options = {"remote_storage_plugin.emsd.module_path": "ems.integrations.lmcache",
               "remote_storage_plugin.emsd.class_name": "EmsdConnector",
               "remote_storage_plugin.emsd.retry_interval_s": 0.2,
               "remote_storage_plugin.emsd.timeout_ms": 2000}
    options.update({f"remote_storage_plugin.emsd.{k}": v for k, v in extra.items()})
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                                             remote_storage_plugins=["emsd"], extra_config=options)


def lmcache_metadata(worker_id: int = 0) -> Any:
    return LMCacheMetadata(model_name="test/Tiny-Model", world_size=2, local_world_size=2,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.float16,
                           kv_shape=KV_SHAPE, chunk_size=CHUNK)


class LoopThread:
    """LMCache runs its connectors' coroutines on an event loop in another thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Engine:
    """What LMCache builds for a remote plugin: CPU backend, then the connector from the config."""

    def __init__(self, loop: LoopThread, worker_id: int = 0, **options: Any) -> None:
        self.config = lmcache_config(**options)
        self.metadata = lmcache_metadata(worker_id)
        self.cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = loop
        self.connector = CreateConnector("plugin://emsd", loop.loop, self.cpu, self.config,
                                         self.metadata, plugin_name="emsd")

    def chunk(self, seed: int, tokens: int = CHUNK) -> Any:
        """A chunk MemoryObj filled with seeded random values (every byte matters)."""
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        assert obj is not None
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
        return obj

    def key(self, i: int) -> Any:
        return CacheEngineKey(self.metadata.model_name, self.metadata.world_size,
                              self.metadata.worker_id, 1000 + i, torch.float16)

    def put(self, i: int, obj: Any) -> None:
        obj.ref_count_up()  # as LMCache's RemoteBackend does before submitting a put
        self.loop.run(self.connector.put(self.key(i), obj))


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def as_bytes(obj: Any) -> bytes:
    return bytes(memoryview(obj.byte_array).cast("B"))


def test_plugin_config_builds_the_emsd_connector(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    inner = engine.connector.getWrappedConnector()
    assert isinstance(inner, EmsdConnector)
    assert inner.namespace.startswith("tiny-model.lmcache-")


def test_chunks_round_trip_byte_for_byte(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    objs = [engine.chunk(seed) for seed in range(3)]
    for i, obj in enumerate(objs):
        engine.put(i, obj)
    for i, obj in enumerate(objs):
        got = loop.run(engine.connector.get(engine.key(i)))
        assert got is not None and got is not obj
        assert got.get_shapes() == obj.get_shapes() and got.get_dtypes() == obj.get_dtypes()
        assert as_bytes(got) == as_bytes(obj)
        got.ref_count_down()


def test_put_leaves_the_reference_count_to_lmcache(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    obj = engine.chunk(7)
    before = obj.get_ref_count()
    engine.put(0, obj)  # +1 by the caller, -1 by LMCache's wrapper: the connector must not drop one more
    assert obj.get_ref_count() == before


def test_partial_last_chunk_keeps_its_shape(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    obj = engine.chunk(3, tokens=5)
    engine.put(0, obj)
    got = loop.run(engine.connector.get(engine.key(0)))
    assert got is not None
    assert got.get_shapes() == obj.get_shapes() == engine.metadata.get_shapes(5)
    assert as_bytes(got) == as_bytes(obj)


def test_batched_calls_count_leading_hits(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    objs = {i: engine.chunk(i) for i in (0, 1, 2, 4)}  # key 3 missing
    loop.run(engine.connector.batched_put([engine.key(i) for i in objs], list(objs.values())))
    keys = [engine.key(i) for i in range(6)]
    assert engine.connector.batched_contains(keys) == 3
    assert loop.run(engine.connector.batched_async_contains("req", keys)) == 3
    assert loop.run(engine.connector.exists(engine.key(4)))
    assert not engine.connector.exists_sync(engine.key(3))
    got = loop.run(engine.connector.batched_get(keys))
    assert [g is not None for g in got] == [True, True, True, False, False, False]
    assert [as_bytes(g) for g in got[:3]] == [as_bytes(objs[i]) for i in range(3)]
    prefix = loop.run(engine.connector.batched_get_non_blocking("req", keys))
    assert [as_bytes(g) for g in prefix] == [as_bytes(objs[i]) for i in range(3)]


def test_workers_do_not_share_chunks(ems_env: Any, loop: LoopThread) -> None:
    worker0, worker1 = Engine(loop, worker_id=0), Engine(loop, worker_id=1)
    worker0.put(0, worker0.chunk(1))
    assert worker0.connector.batched_contains([worker0.key(0)]) == 1
    assert worker1.connector.batched_contains([worker1.key(0)]) == 0


def test_remote_backend_stores_and_retrieves_through_emsd(ems_env: Any, loop: LoopThread) -> None:
    """LMCache's own RemoteBackend (what the engine calls) on top of the plugin."""
    engine = Engine(loop)
    backend = RemoteBackend(engine.config, engine.metadata, loop.loop, engine.cpu, "cpu", plugin_name="emsd")
    obj = engine.chunk(11)
    backend.submit_put_task(engine.key(0), obj).result(30)
    assert backend.contains(engine.key(0))
    assert backend.batched_contains([engine.key(0), engine.key(1)]) == 1
    got = backend.get_blocking(engine.key(0))
    assert got is not None and as_bytes(got) == as_bytes(obj)


def test_emsd_killed_mid_use_gives_misses_never_errors(ems_env: Any, loop: LoopThread) -> None:
    engine = Engine(loop)
    obj = engine.chunk(5)
    engine.put(0, obj)
    assert engine.connector.batched_contains([engine.key(0)]) == 1
    ems_env.kill9()
    assert engine.connector.batched_contains([engine.key(0)]) == 0
    assert loop.run(engine.connector.get(engine.key(0))) is None
    assert loop.run(engine.connector.batched_get([engine.key(0), engine.key(1)])) == [None, None]
    assert not loop.run(engine.connector.exists(engine.key(0)))
    engine.put(1, engine.chunk(6))  # dropped, no exception
    assert loop.run(engine.connector.batched_async_contains("req", [engine.key(0)])) == 0


def test_connector_starts_without_emsd_and_uses_it_once_it_is_up(
        emsd_factory: Any, loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    from ems.ems import Ems

    daemon = emsd_factory(start=False)
    monkeypatch.setenv("EMS_SOCKET_DIR", str(daemon.socket_dir))
    monkeypatch.setenv("EMS_SDK_LOG", str(daemon.workdir / "sdk-log"))
    Ems._reset()
    try:
        engine = Engine(loop)
        engine.put(0, engine.chunk(1))  # dropped
        assert engine.connector.batched_contains([engine.key(0)]) == 0
        daemon.start()
        inner = engine.connector.getWrappedConnector()
        while not inner._values.store.available:  # the retry interval (0.2 s) passes
            threading.Event().wait(0.05)
        obj = engine.chunk(2)
        engine.put(0, obj)
        got = loop.run(engine.connector.get(engine.key(0)))
        assert got is not None and as_bytes(got) == as_bytes(obj)
    finally:
        Ems._reset()
