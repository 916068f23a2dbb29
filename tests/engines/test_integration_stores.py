"""The engine-independent parts of ``ems.integrations``: keys, slot plans, stores on a real emsd.

These run in the main suite (no LMCache or SGLang needed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ems.cc_v1.cc_config import CcConfig_v1
from ems.config import EmsConfig
from ems.integrations.keys import digest_key, model_id, model_name
from ems.integrations.region_store import RegionStore, slot_plan
from ems.integrations.staging import StagedValues


def config(model: str = "m.test") -> EmsConfig:
    return EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id=model, llm_engine="test"))


# -- keys -------------------------------------------------------------------------------

def test_hex_page_hashes_become_their_own_32_bytes() -> None:
    h = hashlib.sha256(b"page").hexdigest()
    assert digest_key(h) == bytes.fromhex(h)
    assert digest_key(h.upper()) == bytes.fromhex(h)


@given(st.text(max_size=200))
def test_every_key_string_maps_to_32_bytes_deterministically(key: str) -> None:
    assert len(digest_key(key)) == 32
    assert digest_key(key) == digest_key(key)


def test_distinct_lmcache_style_keys_get_distinct_digests() -> None:
    keys = [f"model@2@{w}@{c:x}@half" for w in range(2) for c in range(500)]
    assert len({digest_key(k) for k in keys}) == len(keys)


def test_non_string_key_is_refused_by_type() -> None:
    with pytest.raises(TypeError, match="bytes"):
        digest_key(b"abc")  # type: ignore[arg-type]


def test_model_names_are_reduced_to_the_sdk_alphabet() -> None:
    assert model_name("/models/Llama-3-8B/") == "llama-3-8b"
    assert model_name("Qwen/Qwen2.5 7B Instruct") == "qwen2.5-7b-instruct"
    assert model_name("") == "model" and model_name(None) == "model"
    mid = model_id("A" * 1000, "lmcache", {"x": 1})
    CcConfig_v1(rank_id=0, device_id=0, model_id=mid)  # valid for the SDK
    assert model_id("m", "e", {"x": 1}) != model_id("m", "e", {"x": 2})


# -- slot plans -------------------------------------------------------------------------

def test_slot_plan_concatenates_segments_in_order() -> None:
    slots, counts = slot_plan([[(1000 + 64, 128), (1000, 64)], [(1000 + 256, 64)]], 1000, 8, 64)
    assert counts == [3, 1]
    assert slots.tolist() == [1, 2, 0, 4]


@pytest.mark.parametrize("bad", [(1000 + 32, 64), (1000, 96), (1000 + 448, 128), (900, 64), (1000, 0)])
def test_slot_plan_stops_at_a_key_with_a_bad_segment(bad: tuple[int, int]) -> None:
    slots, counts = slot_plan([[(1000, 64)], [bad], [(1000 + 64, 64)]], 1000, 8, 64)
    assert counts == [1] and slots.tolist() == [0]


# -- stores on a real emsd ---------------------------------------------------------------

def test_region_store_round_trips_scattered_segments(ems_env: Any) -> None:
    g = 256
    src = np.random.default_rng(1).integers(0, 256, 16 * g, dtype=np.uint8)
    dst = np.zeros_like(src)
    a, b = RegionStore(config(), src, src.nbytes, g), RegionStore(config(), dst, dst.nbytes, g)
    sa, sb = a.base, b.base
    keys = [b"k1", b"k2"]
    assert a.save(keys, [[(sa + 5 * g, 2 * g), (sa, g)], [(sa + 9 * g, g)]]) == 2
    assert b.exists(keys + [b"k3"]) == 2
    assert b.load(keys, [[(sb, 3 * g)], [(sb + 15 * g, g)]]) == 2
    assert dst[: 3 * g].tobytes() == src[5 * g: 7 * g].tobytes() + src[:g].tobytes()
    assert dst[15 * g:].tobytes() == src[9 * g: 10 * g].tobytes()
    assert not dst[3 * g: 15 * g].any()


def test_a_value_of_another_size_is_a_miss(ems_env: Any) -> None:
    g = 128
    buf = np.ones(8 * g, dtype=np.uint8)
    store = RegionStore(config(), buf, buf.nbytes, g)
    assert store.save([b"two"], [[(store.base, 2 * g)]]) == 1
    assert store.load([b"two"], [[(store.base + 4 * g, g)]]) == 0


def test_staged_values_store_header_and_payload_parts(ems_env: Any) -> None:
    values = StagedValues(config(), 1024, batch_values=2)
    payloads = [bytes([i]) * (100 * i + 1) for i in range(5)]
    assert values.put([b"v%d" % i for i in range(5)], [(b"HDR", p) for p in payloads]) == 5
    seen: dict[int, bytes] = {}

    def consume(i: int, value: memoryview) -> bool:
        seen[i] = bytes(value)
        return i < 3

    assert values.get([b"v%d" % i for i in range(5)], consume) == 3
    for i in range(4):
        assert seen[i] == (b"HDR" + payloads[i]).ljust(1024, b"\0")
    assert 4 not in seen


def test_staged_value_too_long_stops_the_batch(ems_env: Any) -> None:
    values = StagedValues(config(), 64)
    assert values.put([b"a", b"b", b"c"], [b"x" * 64, b"y" * 65, b"z"]) == 1
    assert values.exists([b"a", b"b", b"c"]) == 1


def test_store_without_emsd_serves_misses_then_recovers(emsd_factory: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ems.ems import Ems

    daemon = emsd_factory(start=False)
    monkeypatch.setenv("EMS_SOCKET_DIR", str(daemon.socket_dir))
    monkeypatch.setenv("EMS_SDK_LOG", str(daemon.workdir / "sdk-log"))
    Ems._reset()
    try:
        values = StagedValues(config(), 64, retry_interval_s=0.1)
        assert values.put([b"a"], [b"1"]) == 0 and values.exists([b"a"]) == 0
        assert not values.store.available
        daemon.start()
        while not values.store.available:
            time.sleep(0.02)
        assert values.put([b"a"], [b"1"]) == 1 and values.exists([b"a"]) == 1
        daemon.kill9()
        assert values.exists([b"a"]) == 0 and values.put([b"b"], [b"2"]) == 0
        assert values.get([b"a"], lambda i, v: True) == 0
        daemon.start()  # a restarted emsd is used again once the retry interval passed
        while values.put([b"b"], [b"2"]) == 0:
            time.sleep(0.02)
        assert values.exists([b"b"]) == 1
    finally:
        Ems._reset()


def _until(call: Any, want: int, within: float = 30.0) -> int:
    """``call()`` again until it gives ``want`` or ``within`` seconds pass; its last result.

    A call under a 300 ms timeout may miss on a loaded host, and the store then sits out its
    retry interval: what is asserted is that it works again, not how soon."""
    deadline = time.monotonic() + within
    while (got := call()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_hung_emsd_gives_misses_then_is_used_again(ems_env: Any) -> None:
    values = StagedValues(config(), 64, timeout_ms=300, retry_interval_s=0.2)
    assert _until(lambda: values.put([b"a"], [b"1"]), 1) == 1
    os.kill(ems_env.pid, signal.SIGSTOP)
    try:
        # b"a" is in the pool: the SDK finds it in the shared index without asking emsd. A key
        # that is not there is asked of emsd: the call's timeout passes, a miss.
        assert values.exists([b"a"]) == 1
        assert values.exists([b"c"]) == 0
        assert not values.store.available
        assert values.get([b"a"], lambda i, v: True) == 0  # out of use: a miss without a call
        assert values.put([b"b"], [b"2"]) == 0
    finally:
        os.kill(ems_env.pid, signal.SIGCONT)
    # the retry interval passes, emsd answers again
    assert _until(lambda: values.put([b"b"], [b"2"]), 1) == 1
    got: list[bytes] = []

    def load() -> int:
        got.clear()
        return values.get([b"a", b"b"], lambda i, v: got.append(bytes(v[:1])) is None)

    assert _until(load, 2) == 2
    assert got == [b"1", b"2"]


# -- imports without the engines ---------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="LMCache is installed here")
def test_lmcache_module_imports_without_lmcache_and_refuses_to_build() -> None:
    from ems.integrations.lmcache import EmsdConnector, read_options

    assert read_options({"remote_storage_plugin.emsd.timeout_ms": 10})["timeout_ms"] == 10
    with pytest.raises(ValueError, match="remote_storage_plugin.emsd.timeout"):
        read_options({"remote_storage_plugin.emsd.timeout": 10})
    with pytest.raises(ImportError, match="needs LMCache"):
        EmsdConnector()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_sglang_module_imports_without_sglang_and_refuses_to_build() -> None:
    from ems.integrations.sglang import EmsdHiCacheStorage, page_granularity

    assert page_granularity(1000, [(1000, 4096), (1000 + 3 * 4096, 4096), (1000 + 1024, 2048)]) == 1024
    with pytest.raises(ImportError, match="needs SGLang"):
        EmsdHiCacheStorage(None)
