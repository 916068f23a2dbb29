"""EmsStoreConnector's parts that need no vLLM: keys, token arithmetic, settings, the
scheduler's plan (on duck-typed requests), and the worker's loads and saves on
tensors laid out like vLLM's, against a real emsd.

These run in every environment (the main .venv has no vLLM) and skip nothing.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NewType

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ems import CcConfig, EmsErrorCode, EmsException
from ems.cc_v1.cc_config import KVCacheType

with warnings.catch_warnings():  # importing vLLM, where installed, trips torch deprecations
    warnings.simplefilter("ignore")
    from ems.integrations import vllm as conn
    from ems.integrations.vllm import (
        BlockJob,
        ConnectorSettings,
        EmsConnectorMetadata,
        EmsLink,
        Geometry,
        SchedulerSide,
        WorkerSide,
        block_key,
        block_views,
        blocks_to_load,
        full_blocks,
        kv_block_keys,
        lookup_window,
        matched_tokens,
        namespace_model_id,
        sanitize_model_id,
    )

BlockHash = NewType("BlockHash", bytes)  # what vLLM >= 0.11 hands out


class OldBlockHash(NamedTuple):  # vLLM <= 0.10
    hash_value: int
    token_ids: tuple[int, ...]


def digest(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block {i}".encode()).digest())


# -- keys ---------------------------------------------------------------------------


def test_block_key_keeps_vllm_digests_and_bounds_everything_else() -> None:
    d = digest(1)
    assert block_key(d) == bytes(d) and len(block_key(d)) == 32
    assert block_key(bytearray(b"abc")) == b"abc"
    assert block_key(memoryview(b"xyz")) == b"xyz"
    long = b"x" * 40
    assert block_key(long) == hashlib.sha256(long).digest()
    assert block_key(b"") == hashlib.sha256(b"").digest()  # never an empty key
    assert block_key(5) == (5).to_bytes(8, "little")
    assert block_key(-1) == block_key(2**64 - 1) == b"\xff" * 8  # two's complement, as the SDK
    assert block_key(2**70) == hashlib.sha256(str(2**70).encode()).digest()
    assert block_key(OldBlockHash(7, (1, 2))) == block_key(7)
    for bad in (True, "abc", 1.5, None):
        with pytest.raises(TypeError):
            block_key(bad)


def test_kv_block_keys_take_the_last_hash_of_each_kv_block() -> None:
    hashes = [digest(i) for i in range(8)]
    assert kv_block_keys(hashes, 1, 2, 5) == [bytes(hashes[i]) for i in (2, 3, 4)]
    # hash blocks of 16 tokens, KV blocks of 32: block i is named by hash 2i+1
    assert kv_block_keys(hashes, 2, 0, 4) == [bytes(hashes[i]) for i in (1, 3, 5, 7)]
    assert kv_block_keys(hashes, 2, 3, 3) == []
    for bad in ((1, 0, 9), (2, 0, 5), (1, 3, 2), (0, 0, 1)):
        with pytest.raises(ValueError):
            kv_block_keys(hashes, *bad)


# -- token arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "computed", "hashed", "window"), [
    (100, 0, 3, (0, 3)),    # 3 full blocks + 4 tokens: all 3 may come from emsd
    (128, 0, 4, (0, 4)),    # exactly 4 blocks: all 4 (the last token is computed again)
    (129, 0, 4, (0, 4)),    # one token past 4 blocks: all 4
    (100, 64, 3, (2, 3)),   # 2 blocks cached locally: ask from block 2
    (100, 96, 3, (3, 3)),   # everything hashed is local already
    (100, 0, 1, (0, 1)),    # only one block has a hash yet
    (32, 0, 1, (0, 1)),     # a one-block prompt: its block, 31 tokens of it
    (31, 0, 0, (0, 0)),     # no full block
    (1, 0, 0, (0, 0)),
    (0, 0, 0, (0, 0)),
])
def test_lookup_window_covers_the_full_hashed_blocks(num_tokens: int, computed: int, hashed: int,
                                                     window: tuple[int, int]) -> None:
    assert lookup_window(num_tokens, computed, 32, hashed) == window


def test_matched_tokens_are_whole_blocks_above_the_minimum_and_leave_a_token() -> None:
    assert matched_tokens(3, 32, 32, 1000) == 96
    assert matched_tokens(1, 32, 32, 1000) == 32
    assert matched_tokens(1, 32, 33, 1000) == 0     # below the minimum: not worth a load
    assert matched_tokens(2, 32, 64, 1000) == 64
    assert matched_tokens(4, 32, 32, 127) == 127    # the whole prompt of 128: all but its last token
    assert matched_tokens(1, 32, 32, 31) == 0       # a one-block prompt: 31 < the minimum of 32
    assert matched_tokens(1, 32, 0, 31) == 31
    assert matched_tokens(0, 32, 0, 1000) == 0      # no hit is never a match
    assert matched_tokens(-1, 32, 0, 1000) == 0
    assert matched_tokens(3, 32, 0, 0) == 0         # no room (one token left): nothing
    assert matched_tokens(3, 32, 0, -5) == 0


@hypothesis_settings(max_examples=400)
@given(num_tokens=st.integers(0, 2000), computed_blocks=st.integers(0, 70), extra_hashed=st.integers(-3, 0),
       stored=st.integers(0, 70), block_size=st.sampled_from([1, 16, 32, 128]),
       min_tokens=st.integers(0, 300))
def test_a_match_loads_stored_blocks_and_leaves_vllm_at_least_one_token(
        num_tokens: int, computed_blocks: int, extra_hashed: int, stored: int, block_size: int,
        min_tokens: int) -> None:
    """The scheduler's arithmetic end to end: vLLM's local prefix, the window asked, the
    leading hits of ``stored`` blocks, the tokens reported and the blocks then loaded."""
    full = num_tokens // block_size
    hashed = max(0, full + extra_hashed)
    # vLLM's local prefix: hashed blocks (it found them by hash), below the prompt's length
    computed = min(computed_blocks, hashed, max(0, (num_tokens - 1) // block_size)) * block_size
    first, stop = lookup_window(num_tokens, computed, block_size, hashed)
    assert first == computed // block_size and first <= stop <= hashed
    hits = max(0, min(stored, stop) - first)  # blocks [0, stored) are in emsd
    tokens = matched_tokens(hits, block_size, min_tokens, num_tokens - 1 - computed)
    assert tokens == 0 or min_tokens <= tokens
    assert computed + tokens <= max(0, num_tokens - 1)  # vLLM always computes a token
    n = blocks_to_load(tokens, block_size)
    assert n <= hits  # only stored blocks are loaded
    assert n * block_size >= tokens  # and they cover every token reported
    if tokens and hits == stop - first and stop == full and full * block_size == num_tokens:
        assert tokens == num_tokens - 1 - computed  # the whole prompt: all but one token


def test_full_blocks_counts_written_and_hashed_blocks() -> None:
    assert full_blocks(111, 32, 3) == 3
    assert full_blocks(128, 32, 4) == 4
    assert full_blocks(128, 32, 3) == 3       # the 4th block has no hash yet
    assert full_blocks(31, 32, 5) == 0
    assert full_blocks(-5, 32, 5) == 0


# -- namespace and settings --------------------------------------------------------------


def test_model_ids_are_valid_sdk_names_and_follow_the_fingerprint() -> None:
    assert sanitize_model_id("/models/Llama-3-8B/") == "llama-3-8b"
    assert sanitize_model_id("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama-llama-3.1-8b-instruct"
    assert sanitize_model_id("  ") == "model"
    assert sanitize_model_id("!!!") == "model"
    assert sanitize_model_id("a_b@c") == "a_b@c"
    assert len(sanitize_model_id("a" * 1000)) == 200
    fp = {"kv_dtype": "torch.float16", "block_size": 16, "layout": "LBHNC"}
    mid = namespace_model_id("Qwen/Qwen2-7B", fp)
    assert mid == namespace_model_id("Qwen/Qwen2-7B", dict(reversed(fp.items())))  # key order is irrelevant
    assert mid != namespace_model_id("Qwen/Qwen2-7B", {**fp, "kv_dtype": "torch.bfloat16"})
    assert mid != namespace_model_id("Qwen/Qwen2-7B", {**fp, "block_size": 32})
    assert mid.startswith("qwen-qwen2-7b.kv-")
    CcConfig(rank_id=0, device_id=0, model_id=mid)  # accepted by the SDK


def test_settings_parse_and_refuse_unknown_or_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMS_ACCESS_KEY", raising=False)
    s = ConnectorSettings.from_extra_config(None)
    assert s == ConnectorSettings()
    assert s.min_tokens(32) == 32
    s = ConnectorSettings.from_extra_config({"min_reuse_tokens": 256, "retry_interval_s": 1,
                                             "model_id": "llama", "save_decode_blocks": False})
    got = (s.min_tokens(32), s.retry_interval_s, s.model_id, s.save_decode_blocks)
    assert got == (256, 1.0, "llama", False)
    for bad in ({"min_reuse_token": 1}, {"min_reuse_tokens": -1}, {"min_reuse_tokens": True},
                {"lookup_timeout_ms": 1.5}, {"retry_interval_s": 0}, {"save_decode_blocks": "yes"},
                {"model_id": ""}, {"namespace": 3}):
        with pytest.raises(ValueError, match="EmsStoreConnector"):
            ConnectorSettings.from_extra_config(bad)
    monkeypatch.setenv("EMS_ACCESS_KEY", "k" * 32)
    assert ConnectorSettings.from_extra_config({}).access_key == "k" * 32


# -- the scheduler's plan ----------------------------------------------------------------


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    block_hashes: list[bytes]
    num_prompt_tokens: int = 0


@dataclass
class FakeResult:
    success: int


@dataclass
class FakeCc:
    stored: set[bytes] = field(default_factory=set)
    error: EmsException | None = None
    calls: int = 0

    def exists(self, keys: list[bytes], option: Any = None) -> FakeResult:
        self.calls += 1
        if self.error is not None:
            raise self.error
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return FakeResult(n)


class FakeLink:
    def __init__(self, cc: FakeCc | None) -> None:
        self._cc = cc
        self.failures: list[BaseException] = []

    def cc(self) -> FakeCc | None:
        return self._cc

    def failed(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self._cc = None


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Output:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None


GEO = Geometry(block_size=32, ratio=1, num_blocks=64, layer_names=("l0", "l1"), model_id="unit.kv-0",
               kvcache_type=KVCacheType.MHA, tp_size=1, pp_size=1)


def scheduler(cc: FakeCc | None, **settings: Any) -> tuple[SchedulerSide, FakeLink]:
    link = FakeLink(cc)
    return SchedulerSide(GEO, ConnectorSettings(**settings), link), link  # type: ignore[arg-type]


def request(rid: str, n_tokens: int, first_hash: int = 0) -> FakeRequest:
    hashes = [digest(first_hash + i) for i in range(n_tokens // 32)]
    return FakeRequest(rid, n_tokens, hashes, n_tokens)


def test_scheduler_loads_the_stored_prefix_and_saves_the_rest() -> None:
    req = request("r", 128)
    cc = FakeCc(stored={bytes(h) for h in req.block_hashes[:3]})  # 3 of the 4 blocks stored
    side, _ = scheduler(cc)
    assert side.get_num_new_matched_tokens(req, 0) == (96, False)
    side.update_state_after_alloc(req, FakeBlocks([10, 11, 12, 13]), 96)
    meta = side.build_connector_meta(Output([NewReq("r", ([10, 11, 12, 13],), 96)],
                                            num_scheduled_tokens={"r": 32}))
    assert meta.loads == [BlockJob("r", [10, 11, 12], [bytes(h) for h in req.block_hashes[:3]])]
    # block 3 is full after this step; blocks 0-2 are known stored: not saved again
    assert meta.saves == [BlockJob("r", [13], [bytes(req.block_hashes[3])])]
    assert side.request_finished(req) == (True, None)  # freed once the save is done


def test_scheduler_loads_a_whole_stored_prompt_and_leaves_its_last_token() -> None:
    req = request("r", 128)
    cc = FakeCc(stored={bytes(h) for h in req.block_hashes})  # all 4 blocks stored
    side, _ = scheduler(cc)
    assert side.get_num_new_matched_tokens(req, 0) == (127, False)  # vLLM computes one token
    side.update_state_after_alloc(req, FakeBlocks([10, 11, 12, 13]), 127)
    meta = side.build_connector_meta(Output([NewReq("r", ([10, 11, 12, 13],), 127)],
                                            num_scheduled_tokens={"r": 1}))
    assert meta.loads == [BlockJob("r", [10, 11, 12, 13], [bytes(h) for h in req.block_hashes])]
    assert meta.saves == []  # every block is known stored
    assert side.request_finished(req) == (False, None)  # nothing to wait for


def test_scheduler_counts_from_the_local_prefix_and_respects_the_minimum() -> None:
    req = request("r", 200)  # 6 full blocks + 8 tokens
    cc = FakeCc(stored={bytes(h) for h in req.block_hashes})
    side, _ = scheduler(cc)
    assert side.get_num_new_matched_tokens(req, 64) == (128, False)  # blocks 2..5
    side, _ = scheduler(cc, min_reuse_tokens=160)
    assert side.get_num_new_matched_tokens(req, 64) == (0, False)  # 128 < 160: recompute
    partial = FakeCc(stored={bytes(h) for h in req.block_hashes[:2]})
    side, _ = scheduler(partial)
    assert side.get_num_new_matched_tokens(req, 0) == (64, False)  # leading hits only
    side, _ = scheduler(FakeCc())
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_scheduler_fails_open() -> None:
    req = request("r", 100)
    side, _ = scheduler(None)  # emsd down: no call, a miss
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    cc = FakeCc(stored={bytes(h) for h in req.block_hashes},
                error=EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "slow"))
    side, link = scheduler(cc)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(link.failures) == 1 and link.cc() is None  # no more calls until it reconnects
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert cc.calls == 1
    side, link = scheduler(FakeCc(error=EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, "bug")))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert link.failures == []  # a bad argument is logged, emsd stays in use


def test_scheduler_saves_blocks_as_they_fill_and_skips_rejected_draft_tokens() -> None:
    req = request("r", 40)
    side, _ = scheduler(FakeCc())
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, FakeBlocks([5, 6]), 0)
    meta = side.build_connector_meta(Output([NewReq("r", ([5, 6],), 0)], num_scheduled_tokens={"r": 40}))
    assert meta.loads == [] and meta.saves == [BlockJob("r", [5], [bytes(req.block_hashes[0])])]
    # decode: the request grows to 64 tokens; the 2nd block gets its hash when full
    req.num_tokens, req.block_hashes = 64, req.block_hashes + [digest(1)]
    cached = Cached(["r"], set(), [None], [62])
    out = Output(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 3},
                 scheduled_spec_decode_tokens={"r": [7, 8]})
    assert side.build_connector_meta(out).saves == []  # 62 + 3 - 2 drafts = 63 tokens: not full
    cached.num_computed_tokens = [63]
    out = Output(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1})
    assert side.build_connector_meta(out).saves == [BlockJob("r", [6], [bytes(digest(1))])]
    assert side.build_connector_meta(out).saves == []  # saved once


def test_scheduler_after_preemption_replans_and_still_frees_late() -> None:
    req = request("r", 64)
    side, _ = scheduler(FakeCc())
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, FakeBlocks([1, 2]), 0)
    assert side.build_connector_meta(Output([NewReq("r", ([1, 2],), 0)],
                                            num_scheduled_tokens={"r": 40})).saves
    meta = side.build_connector_meta(Output(preempted_req_ids={"r"}))
    assert meta.preempted == {"r"}  # the workers finish reading its blocks first
    # resumed in other blocks; the workers still expect to report it finished
    side.update_state_after_alloc(req, FakeBlocks([8, 9]), 0)
    meta = side.build_connector_meta(Output(scheduled_cached_reqs=Cached(["r"], {"r"}, [([8, 9],)], [0]),
                                            num_scheduled_tokens={"r": 64}))
    assert [j.block_ids for j in meta.saves] == [[8, 9]]
    assert side.request_finished(req) == (True, None)
    other = request("x", 20)
    assert side.request_finished(other) == (False, None)  # never tracked


def test_scheduler_without_decode_saves_stops_at_the_prompt() -> None:
    req = request("r", 96)
    req.num_prompt_tokens = 40
    side, _ = scheduler(FakeCc(), save_decode_blocks=False)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
    meta = side.build_connector_meta(Output([NewReq("r", ([1, 2, 3],), 0)], num_scheduled_tokens={"r": 96}))
    assert [j.block_ids for j in meta.saves] == [[1]]


def test_fallback_metadata_fails_planned_loads() -> None:
    req = request("r", 128)
    side, _ = scheduler(FakeCc(stored={bytes(h) for h in req.block_hashes}))
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, FakeBlocks([4, 5, 6, 7]), 127)
    meta = side.fallback_meta()
    assert meta.saves == [] and meta.loads == [BlockJob("r", [4, 5, 6, 7], [])]


# -- the worker, on tensors laid out like vLLM's, against a real emsd -----------------------

NUM_BLOCKS, HEADS, BS, HEAD = 16, 2, 32, 32


def cpu_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM CPU's per-layer cache: [num_blocks, kv_heads, block_size, 2 * head_size]."""
    g = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g)) if seed is not None else (
        lambda: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD))
    return {name: make() for name in GEO.layer_names}


