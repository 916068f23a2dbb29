"""EmsConfig, CcConfig_v1, CcKvOption, and the environment the SDK reads (profiling, log dir)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ems.cc_v1 import CcConfig as CcConfigAlias
from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.common.exception import EmsErrorCode, EmsException
from ems.config import CcKvOption, EmsConfig, resolve_option
from ems.profiling import (
    Profiler,
    fallback_log_dir,
    install_log_handler,
    profiling_enabled,
    remove_log_handler,
    sdk_log_dir,
)
from ems.result import CcResult

KEY = "A" * 31 + "="  # 32 characters of the key alphabet


def cc(**kw: object) -> CcConfig_v1:
    args: dict[str, object] = {"rank_id": 0, "device_id": 0, "model_id": "llama-3.1-8b"}
    args.update(kw)
    return CcConfig_v1(**args)  # type: ignore[arg-type]


def invalid_message(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(EmsException) as info:
        fn(*args, **kw)  # type: ignore[operator]
    assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    return info.value.message()


# -- CcConfig_v1 ------------------------------------------------------------------------


def test_cc_config_defaults_and_fields_are_readable() -> None:
    c = cc()
    assert (c.rank_id, c.device_id, c.model_id) == (0, 0, "llama-3.1-8b")
    shape = (c.tp_world_size, c.pp_world_size, c.rank_in_tp_group, c.rank_in_pp_group)
    assert shape == (1, 1, 0, 0)
    assert c.llm_engine == "vllm"
    assert c.kvcache_type is KVCacheType.MHA


def test_cc_config_alias_is_the_same_class() -> None:
    assert CcConfigAlias is CcConfig_v1


def test_cc_config_is_mutable_as_the_published_connector_uses_it() -> None:
    # vllm-ascend's EmsAdapter.get_ems_cfg builds the config, then for MLA models:
    c = cc()
    c.kvcache_type = KVCacheType.MLA
    assert c.kvcache_type is KVCacheType.MLA
    c.kvcache_type = "GQA"  # type: ignore[assignment]
    assert c.kvcache_type is KVCacheType.GQA
    c.model_id = "other"
    assert c == cc(model_id="other", kvcache_type="GQA")


@pytest.mark.parametrize(("field", "bad", "rule"), [
    ("rank_id", -1, ">= 0"), ("device_id", True, "int"), ("tp_world_size", 0, ">= 1"),
    ("rank_in_pp_group", 1.0, "int"), ("model_id", "Upper", "[0-9a-z._@-]"),
    ("llm_engine", "", "printable"), ("kvcache_type", "mla", "KVCacheType")])
def test_cc_config_assignment_checks_the_field_and_keeps_the_old_value(field: str, bad: object,
                                                                       rule: str) -> None:
    c = cc()
    before = getattr(c, field)
    msg = invalid_message(setattr, c, field, bad)
    assert field in msg and rule in msg
    assert getattr(c, field) == before


def test_cc_config_unknown_attribute_is_refused() -> None:
    with pytest.raises(AttributeError):
        cc().kv_cache_type = KVCacheType.MLA  # type: ignore[attr-defined]


def test_cc_config_group_rules_are_checked_by_validate_in_any_assignment_order() -> None:
    c = cc()
    c.rank_in_tp_group = 3  # before tp_world_size: fine until used
    assert "rank_in_tp_group must be < tp_world_size (1)" in invalid_message(c.validate)
    assert "rank_in_tp_group must be < tp_world_size" in invalid_message(
        EmsConfig(cc_config=c).validate)
    c.tp_world_size = 4
    assert c.validate() is c


@given(st.lists(st.tuples(st.sampled_from(["rank_id", "device_id", "tp_world_size"]),
                          st.integers(-3, 2**40)), max_size=8))
def test_cc_config_assignments_either_store_or_refuse(steps: list[tuple[str, int]]) -> None:
    c = cc()
    for field, value in steps:
        minimum = 1 if field == "tp_world_size" else 0
        if value >= minimum:
            setattr(c, field, value)
            assert getattr(c, field) == value
        else:
            before = getattr(c, field)
            invalid_message(setattr, c, field, value)
            assert getattr(c, field) == before


def test_cc_config_accepts_kvcache_type_as_string_value() -> None:
    assert cc(kvcache_type="MLA").kvcache_type is KVCacheType.MLA
    assert cc(kvcache_type=KVCacheType.GQA).kvcache_type is KVCacheType.GQA


def test_cc_config_refuses_unknown_kvcache_type() -> None:
    assert "kvcache_type" in invalid_message(cc, kvcache_type="mha")


def test_cc_config_accepts_numpy_ints() -> None:
    assert cc(rank_id=np.int64(1), tp_world_size=np.int32(2)).rank_id == 1


@pytest.mark.parametrize("field", ["rank_id", "device_id", "tp_world_size", "pp_world_size",
                                   "rank_in_tp_group", "rank_in_pp_group"])
def test_cc_config_refuses_bools_and_non_ints(field: str) -> None:
    assert field in invalid_message(cc, **{field: True})
    assert field in invalid_message(cc, **{field: 1.0})
    assert field in invalid_message(cc, **{field: "1"})


@pytest.mark.parametrize("field", ["rank_id", "device_id", "rank_in_tp_group", "rank_in_pp_group"])
def test_cc_config_refuses_negative_values(field: str) -> None:
    assert ">= 0" in invalid_message(cc, **{field: -1})


@pytest.mark.parametrize("field", ["tp_world_size", "pp_world_size"])
def test_cc_config_world_sizes_are_at_least_one(field: str) -> None:
    assert f"{field} must be an int >= 1" in invalid_message(cc, **{field: 0})


def test_cc_config_rank_in_groups_below_world_sizes() -> None:
    assert "rank_in_tp_group must be < tp_world_size" in invalid_message(
        cc, tp_world_size=2, rank_in_tp_group=2)
    assert "rank_in_pp_group must be < pp_world_size" in invalid_message(
        cc, pp_world_size=2, rank_in_pp_group=2)


def test_cc_config_rank_id_is_the_global_rank_beyond_one_tp_pp_group() -> None:
    # The reference's first example; with data parallelism an instance has more ranks
    # than tp_world_size * pp_world_size.
    assert cc(rank_id=8).rank_id == 8
    assert cc(rank_id=6, tp_world_size=2, pp_world_size=3).rank_id == 6
    assert cc(rank_id=2**40).rank_id == 2**40


def test_cc_config_device_id_has_no_upper_bound() -> None:
    assert cc(device_id=15).device_id == 15


@pytest.mark.parametrize("bad", ["", "Llama", "a b", "a/b", "a\n", "x" * 513, "é"])
def test_cc_config_model_id_rule(bad: str) -> None:
    msg = invalid_message(cc, model_id=bad)
    assert "model_id" in msg and "[0-9a-z._@-]" in msg


def test_cc_config_model_id_accepts_full_alphabet_and_max_length() -> None:
    assert cc(model_id="0-9.a_z@x").model_id == "0-9.a_z@x"
    assert len(cc(model_id="m" * 512).model_id) == 512


def test_cc_config_model_id_must_be_str() -> None:
    assert "model_id" in invalid_message(cc, model_id=b"llama")


@pytest.mark.parametrize("bad", ["", "x" * 257, "a\nb", None, b"vllm"])
def test_cc_config_llm_engine_rule(bad: object) -> None:
    msg = invalid_message(cc, llm_engine=bad)
    assert "llm_engine must be a printable str of 1-256 characters" in msg


def test_cc_config_llm_engine_takes_the_published_connectors_value() -> None:
    # vllm-ascend: f"{EmsEnv.llm_engine}@{model_name}", model_name from the model path.
    assert cc(llm_engine="vllm@models_Kimi-K2.5-w4a8").llm_engine == "vllm@models_Kimi-K2.5-w4a8"
    assert cc(llm_engine="x" * 256).llm_engine == "x" * 256


def test_cc_config_equality_and_repr() -> None:
    assert cc() == cc()
    with pytest.raises(TypeError):  # mutable settings are not hashable
        hash(cc())
    assert cc() != cc(device_id=1)
    assert "model_id='llama-3.1-8b'" in repr(cc())


# -- EmsConfig --------------------------------------------------------------------------


def test_ems_config_accepts_either_cc_keyword() -> None:
    c = cc()
    assert EmsConfig(cc_config=c).cc_config is c
    assert EmsConfig(cc_config_v1=c).cc_config is c
    assert EmsConfig(cc_config=c, cc_config_v1=c).cc_config_v1 is c


def test_ems_config_accepts_both_keywords_with_equal_configs() -> None:
    assert EmsConfig(cc_config=cc(), cc_config_v1=cc()).cc_config == cc()


def test_ems_config_refuses_two_different_cc_configs() -> None:
    msg = invalid_message(EmsConfig, cc_config=cc(), cc_config_v1=cc(device_id=1))
    assert "cc_config" in msg and "cc_config_v1" in msg


def test_ems_config_cc_config_must_be_a_cc_config_v1() -> None:
    assert "cc_config must be a CcConfig_v1" in invalid_message(EmsConfig, cc_config={"rank_id": 0})
    assert "cc_config_v1 must be" in invalid_message(EmsConfig, cc_config_v1="x")


def test_ems_config_validate_requires_a_cc_config() -> None:
    config = EmsConfig()
    assert "cc_config" in invalid_message(config.validate)
    assert EmsConfig(cc_config=cc()).validate() == cc()


def test_ems_config_default_tenant() -> None:
    config = EmsConfig(cc_config=cc())
    assert config.access_id is None and config.access_key is None


def test_ems_config_access_id_with_at_sign() -> None:
    assert EmsConfig(access_id="user@tenant.example", access_key=KEY).access_id == (
        "user@tenant.example")


@pytest.mark.parametrize("bad", ["", "User", "x" * 513, 12])
def test_ems_config_access_id_rule(bad: object) -> None:
    assert "access_id" in invalid_message(EmsConfig, access_id=bad)


@pytest.mark.parametrize("bad", ["short", "A" * 31, "A" * 257, "A" * 31 + "!", "A" * 31 + "-"])
def test_ems_config_access_key_rule_never_shows_the_key(bad: str) -> None:
    msg = invalid_message(EmsConfig, access_id="me", access_key=bad)
    assert "access_key" in msg and "32-256" in msg
    assert bad not in msg


def test_ems_config_access_key_accepts_bounds() -> None:
    assert EmsConfig(access_id="me", access_key="a+/=" * 8).access_key == "a+/=" * 8
    assert EmsConfig(access_id="me", access_key="Z" * 256).access_key == "Z" * 256


def test_ems_config_empty_access_key_is_no_key() -> None:
    # The published vllm-ascend connector's default: os.environ.get("ACCELERATE_KEY", "").
    assert EmsConfig(access_id="cc_kvstore@_@ds_default_ns_001", access_key="").access_key is None


def test_ems_config_access_key_requires_access_id() -> None:
    msg = invalid_message(EmsConfig, access_key=KEY)
    assert "access_id" in msg and KEY not in msg


def test_ems_config_repr_hides_the_key() -> None:
    config = EmsConfig(access_id="me", access_key=KEY, cc_config=cc())
    assert KEY not in repr(config) and KEY not in str(config)
    assert "'me'" in repr(config)


# -- CcKvOption -------------------------------------------------------------------------


def test_option_defaults() -> None:
    opt = CcKvOption()
    assert (opt.write_rcache, opt.read_local_only, opt.timeout) == (True, False, 5000)
    assert opt.timeout_seconds() == 5.0


def test_option_zero_timeout_means_no_limit() -> None:
    assert CcKvOption(timeout=0).timeout_seconds() is None


@pytest.mark.parametrize("field", ["write_rcache", "read_local_only"])
def test_option_booleans_must_be_bool(field: str) -> None:
    assert field in invalid_message(CcKvOption, **{field: 1})
    assert field in invalid_message(CcKvOption, **{field: None})
    assert getattr(CcKvOption(**{field: np.bool_(True)}), field) is True  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "5000", None, 2**31])
def test_option_timeout_rule(bad: object) -> None:
    assert "timeout" in invalid_message(CcKvOption, timeout=bad)


def test_option_equality_and_repr() -> None:
    assert CcKvOption(timeout=10) == CcKvOption(timeout=10) != CcKvOption()
    assert repr(CcKvOption()) == (
        "CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)")


def test_option_is_mutable_as_the_reference_retry_example_uses_it() -> None:
    option = CcKvOption(timeout=100)
    option.timeout = 1000
    option.write_rcache, option.read_local_only = False, True
    assert option == CcKvOption(write_rcache=False, read_local_only=True, timeout=1000)
    assert option.timeout_seconds() == 1.0
    with pytest.raises(TypeError):
        hash(option)


@pytest.mark.parametrize(("field", "bad"), [("timeout", -1), ("timeout", 1.5), ("timeout", 2**31),
                                            ("write_rcache", 1), ("read_local_only", None)])
def test_option_assignment_checks_the_field_and_keeps_the_old_value(field: str, bad: object) -> None:
    option = CcKvOption()
    before = getattr(option, field)
    assert field in invalid_message(setattr, option, field, bad)
    assert getattr(option, field) == before


def test_option_copy_is_independent() -> None:
    option = CcKvOption(timeout=7)
    twin = option.copy()
    option.timeout = 8
    assert twin == CcKvOption(timeout=7)


def test_ems_config_is_mutable_and_validate_checks_across_fields() -> None:
    config = EmsConfig()
    config.cc_config_v1 = cc()
    assert config.cc_config == cc()
    config.access_key = KEY  # no access_id yet: refused when used
    msg = invalid_message(config.validate)
    assert "access_id" in msg and KEY not in msg
    config.access_id = "me"
    assert config.validate() == cc()
    assert "access_id" in invalid_message(setattr, config, "access_id", "Me")
    assert "cc_config must be a CcConfig_v1" in invalid_message(setattr, config, "cc_config", 1)
    assert config.access_id == "me"


def test_ems_config_copy_is_independent() -> None:
    config = EmsConfig(access_id="me", access_key=KEY, cc_config=cc())
    twin = config.copy()
    assert twin.same(config)
    assert config.cc_config is not None
    config.cc_config.rank_id = 9
    assert not twin.same(config) and twin.cc_config == cc()


def test_resolve_option() -> None:
    assert resolve_option(None) == CcKvOption()
    opt = CcKvOption(timeout=1)
    assert resolve_option(opt) is opt
    assert "option must be a CcKvOption" in invalid_message(resolve_option, {"timeout": 1})


# -- environment: log directory and profiling -------------------------------------------


def test_sdk_log_dir_uses_env_and_creates_it(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "a" / "b"
    monkeypatch.setenv("EMS_SDK_LOG", str(target))
    assert sdk_log_dir() == target and target.is_dir()


def test_sdk_log_dir_falls_back_when_unusable(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("EMS_SDK_LOG", str(blocker / "logs"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    got = sdk_log_dir()
    assert got == fallback_log_dir() == tmp_path / "tmp" / f"ems-{os.getuid()}"
    assert got.is_dir()


def test_profiling_enabled_only_by_exact_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENABLE_CC_PROFILING", raising=False)
    assert not profiling_enabled() and not Profiler.from_env().enabled
    monkeypatch.setenv("ENABLE_CC_PROFILING", "true")
    assert not profiling_enabled()
    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    assert profiling_enabled() and Profiler.from_env().enabled


def read_records(directory: Path) -> list[dict[str, object]]:
    (path,) = directory.glob("cc_profile_*.jsonl")
    assert path.name == f"cc_profile_{os.getpid()}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_profiler_disabled_writes_nothing(tmp_path: Path) -> None:
    profiler = Profiler(False, tmp_path)
    profiler.record("save", time.perf_counter_ns(), CcResult(1, 2))
    assert list(tmp_path.iterdir()) == []


def test_profiler_writes_one_json_line_per_call(tmp_path: Path) -> None:
    profiler = Profiler(True, tmp_path)
    start = time.perf_counter_ns()
    profiler.record("save", start, CcResult(3, 4))
    profiler.record("exists", start, EmsException(EmsErrorCode.EMS_IO_TIMEOUT, "late"), keys=7)
    profiler.close()
    first, second = read_records(tmp_path)
    assert {k: first[k] for k in ("op", "keys", "success", "total", "pid")} == {
        "op": "save", "keys": 4, "success": 3, "total": 4, "pid": os.getpid()}
    assert isinstance(first["duration_us"], int) and first["duration_us"] >= 0
    assert abs(float(first["timestamp"]) - time.time()) < 60  # type: ignore[arg-type]
    assert (second["op"], second["keys"], second["error"]) == ("exists", 7, "EMS_IO_TIMEOUT")


def test_profiler_timed_records_result_and_exceptions(tmp_path: Path) -> None:
    profiler = Profiler(True, tmp_path)
    with profiler.timed("load") as box:
        box["result"] = CcResult(2, 2)
    with pytest.raises(ValueError), profiler.timed("load", keys=5):
        raise ValueError("boom")
    profiler.close()
    ok, failed = read_records(tmp_path)
    assert (ok["success"], ok["total"]) == (2, 2)
    assert (failed["error"], failed["keys"]) == ("ValueError", 5)


def test_profiler_default_directory_from_env(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path))
    profiler = Profiler(True)
    profiler.record("save", time.perf_counter_ns(), CcResult(0, 0))
    profiler.close()
    assert len(read_records(tmp_path)) == 1


def test_profiler_unwritable_directory_turns_itself_off(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    profiler = Profiler(True, blocker)
    profiler.record("save", time.perf_counter_ns(), CcResult(0, 0))  # must not raise
    assert not profiler.enabled


def test_log_handler_writes_sdk_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path))
    remove_log_handler()  # an earlier Ems.init in this process may have installed one
    logger = logging.getLogger("ems")
    level = logger.level
    try:
        path = install_log_handler()
        assert install_log_handler() == path == tmp_path / "ems_sdk.log"
        logging.getLogger("ems.test").info("hello from the sdk")
    finally:
        remove_log_handler()
        logger.setLevel(level)
    assert "hello from the sdk" in path.read_text()
    assert not any(isinstance(h, logging.FileHandler) for h in logger.handlers)
