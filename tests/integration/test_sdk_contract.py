"""The SDK contract (../shared/SDK_SPEC.md) against a real emsd process."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from ems import (
    CcConfig,
    CcConfig_v1,
    CcFuture,
    CcKvOption,
    CcResult,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KvBufferWrapper,
)
from ems.cc_v1.cc_config import KVCacheType
from ems.common.exception import EmsErrorCode as EmsErrorCode2
from ems.context_caching import ContextCaching
from ems.profiling import Profiler

NUM_BLOCKS, BLOCK, HEADS, DIM = 32, 4, 2, 8


def make_kv(layers: int = 2, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(NUM_BLOCKS, BLOCK, HEADS, DIM, generator=g, dtype=torch.float32)
         .to(torch.float16) for _ in range(2)]
        for _ in range(layers)
    ]


def block_slots(block_ids: list[int]) -> list[int]:
    return [b * BLOCK + p for b in block_ids for p in range(BLOCK)]


def init(model: str = "m1", **cc: Any) -> Any:
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id=model, **cc)))
    return Ems.get_cc()


def blocks_equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]], ids: list[int]) -> bool:
    pairs = [(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)]
    return all(torch.equal(x[ids], y[ids]) for x, y in pairs)


def test_import_paths_match_the_published_sdk() -> None:
    assert CcConfig is CcConfig_v1
    assert EmsErrorCode2 is EmsErrorCode
    assert {t.value for t in KVCacheType} == {"MHA", "GQA", "MQA", "MLA"}
    assert Ems.get_cc() is None or isinstance(Ems.get_cc(), ContextCaching)


def test_save_then_load_returns_identical_bytes(sdk_env: Any) -> None:
    cc = init()
    src = make_kv(seed=1)
    cc.register_kvcache(src)
    ids = [1, 3, 5, 7]
    res = cc.save(block_slots(ids), hashes=[101, -102, 2**64 - 3, 104], offsets=[BLOCK] * 4)
    assert (res.success, res.total) == (4, 4)

    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    res = cc.load(block_slots([2, 4, 6, 8]), hashes=[101, -102, 2**64 - 3, 104], offsets=[BLOCK] * 4)
    assert (res.success, res.total) == (4, 4)
    for la, lb in zip(src, dst, strict=True):
        for x, y in zip(la, lb, strict=True):
            assert torch.equal(x[[1, 3, 5, 7]], y[[2, 4, 6, 8]])
            assert not y[[0, 1, 3]].any()  # slots not named were not written


def test_load_counts_only_consecutive_hits_from_the_first(sdk_env: Any) -> None:
    cc = init()
    src = make_kv(seed=2)
    cc.register_kvcache(src)
    keys = [11, 12, 13, 14, 15, 16]
    stored = [0, 1, 2, 4, 5]
    res = cc.save(block_slots([k - 10 for k in [keys[i] for i in stored]]),
                  hashes=[keys[i] for i in stored], offsets=[BLOCK] * 5)
    assert res.success == 5
    assert cc.exists(keys).success == 3
    assert cc.exists(keys).total == 6
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    res = cc.load(block_slots([1, 2, 3, 4, 5, 6]), hashes=keys, offsets=[BLOCK] * 6)
    assert (res.success, res.total) == (3, 6)
    assert blocks_equal(src, dst, [1, 2, 3])
    assert all(not t[[5, 6]].any() for layer in dst for t in layer)  # beyond the miss: untouched


def test_bytes_keys_and_partial_blocks(sdk_env: Any) -> None:
    cc = init()
    src = make_kv(seed=3)
    cc.register_kvcache(src)
    digest = bytes(range(32))
    slots = block_slots([4]) + [5 * BLOCK, 5 * BLOCK + 1]  # a full block and 2 slots
    assert cc.save(slots, hashes=[digest, b"tail"], offsets=[BLOCK, 2]).success == 2
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    assert cc.load(slots, hashes=[digest, b"tail"], offsets=[BLOCK, 2]).success == 2
    for la, lb in zip(src, dst, strict=True):
        for x, y in zip(la, lb, strict=True):
            assert torch.equal(x.reshape(-1, HEADS, DIM)[slots], y.reshape(-1, HEADS, DIM)[slots])
    # The same key with a different size is a miss, never a short or long copy.
    assert cc.load(block_slots([6]), hashes=[b"tail"], offsets=[BLOCK]).success == 0


def test_saving_a_present_key_succeeds_without_rewriting(sdk_env: Any) -> None:
    cc = init()
    first = make_kv(seed=4)
    cc.register_kvcache(first)
    assert cc.save(block_slots([1]), hashes=[7], offsets=[BLOCK]).success == 1
    second = make_kv(seed=5)
    cc.register_kvcache(second)
    assert cc.save(block_slots([1]), hashes=[7], offsets=[BLOCK]).success == 1
    dst = [[torch.zeros_like(t) for t in layer] for layer in first]
    cc.register_kvcache(dst)
    assert cc.load(block_slots([1]), hashes=[7], offsets=[BLOCK]).success == 1
    assert blocks_equal(first, dst, [1])


def test_async_calls_pipeline_and_is_ready_never_blocks(sdk_env: Any) -> None:
    cc = init()
    src = make_kv(seed=6)
    cc.register_kvcache(src)
    futures = [cc.async_save(block_slots([i]), hashes=[1000 + i], offsets=[BLOCK])
               for i in range(NUM_BLOCKS)]
    assert all(isinstance(f, CcFuture) for f in futures)
    t0 = time.perf_counter()
    for f in futures:
        cc.is_ready(f)
    assert time.perf_counter() - t0 < 0.5
    assert [cc.get_result(f).success for f in futures] == [1] * NUM_BLOCKS
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    loads = [cc.async_load(block_slots([i]), hashes=[1000 + i], offsets=[BLOCK])
             for i in range(NUM_BLOCKS)]
    assert [f.result().success for f in loads] == [1] * NUM_BLOCKS
    assert blocks_equal(src, dst, list(range(NUM_BLOCKS)))


def test_token_semantics_share_exactly_the_common_prefix(sdk_env: Any) -> None:
    cc = init()
    src = make_kv(seed=7)
    cc.register_kvcache(src)
    tokens = list(range(100, 100 + 3 * BLOCK + 2))  # 3 full chunks and a partial one
    slots = list(range(BLOCK, BLOCK + len(tokens)))
    res = cc.save(slots, token_ids=tokens, mask=[1] * len(tokens))
    assert (res.success, res.total) == (4, 4)

    other = tokens[: 2 * BLOCK] + [9999] * (BLOCK + 2)  # diverges in chunk 2
    dst = [[torch.zeros_like(t) for t in layer] for layer in src]
    cc.register_kvcache(dst)
    res = cc.load(slots, token_ids=other, mask=[1] * len(other))
    assert (res.success, res.total) == (2, 4)
    assert blocks_equal(src, dst, [1, 2])
    # The exact prefix finds the partial chunk too; a masked prefix is skipped.
    res = cc.load(slots, token_ids=tokens, mask=[0] * BLOCK + [1] * (len(tokens) - BLOCK))
    assert (res.success, res.total) == (3, 3)
    assert blocks_equal(src, dst, [2, 3])


def test_ranks_models_and_tenants_never_share_blocks(sdk_env: Any) -> None:
    cc = init(model="shared-model", tp_world_size=2, rank_in_tp_group=0)
    src = make_kv(seed=8)
    cc.register_kvcache(src)
    assert cc.save(block_slots([1]), hashes=[42], offsets=[BLOCK]).success == 1
    others = [
        CcConfig(rank_id=1, device_id=1, model_id="shared-model", tp_world_size=2, rank_in_tp_group=1),
        CcConfig(rank_id=0, device_id=0, model_id="other-model", tp_world_size=2),
        CcConfig(rank_id=0, device_id=0, model_id="shared-model", tp_world_size=2,
                 kvcache_type=KVCacheType.MLA),
    ]
    for cfg in others:
        other = ContextCaching(Ems._current_client, cfg, None, Profiler(False))
        assert other.exists([42]).success == 0
    other_tenant = ContextCaching(Ems._current_client, cc_config_of(cc_rank=0), "tenant-b",
                                  Profiler(False))
    assert other_tenant.exists([42]).success == 0
    # Same model, same shape, another instance (rank_id/device_id differ): shared, by design.
    twin = ContextCaching(Ems._current_client, CcConfig(rank_id=0, device_id=3, model_id="shared-model",
                                                        tp_world_size=2), None, Profiler(False))
    assert twin.exists([42]).success == 1


def cc_config_of(cc_rank: int) -> CcConfig_v1:
    return CcConfig(rank_id=cc_rank, device_id=0, model_id="shared-model", tp_world_size=2)


@pytest.mark.parametrize("call", [
    lambda cc: cc.save([0, 1], hashes=[1], offsets=[1]),            # sum(offsets) != slots
    lambda cc: cc.save([0, 1], hashes=[1, 2], offsets=[2]),         # lengths differ
    lambda cc: cc.save([0], hashes=[1.5], offsets=[1]),             # not int/bytes
    lambda cc: cc.save([0], hashes=[2**64], offsets=[1]),           # out of range
    lambda cc: cc.save([0], hashes=[b"x" * 33], offsets=[1]),       # key too long
    lambda cc: cc.save([NUM_BLOCKS * BLOCK], hashes=[1], offsets=[1]),  # slot out of range
    lambda cc: cc.save([-1], hashes=[1], offsets=[1]),              # negative slot
    lambda cc: cc.load([0], hashes=[1], offsets=[0]),               # empty block
    lambda cc: cc.save([0], hashes=[1], offsets=[1], option=CcKvOption(timeout=-1)),
    lambda cc: cc.save([0], hashes=[1], offsets=[1], option="fast"),
    lambda cc: cc.save([0, 1], token_ids=[1, 2], mask=[1, 0]),      # mask not zeros-then-ones
    lambda cc: cc.save([0, 1], token_ids=[1, 2, 3], mask=[1, 1, 1]),
    lambda cc: cc.save([0], hashes=[1], offsets=[1], tokens=[1]),  # unknown keyword
    lambda cc: cc.get_result("not a future"),
])
def test_invalid_arguments_raise_invalid_argument(sdk_env: Any, call: Any) -> None:
    cc = init()
    cc.register_kvcache(make_kv())
    with pytest.raises(EmsException) as info:
        call(cc)
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert info.value.message()
    assert Ems.check_health()  # the daemon and the connection are still fine


def test_save_before_register_is_invalid(sdk_env: Any) -> None:
    cc = init()
    with pytest.raises(EmsException) as info:
        cc.save([0], hashes=[1], offsets=[1])
    assert info.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "register_kvcache" in info.value.message()


def test_numpy_arrays_and_raw_buffers_work_without_torch(sdk_env: Any) -> None:
    cc = init()
    rng = np.random.default_rng(9)
    arrays = [[rng.integers(0, 255, (NUM_BLOCKS, BLOCK, 64), dtype=np.uint8) for _ in range(2)]]
    raw = bytearray(rng.integers(0, 255, NUM_BLOCKS * BLOCK * 32, dtype=np.uint8).tobytes())
    wrapped = KvBufferWrapper(raw, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    cc.register_kvcache([arrays[0], [wrapped]])
    assert cc.save(block_slots([2, 3]), hashes=[5, 6], offsets=[BLOCK, BLOCK]).success == 2
    saved = [a.copy() for a in arrays[0]], bytes(raw)
    for a in arrays[0]:
        a[:] = 0
    raw[:] = bytes(len(raw))
    assert cc.load(block_slots([2, 3]), hashes=[5, 6], offsets=[BLOCK, BLOCK]).success == 2
    for a, b in zip(arrays[0], saved[0], strict=True):
        assert np.array_equal(a[2:4], b[2:4])
        assert not a[:2].any()
    row = BLOCK * 32
    assert raw[2 * row : 4 * row] == saved[1][2 * row : 4 * row]


def test_empty_requests_and_results(sdk_env: Any) -> None:
    cc = init()
    cc.register_kvcache(make_kv())
    assert cc.exists([]) == CcResult(0, 0)
    assert cc.save([], hashes=[], offsets=[]) == CcResult(0, 0)
    assert cc.load([], hashes=[], offsets=[]) == CcResult(0, 0)


def test_init_twice_is_a_no_op_and_health_is_true(sdk_env: Any) -> None:
    config = EmsConfig(cc_config_v1=CcConfig(rank_id=0, device_id=0, model_id="m1"))
    Ems.init(config)
    cc = Ems.get_cc()
    Ems.init(config)
    assert Ems.get_cc() is cc
    assert Ems.check_health() is True


def test_init_without_a_daemon_raises_io_error(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("EMS_SOCKET_DIR", str(tmp_path / "nowhere"))
    Ems._reset()
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m1")))
    assert info.value.status_code() == EmsErrorCode.EMS_IO_ERROR
    assert Ems.get_cc() is None
    assert Ems.check_health() is False


def test_profiling_records_one_json_line_per_call(sdk_env: Any, tmp_path: Any, monkeypatch: Any) -> None:
    import json
    import os

    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path))
    cc = init()
    cc.register_kvcache(make_kv())
    cc.save(block_slots([1]), hashes=[77], offsets=[BLOCK])
    cc.load(block_slots([1]), hashes=[77], offsets=[BLOCK])
    cc.exists([77, 78])
    path = tmp_path / f"cc_profile_{os.getpid()}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["op"] for r in records] == ["save", "load", "exists"]
    assert records[2]["success"] == 1 and records[2]["total"] == 2
    assert all(r["duration_us"] >= 0 for r in records)