def worker(retry: float = 0.2) -> WorkerSide:
    geo = Geometry(block_size=BS, ratio=1, num_blocks=NUM_BLOCKS, layer_names=("l0", "l1"),
                   model_id="unit-worker.kv-0", kvcache_type=KVCacheType.MHA, tp_size=1, pp_size=1)
    config = conn._shared_config(geo.cc_config(0, 0), None, None)
    settings = ConnectorSettings(save_timeout_ms=2000, load_timeout_ms=2000)
    return WorkerSide(geo, settings, lambda on_connect: EmsLink(config, retry, "test", on_connect))


def finished(w: WorkerSide, req_ids: set[str], timeout: float = 10.0) -> set[str]:
    deadline, done = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        got, _ = w.get_finished(req_ids)
        done |= got or set()
        if done >= req_ids:
            return done
        time.sleep(0.01)
    return done


def test_worker_saves_then_another_worker_loads_the_same_bytes(sdk_env: Any) -> None:
    keys = [digest(100), digest(101)]
    src = cpu_caches(seed=1)
    w = worker()
    w.register_kv_caches(src)
    w.wait_for_save(EmsConnectorMetadata(saves=[BlockJob("a", [3, 5], [bytes(k) for k in keys])]))
    assert finished(w, {"a"}) == {"a"}  # reported once the save is done: vLLM frees then
    assert w.stats["saved_blocks"] == 2
    assert w.stats["save_issue_us"] > 0  # the wall time of its hook, for the engines benchmark
    assert sdk_env.metric("emsd_pool_entries") == 2

    dst = cpu_caches(seed=None)
    r = worker()
    r.register_kv_caches(dst)
    r.start_load_kv(EmsConnectorMetadata(loads=[BlockJob("b", [7, 9], [bytes(k) for k in keys]),
                                                BlockJob("c", [11, 12], [bytes(keys[0]), b"missing"])]))
    assert r.take_load_errors() == {12}  # the miss: vLLM recomputes block 12
    assert r.stats["load_us"] > 0 and r.stats["save_issue_us"] == 0
    for name in GEO.layer_names:
        assert torch.equal(dst[name][7], src[name][3]) and torch.equal(dst[name][9], src[name][5])
        assert torch.equal(dst[name][11], src[name][3])
        assert not dst[name][[0, 1, 2, 3, 4, 5, 6, 8, 10, 12]].any()  # nothing else was written
    assert r.take_load_errors() == set()


