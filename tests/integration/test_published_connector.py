"""The published vllm-ascend EMS connector's own logic against a real emsd.

``tests/published_connector.py`` holds the connector's code as published
(``EmsAdapter``, ``PeriodicTaskManager``, ``CcConnectorWorker``, the
scheduler's block-hash chain), with stubs only for what needs vLLM or an NPU.
These tests drive it as vLLM would: build the adapter for a rank, register the
KV caches, save the blocks of a prompt, look them up with the scheduler's
chained hashes, load them into other block ids, and survive emsd being killed
and coming back.

The health loop's interval (10 s as published) is shortened for the test; the
loop itself, its 3-successes threshold and its flapping window are unchanged.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import published_connector as pc  # noqa: E402
from ports import free_port  # noqa: E402

from ems import Ems, EmsErrorCode  # noqa: E402

BLOCK = 16
BLOCKS = 12
CHECK_INTERVAL = 0.05  # seconds; published: 10


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def adapters(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[pc.EmsAdapter]]:
    """Adapters made by the test; their health loops are made inert at the end (the
    published loop never stops; its thread is a daemon thread)."""
    monkeypatch.setattr(pc.PeriodicTaskManager, "HEALTH_CHECK_INTERVAL", CHECK_INTERVAL)
    monkeypatch.setattr(pc.EmsEnv, "ems_num_min_reuse_tokens", 0)
    made: list[pc.EmsAdapter] = []
    yield made
    for adapter in made:
        if adapter.task_manager is not None:
            adapter.task_manager.check_health_status = lambda: None  # type: ignore[method-assign]
    Ems._reset()


def make_adapter(made: list[pc.EmsAdapter], *, tp: tuple[int, int] = (1, 0), rank: int = 0,
                 mla: bool = False, model: str = "/models/DeepSeek-V3") -> pc.EmsAdapter:
    """An adapter for global ``rank``, rank ``tp[1]`` of a TP group of ``tp[0]``, PP 1."""
    tp_size, tp_rank = tp
    pc.set_groups(pc.GroupCoordinator(rank=rank, local_rank=rank % 8, world_size=tp_size,
                                      rank_in_group=tp_rank),
                  pc.GroupCoordinator(rank=rank, local_rank=rank % 8, world_size=1, rank_in_group=0))
    config = pc.vllm_config(model, use_mla=mla, block_size=BLOCK, rank=rank, world_size=4 * tp_size)
    adapter = pc.EmsAdapter(config)
    made.append(adapter)
    return adapter


def kv_caches(mla: bool, layers: int = 3) -> dict[str, tuple[torch.Tensor, ...]]:
    """vLLM's per-layer KV tensors, [num_blocks, block_size, heads, head_size], random values.

    MLA (DeepSeek V2/V3): a compressed latent and a rope part, one "head" each, of
    different widths."""
    gen = torch.Generator().manual_seed(7)

    def t(heads: int, size: int) -> torch.Tensor:
        return torch.randn(BLOCKS, BLOCK, heads, size, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    if mla:
        return {f"model.layers.{i}.self_attn": (t(1, 64), t(1, 16)) for i in range(layers)}
    return {f"model.layers.{i}.self_attn": (t(2, 8), t(2, 8)) for i in range(layers)}


def blocks_of(caches: dict[str, tuple[torch.Tensor, ...]], ids: list[int]) -> list[bytes]:
    return [t[ids].contiguous().view(torch.uint8).numpy().tobytes()
            for layer in caches.values() for t in layer]


def prompt_hashes(tokens: list[int]) -> list[int]:
    """The scheduler's chained block hashes of a prompt, as published."""
    return pc.CcConnectorScheduler(BLOCK)._cal_block_hashes(tokens, BLOCK)


def finished(poll: Callable[[], set[str]], req: str) -> None:
    done: set[str] = set()
    wait_until(lambda: bool(done.update(poll()) or req in done))


def ready(adapter: pc.EmsAdapter) -> None:
    """Wait for the published health loop to call emsd healthy (3 checks in a row)."""
    wait_until(adapter.task_manager.get_status)


