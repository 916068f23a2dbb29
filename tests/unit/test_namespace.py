"""namespace_name: canonical, injective over the fields that change block contents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from ems.namespace import namespace_name

ROOT = Path(__file__).resolve().parents[2]
NAME = st.text(alphabet="0123456789abcdefghijklmnopqrstuvwxyz._@-", min_size=1, max_size=12)
TENANT = st.none() | NAME
SIGNATURE = st.text(max_size=20)


@st.composite
def configs(draw: st.DrawFn) -> CcConfig_v1:
    tp = draw(st.integers(1, 4))
    pp = draw(st.integers(1, 3))
    return CcConfig_v1(
        rank_id=draw(st.integers(0, 4 * tp * pp)),  # the global rank: DP ranks beyond TP x PP too
        device_id=draw(st.integers(0, 7)),
        model_id=draw(NAME),
        tp_world_size=tp,
        pp_world_size=pp,
        rank_in_tp_group=draw(st.integers(0, tp - 1)),
        rank_in_pp_group=draw(st.integers(0, pp - 1)),
        llm_engine=draw(NAME),
        kvcache_type=draw(st.sampled_from(list(KVCacheType))),
    )


def identity(tenant: str | None, c: CcConfig_v1, sig: str) -> tuple[object, ...]:
    """The fields the namespace must separate (rank_id and device_id excluded)."""
    return (tenant, c.model_id, c.llm_engine, c.kvcache_type, c.tp_world_size, c.pp_world_size,
            c.rank_in_tp_group, c.rank_in_pp_group, sig)


@given(TENANT, configs(), SIGNATURE, TENANT, configs(), SIGNATURE)
def test_namespace_is_injective_over_its_fields(t1: str | None, c1: CcConfig_v1, s1: str,
                                                t2: str | None, c2: CcConfig_v1, s2: str) -> None:
    same_name = namespace_name(t1, c1, s1) == namespace_name(t2, c2, s2)
    assert same_name == (identity(t1, c1, s1) == identity(t2, c2, s2))


@given(TENANT, configs(), SIGNATURE)
def test_namespace_ignores_rank_id_and_device_id(tenant: str | None, c: CcConfig_v1,
                                                 sig: str) -> None:
    other = CcConfig_v1(
        rank_id=c.rank_id + c.tp_world_size * c.pp_world_size, device_id=c.device_id + 1,
        model_id=c.model_id, tp_world_size=c.tp_world_size, pp_world_size=c.pp_world_size,
        rank_in_tp_group=c.rank_in_tp_group, rank_in_pp_group=c.rank_in_pp_group,
        llm_engine=c.llm_engine, kvcache_type=c.kvcache_type)
    assert namespace_name(tenant, c, sig) == namespace_name(tenant, other, sig)


def base(**kw: object) -> CcConfig_v1:
    args: dict[str, object] = {"rank_id": 0, "device_id": 0, "model_id": "m",
                               "tp_world_size": 2}
    args.update(kw)
    return CcConfig_v1(**args)  # type: ignore[arg-type]


def test_two_tp_ranks_never_share() -> None:
    assert namespace_name(None, base(rank_in_tp_group=0), "") != namespace_name(
        None, base(rank_in_tp_group=1, rank_id=1), "")


def test_default_tenant_differs_from_a_tenant_named_default() -> None:
    assert namespace_name(None, base(), "") != namespace_name("default", base(), "")


def test_namespace_is_compact_json_with_version() -> None:
    name = namespace_name("me@x", base(kvcache_type="MLA"), "sig|1")
    assert json.loads(name) == ["ems-ns-v1", "me@x", "m", "vllm", "MLA", 2, 1, 0, 0, "sig|1"]
    assert " " not in name


def test_namespace_is_the_same_in_another_process() -> None:
    code = ("from ems.cc_v1.cc_config import CcConfig_v1; from ems.namespace import namespace_name;"
            "print(namespace_name('t', CcConfig_v1(0, 0, 'm', tp_world_size=2), 'L'), end='')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PYTHONPATH": str(ROOT)},
                         cwd=ROOT)
    assert out.stdout == namespace_name("t", base(), "L")


@pytest.mark.parametrize(("args", "field"), [
    ((1, None, ""), "access_id"), (("t", "cfg", ""), "cc"), (("t", None, 5), "layout_signature"),
])
def test_namespace_refuses_wrong_types(args: tuple[object, ...], field: str) -> None:
    tenant, cfg, sig = args
    with pytest.raises(TypeError, match=field):
        namespace_name(tenant, base() if cfg is None else cfg, sig)  # type: ignore[arg-type]