def test_worker_fails_open_when_emsd_dies(sdk_env: Any) -> None:
    w = worker(retry=60.0)
    caches = cpu_caches(seed=2)
    w.register_kv_caches(caches)
    sdk_env.kill9()
    w.wait_for_save(EmsConnectorMetadata(saves=[BlockJob("a", [1], [bytes(digest(5))])]))
    assert finished(w, {"a"}) == {"a"}  # a failed save still releases the request
    w.start_load_kv(EmsConnectorMetadata(loads=[BlockJob("b", [2, 3], [bytes(digest(5)), bytes(digest(6))])]))
    assert w.take_load_errors() == {2, 3}
    assert w.link is not None and w.link.cc() is None  # out of use until it reconnects
    w.wait_for_save(EmsConnectorMetadata(saves=[BlockJob("c", [4], [bytes(digest(7))])]))
    assert w.stats["save_dropped_blocks"] == 1
    assert finished(w, {"c"}) == {"c"}
    w.shutdown()


def test_worker_drains_saves_of_preempted_requests(sdk_env: Any) -> None:
    w = worker()
    w.register_kv_caches(cpu_caches(seed=3))
    w.wait_for_save(EmsConnectorMetadata(saves=[BlockJob("p", [1, 2], [bytes(digest(8)), bytes(digest(9))])]))
    w.handle_preemptions(EmsConnectorMetadata(preempted={"p"}))
    assert w._inflight == {} and w.stats["saved_blocks"] == 2