def save_load_round_trip(adapter: pc.EmsAdapter, caches: dict[str, tuple[torch.Tensor, ...]],
                         tag: int) -> None:
    """Save blocks 1-3 of a prompt, find them, load them into blocks 7-9: equal bytes."""
    tokens = [tag * 1000 + i for i in range(3 * BLOCK + 5)]  # 3 full blocks and a partial one
    hashes = prompt_hashes(tokens)
    assert len(hashes) == 3
    adapter.async_save(f"save-{tag}", hashes, [1, 2, 3])
    finished(adapter.get_finished_save_reqs, f"save-{tag}")
    assert adapter.exists_block_num(f"lookup-{tag}", hashes) == 3
    assert adapter.exists_block_num(f"lookup-{tag}", prompt_hashes([tag + 1] * 2 * BLOCK)) == 0
    adapter.async_load(f"load-{tag}", hashes, [7, 8, 9], 0)
    finished(adapter.get_finished_load_reqs, f"load-{tag}")
    assert adapter.get_block_ids_with_load_errors() == set()
    assert blocks_of(caches, [7, 8, 9]) == blocks_of(caches, [1, 2, 3])


def test_mha_model_through_the_worker_save_lookup_load(sdk_env: Any, adapters: list[Any]) -> None:
    pc.set_groups(pc.GroupCoordinator(0, 0, 1, 0), pc.GroupCoordinator(0, 0, 1, 0))
    worker = pc.CcConnectorWorker(pc.vllm_config("/models/Llama-3.1-8B", use_mla=False,
                                                 block_size=BLOCK, rank=0, world_size=1))
    adapters.append(worker.ems_adapter)
    assert worker.ems_adapter._inited
    caches = kv_caches(mla=False)
    worker.register_kv_caches(caches)
    assert worker.ems_adapter._registered
    ready(worker.ems_adapter)
    tokens = list(range(100, 100 + 4 * BLOCK))
    hashes = prompt_hashes(tokens)
    save = pc.CcConnectorMetadata()
    save.add_requests(pc.CcReqMeta("r1", 0, 4, hashes, [0, 1, 2, 3], "save"))
    worker.wait_for_save(save)
    saved: set[str] = set()
    wait_until(lambda: bool(saved.update(worker.get_finished({"r1"})[0]) or "r1" in saved))
    assert worker._lookup_block_hashes("r2", hashes) == 4
    # A second request with the same prompt: the scheduler's hashes match, it loads 2 blocks
    # after 2 computed ones into its own block ids.
    load = pc.CcConnectorMetadata()
    load.add_requests(pc.CcReqMeta("r2", 2, 4, hashes[2:], [10, 11], "load"))
    worker.start_load_kv(load)
    loaded: set[str] = set()
    wait_until(lambda: bool(loaded.update(worker.get_finished(set())[1]) or "r2" in loaded))
    assert worker.get_block_ids_with_load_errors() == set()
    assert blocks_of(caches, [10, 11]) == blocks_of(caches, [2, 3])


def test_mla_model_starts_and_round_trips(sdk_env: Any, adapters: list[Any]) -> None:
    adapter = make_adapter(adapters, mla=True, model="/models/deepseek-ai/DeepSeek-V3")
    assert adapter._inited, "the published get_ems_cfg sets kvcache_type after construction"
    assert adapter.ems_cfg.cc_config_v1.kvcache_type == pc.KVCacheType.MLA
    assert adapter.ems_cfg.cc_config_v1.llm_engine == "vllm@deepseek-ai_DeepSeek-V3"
    caches = kv_caches(mla=True)
    adapter.register_kv_caches(caches)
    assert adapter._registered
    ready(adapter)
    save_load_round_trip(adapter, caches, tag=1)


def test_data_parallel_rank_beyond_one_tp_group(sdk_env: Any, adapters: list[Any]) -> None:
    # DP rank 2 of TP 2: global rank 5 (> tp * pp = 2), rank 1 in its TP group.
    adapter = make_adapter(adapters, tp=(2, 1), rank=5)
    assert adapter._inited
    assert adapter.ems_cfg.cc_config_v1.rank_id == 5
    caches = kv_caches(mla=False)
    adapter.register_kv_caches(caches)
    ready(adapter)
    save_load_round_trip(adapter, caches, tag=2)