@pytest.mark.parametrize("layout", ["blocks-outer", "kv-outer", "heads-outer", "tokens-major",
                                    "kernel-blocks"])
def test_block_views_cover_every_byte_of_a_block_once(layout: str) -> None:
    nb = 4
    base = torch.arange(nb * 2 * 3 * 8 * 5, dtype=torch.float32)
    if layout == "blocks-outer":      # [B, H, N, C] contiguous
        t = base.view(nb, 2 * 3, 8, 5)
    elif layout == "kv-outer":        # [2, B, ...]: K and V apart
        t = base.view(2, nb, 3, 8, 5)
    elif layout == "heads-outer":     # logical [B, H, N, C], physical [H, B, N, C]
        t = base.view(6, nb, 8, 5).permute(1, 0, 2, 3)
    elif layout == "tokens-major":    # logical [B, H, N, C], physical [B, N, H, C]
        t = base.view(nb, 8, 6, 5).permute(0, 2, 1, 3)
    else:                             # 2 kernel blocks per manager block
        t = base.view(nb * 2, 3, 8, 5)
    views = block_views(t, nb)
    assert all(v.shape[:2] == (nb, 1) and v.dtype == torch.uint8 for v in views)
    for b in range(nb):
        got = torch.cat([v[b, 0] for v in views]).view(torch.float32)
        if layout == "kv-outer":
            want = torch.cat([t[0, b].reshape(-1), t[1, b].reshape(-1)])
        elif layout == "kernel-blocks":
            want = t[2 * b: 2 * b + 2].reshape(-1)
        else:
            want = t[b].reshape(-1)
        assert sorted(got.tolist()) == sorted(want.tolist())  # every element once


def test_block_views_refuse_a_cache_without_a_block_dimension() -> None:
    with pytest.raises(conn.UnsupportedConfig):
        block_views(torch.zeros(5, 3, 8), 4)


def test_scheduler_reset_cache_drops_every_ranks_blocks(sdk_env: Any) -> None:
    # vLLM's reset_prefix_cache(reset_connector=True) after a weight update: no rank may load
    # a block stored before it.
    geo = Geometry(block_size=BS, ratio=1, num_blocks=NUM_BLOCKS, layer_names=("l0", "l1"),
                   model_id="unit-reset.kv-0", kvcache_type=KVCacheType.MHA, tp_size=2, pp_size=1)
    settings = ConnectorSettings(save_timeout_ms=2000, load_timeout_ms=2000)
    keys = [bytes(digest(300)), bytes(digest(301))]
    workers = []
    for tp in (0, 1):
        config = conn._shared_config(geo.cc_config(tp, 0), None, None)
        w = WorkerSide(geo, settings, lambda on_connect, c=config: EmsLink(c, 0.2, "test", on_connect))
        w.register_kv_caches(cpu_caches(seed=tp + 3))
        w.wait_for_save(EmsConnectorMetadata(saves=[BlockJob(f"s{tp}", [1, 2], keys)]))
        assert finished(w, {f"s{tp}"}) == {f"s{tp}"}
        workers.append(w)
    assert sdk_env.metric("emsd_pool_entries") == 4  # two blocks in each rank's namespace
    link = EmsLink(conn._shared_config(geo.cc_config(0, 0), None, None), 0.2, "test-scheduler")
    side = SchedulerSide(geo, settings, link)
    assert side.reset_cache() is True
    assert sdk_env.metric("emsd_pool_entries") == 0
    for w in workers:
        w.start_load_kv(EmsConnectorMetadata(loads=[BlockJob("l", [5, 6], keys)]))
        assert w.take_load_errors() == {5, 6}  # misses: vLLM recomputes
        w.shutdown()
    link.close()
    assert SchedulerSide(geo, settings, None).reset_cache() is False  # emsd out of use