def test_partial_hit_marks_the_rest_as_load_errors(sdk_env: Any, adapters: list[Any]) -> None:
    adapter = make_adapter(adapters)
    caches = kv_caches(mla=False)
    adapter.register_kv_caches(caches)
    ready(adapter)
    hashes = prompt_hashes(list(range(4 * BLOCK)))
    adapter.async_save("s", hashes[:2], [0, 1])
    finished(adapter.get_finished_save_reqs, "s")
    assert adapter.exists_block_num("q", hashes) == 2
    adapter.async_load("l", hashes, [4, 5, 6, 7], 0)
    finished(adapter.get_finished_load_reqs, "l")
    assert adapter.get_block_ids_with_load_errors() == {6, 7}  # recompute these
    assert blocks_of(caches, [4, 5]) == blocks_of(caches, [0, 1])


def test_daemon_killed_then_back_load_errors_then_health_loop_recovers(
        sdk_env: Any, adapters: list[Any]) -> None:
    adapter = make_adapter(adapters)
    caches = kv_caches(mla=False)
    adapter.register_kv_caches(caches)
    ready(adapter)
    hashes = prompt_hashes(list(range(7, 7 + 3 * BLOCK)))
    adapter.async_save("s", hashes, [1, 2, 3])
    finished(adapter.get_finished_save_reqs, "s")

    sdk_env.kill9()
    adapter.async_load("l1", hashes, [7, 8, 9], 0)
    finished(adapter.get_finished_load_reqs, "l1")
    assert adapter.get_block_ids_with_load_errors() == {7, 8, 9}
    wait_until(lambda: not adapter.task_manager.get_status())  # EMS_IO_ERROR resets it
    assert not Ems.check_health()
    # While unhealthy the connector does not call the SDK: every load is an error, every
    # lookup a miss, and the engine recomputes.
    adapter.async_load("l2", hashes, [7, 8, 9], 0)
    finished(adapter.get_finished_load_reqs, "l2")
    assert adapter.get_block_ids_with_load_errors() == {7, 8, 9}
    assert adapter.exists_block_num("q", hashes) == 0

    sdk_env.start()  # the same socket; the published loop must notice on its own
    ready(adapter)
    assert adapter._inited and adapter._registered  # the registered layout was kept
    save_load_round_trip(adapter, caches, tag=3)


def recovering_daemon(emsd_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A clustered emsd whose ZooKeeper is not there: it waits 5 s for it before serving, its
    socket up meanwhile, every HELLO answered "recovering". The SDK is pointed at it, reset."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-of-some-length\n")
    os.chmod(secret, 0o600)
    d = emsd_factory(start=False, cluster={
        "name": "t", "zookeeper": f"127.0.0.1:{free_port()}", "peer_listen": f"127.0.0.1:{free_port()}",
        "secret_file": str(secret), "session_timeout": 4})
    d.start(wait=False)
    monkeypatch.setenv("EMS_SOCKET_DIR", str(d.socket_dir))
    Ems._reset()
    return d


def test_init_while_emsd_recovers_reinits_and_registers_from_the_health_loop(
        emsd_factory: Any, adapters: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = recovering_daemon(emsd_factory, tmp_path, monkeypatch)
    wait_until(lambda: (d.socket_dir / "emsd.sock").exists())

    adapter = make_adapter(adapters)
    assert not adapter._inited and adapter._need_reinit, "init must fail with EMS_RECOVERD_ERROR"
    assert adapter.context_caching is None
    caches = kv_caches(mla=False)
    adapter.register_kv_caches(caches)
    assert adapter._pending_kv_caches is caches and not adapter._registered
    assert adapter.exists_block_num("q", [1, 2]) == 0  # degraded: every lookup a miss

    wait_until(lambda: adapter._inited and adapter._registered, timeout=60)
    ready(adapter)
    save_load_round_trip(adapter, caches, tag=4)


def test_recovering_daemon_raises_the_published_error_code(emsd_factory: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from ems import CcConfig_v1, EmsConfig, EmsException

    d = recovering_daemon(emsd_factory, tmp_path, monkeypatch)
    try:
        wait_until(lambda: (d.socket_dir / "emsd.sock").exists())
        with pytest.raises(EmsException) as info:
            Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
        assert info.value.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR
        assert Ems.check_health() is False
        wait_until(Ems.check_health, timeout=60)  # connects with the failed init's config
        cc = Ems.get_cc()
        assert cc is not None
        Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m")))
        assert Ems.get_cc() is cc  # the equal config finds that connection: a no-op
    finally:
        Ems._reset()


