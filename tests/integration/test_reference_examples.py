# ruff: noqa: E501  (the examples are quoted verbatim, long lines included)
"""Every code example of the EMS Python SDK reference, run as written against a real emsd.

Source: ../shared/reference/ems-python-sdk-reference.zh.txt (EMS "Python SDK 接口参考",
version 01, 2025-11-25). Each example below is quoted from it as a string, as
close to verbatim as the page allows (line breaks the PDF put inside calls are
kept), with the section it comes from, and executed with ``exec`` in one
process, as a user pasting them in turn would. The only substitutions:

- ``torch_npu`` is an empty module (``import torch_npu`` succeeds; nothing
  of it is used), and ``device = "npu:1"`` becomes ``"cpu"``: emsd works with
  CPU and CUDA tensors;
- typos that no SDK could honour are mended by ``mend``, which names the typo
  in a comment and asserts the quoted text still contains it.

Some examples break the reference's own rules (``sum(offsets) ==
len(slot_mapping)``, tables 8-3/8-8/8-14/8-19; equal lengths of
``slot_mapping``, ``token_ids`` and ``mask``, tables 8-4/8-9/8-15/8-20). Those
run twice: as written, where the SDK refuses with ``EMS_INVALID_ARGUMENT`` naming
the rule and the example's own ``except`` branch runs; and with the lengths
mended, where they succeed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ems import CcResult, Ems, EmsErrorCode

Namespace = dict[str, Any]


def run(code: str, ns: Namespace) -> tuple[Any, str]:
    """Execute one example in ``ns``; its ``exit()`` code (None if it ran through) and its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(textwrap.dedent(code), "<ems-sdk-reference>", "exec"), ns)  # noqa: S102
        except SystemExit as stop:
            return stop.code, out.getvalue()
    return None, out.getvalue()


def mend(code: str, old: str, new: str) -> str:
    """``code`` with the typo ``old`` replaced; fails if the quoted example no longer has it."""
    assert old in code, f"the quoted example no longer contains {old!r}"
    return code.replace(old, new)


def on_cpu(code: str) -> str:
    return mend(code, 'device = "npu:1"', 'device = "cpu"')


@pytest.fixture
def ns(sdk_env: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Namespace]:
    """A fresh namespace in a process where ``import torch_npu`` succeeds."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    yield {"__name__": "reference_example"}


# -- §8.1 注册 KVCache: the layout every later example saves from and loads into ----------------

REGISTER_8_1 = '''
import os, torch, torch_npu
from ems import Ems, EmsConfig, EmsException, CcConfig, CcKvOption, KvBufferWrapper
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
# 设定形状
# 期望整体形状: [layers, k_v_index, GPU_blocks, Block_size, heads, head_size]
layers = 2
k_v_index = 2
GPU_blocks = 2
Block_size = 4
head = 2
head_size = 4
# 设置device和dtype
device = "npu:1"
dtype = torch.float16
# 构造最内层张量 (每个都是 [GPU_blocks, Block_size, heads, head_size])
k_t0 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
v_t0 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
k_t1 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
v_t2 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
# 组织成二维列表 List[List[Tensor]]: 外层按 layer, 内层按 K/V
# kvcache[l][0]->第l层的K, kvcache[l][1]->第l层的V
kvcache = [
    [k_t0, v_t0], # 第 0 层
    [k_t1, v_t1], # 第 1 层
]
# 注册到Context Caching
try:
    context_caching.register_kvcache(kvcache)
    print("register_kvcache: success")
except EmsException as e:
    print(f"register_kvcache failed: {e}")
'''


def register_8_1(blocks: int = 2) -> str:
    """§8.1 with its typos mended: ``head = 2`` defines ``heads`` (used below it), the
    fourth tensor ``v_t2`` is ``v_t1`` (used in ``kvcache``), and ``context_caching`` is
    the ``cc`` the example got from ``Ems.get_cc()``. ``blocks``: ``GPU_blocks`` (the
    example's 2 hold slots 0-7; later examples address slots up to 18)."""
    code = on_cpu(REGISTER_8_1)
    code = mend(code, "head = 2\n", "heads = 2\n")  # typo: `heads` is what the tensors use
    code = mend(code, "v_t2 = torch.zeros", "v_t1 = torch.zeros")  # typo: kvcache uses v_t1
    code = mend(code, "context_caching.register_kvcache", "cc.register_kvcache")  # typo: cc
    return mend(code, "GPU_blocks = 2\n", f"GPU_blocks = {blocks}\n")


def registered(ns: Namespace, blocks: int = 8) -> Namespace:
    """``ns`` after §8.1 (mended, ``blocks`` blocks), its tensors filled with distinct values."""
    status, out = run(register_8_1(blocks), ns)
    assert status is None and "register_kvcache: success" in out, out
    for i, t in enumerate(t for layer in ns["kvcache"] for t in layer):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) / 7 + i)
    return ns


def kv_snapshot(ns: Namespace) -> list[torch.Tensor]:
    return [t.clone() for layer in ns["kvcache"] for t in layer]


def zero_kv(ns: Namespace) -> None:
    for layer in ns["kvcache"]:
        for t in layer:
            t.zero_()


def slots_equal(ns: Namespace, before: list[torch.Tensor], slots: list[int],
                source: list[int] | None = None) -> bool:
    """The registered tensors hold at ``slots`` what ``before`` held at ``source`` (default
    the same slots)."""
    now = [t for layer in ns["kvcache"] for t in layer]
    src = slots if source is None else source
    return all(torch.equal(a.flatten(0, 1)[slots], b.flatten(0, 1)[src]) for a, b in zip(now, before, strict=True))


def test_8_1_register_kvcache_as_written_with_its_typos_mended(ns: Namespace) -> None:
    status, out = run(register_8_1(), ns)
    assert (status, out) == (None, "register_kvcache: success\n")
    assert ns["cc"].layout.block_size == 4


def test_8_1_as_written_fails_only_on_its_python_typos(ns: Namespace) -> None:
    with pytest.raises(NameError, match="heads"):
        run(on_cpu(REGISTER_8_1), ns)


# -- §5 快速入门 -----------------------------------------------------------------------------

QUICKSTART_INIT_5 = '''
# 引入模块
import os, torch, torch_npu
from ems import Ems, EmsConfig, EmsException, CcConfig, CcKvOption, KvBufferWrapper
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
'''

QUICKSTART_REGISTER_5_1 = '''
import os, torch, torch_npu
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
# 初始化cc配置
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
# 注册到Context Caching
try:
    context_caching.register_kvcache(kvcache)
    # 期望kvcache形状: [layers, k_v_index, GPU_blocks, Block_size, heads, head_size]
    print("register_kvcache: success")
except EmsException as e:
    print(f"register_kvcache failed: {e}")
'''

QUICKSTART_HASH_5_2 = '''
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 保存
slot_mapping = [0,1,2,3,4,5,6,7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
# 读取保存的数据
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
'''

QUICKSTART_TOKEN_5_3 = '''
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 保存
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
# 读取保存的数据
try:
    cc_result = cc.save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
'''


def test_5_quickstart_init(ns: Namespace) -> None:
    # The snippet uses `cc_config` before defining it; the one of §5 step 1 is meant.
    ns["cc_config"] = ns_cc_config()
    status, out = run(QUICKSTART_INIT_5, ns)
    assert (status, out) == (None, "")
    assert Ems.get_cc() is not None and Ems.check_health()


def ns_cc_config() -> Any:
    from ems import CcConfig_v1

    return CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")


def test_5_quickstart_register_then_hash_and_token_saves(ns: Namespace) -> None:
    # Step 1 registers `kvcache`, which §8.1 builds (the quick start does not show it).
    run(register_8_1(), ns)
    code = mend(QUICKSTART_REGISTER_5_1, "context_caching.register_kvcache",
                "cc.register_kvcache")  # typo: the example's Context Caching object is `cc`
    status, out = run(code, ns)
    assert (status, out) == (None, "register_kvcache: success\n")
    assert run(QUICKSTART_HASH_5_2, ns) == (None, "")
    assert (ns["cc_result"].success, ns["cc_result"].total) == (2, 2)
    assert ns["cc"].exists([0xABCD, 0x1234]).success == 2
    assert run(QUICKSTART_TOKEN_5_3, ns) == (None, "")
    assert (ns["cc_result"].success, ns["cc_result"].total) == (1, 1)  # after the mask: 2 tokens


# -- §6.1 EMS 存储初始化, §6.2 环境变量, §7.1 获取 Context Caching 对象, §7.2 健康检查 ---------------

INIT_6_1 = '''
# 引入模块
import os
from ems import Ems, EmsConfig, EmsException, CcConfig

# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
'''

GET_CC_7_1 = '''
from ems import Ems, EmsConfig, EmsException, CcConfig
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is not initialized.")
'''

HEALTH_7_2 = '''
from ems import Ems, EmsConfig, EmsException, CcConfig
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
status = Ems.check_health()
if status is not True:
    print("ems is not ok.")
else:
    print(f"ems is ok")
'''


def test_6_1_init(ns: Namespace) -> None:
    assert run(INIT_6_1, ns) == (None, "")
    assert Ems.get_cc() is not None


def test_6_1_a_bad_value_is_refused_naming_the_field_and_the_rule(ns: Namespace) -> None:
    from ems import EmsException

    code = mend(INIT_6_1, 'model_id="llama2-13b"', 'model_id="Llama2-13B"')  # a bad value on purpose
    with pytest.raises(EmsException, match=r"model_id must be 1-512 characters of \[0-9a-z._@-\]"):
        run(code, ns)  # the constructor, outside the example's try, refuses it


def test_6_2_environment_variables(ns: Namespace, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # export ENABLE_CC_PROFILING=1 / export EMS_SDK_LOG="/tmp/ems_dir" (the test's own
    # directory in place of /tmp/ems_dir, which other runs on this machine share).
    monkeypatch.setenv("ENABLE_CC_PROFILING", "1")
    monkeypatch.setenv("EMS_SDK_LOG", str(tmp_path / "ems_dir"))
    registered(ns)
    assert run(QUICKSTART_HASH_5_2, ns) == (None, "")
    records = (tmp_path / "ems_dir" / f"cc_profile_{os.getpid()}.jsonl").read_text().splitlines()
    assert [json.loads(r)["op"] for r in records] == ["save", "save"]
    assert (tmp_path / "ems_dir" / "ems_sdk.log").exists()


def test_7_1_get_cc_and_7_2_check_health(ns: Namespace) -> None:
    assert run(GET_CC_7_1, ns) == (None, "")
    assert ns["cc"] is Ems.get_cc() is not None
    assert run(HEALTH_7_2, ns) == (None, "ems is ok\n")


def test_7_2_check_health_says_not_ok_once_the_daemon_is_gone(ns: Namespace, sdk_env: Any) -> None:
    assert run(GET_CC_7_1, ns) == (None, "")
    sdk_env.kill9()
    # The example's check, after its init: the daemon is gone.
    check = "status = Ems.check_health()" + HEALTH_7_2.split("status = Ems.check_health()", 1)[1]
    assert run(check, ns) == (None, "ems is not ok.\n")


# -- §8.2 同步保存 KVCache -------------------------------------------------------------------

SAVE_HASH_8_2 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表
slot_mapping = [0,1,2,3,4,5,6,7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
'''

SAVE_TOKEN_8_2 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [1, 1, 1, 1, 1, 1]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
'''

# §8.4 同步加载 KVCache

LOAD_HASH_8_4 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
print(f"succeed to load key num {cc_result.success}.")
print(cc_result)
'''

LOAD_TOKEN_8_4 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 组成参数列表
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [1, 1, 1, 1, 1, 1]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
print(f"succeed to load key num {cc_result.success}.")
print(cc_result)
'''

TOKEN_CALL_TYPO = ("hashes = hashes, offsets = offsets", "token_ids = token_ids, mask = mask")
SIX_SLOTS = ("slot_mapping = [0, 1, 2, 3, 4, 5]\n", "slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]\n")


def test_8_2_save_hash_then_8_4_load_hash_round_trip(ns: Namespace) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    status, out = run(SAVE_HASH_8_2, ns)
    assert (status, out) == (None, "CcResult(success=2, total=2)\n")
    zero_kv(ns)
    # §8.4 as written: 6 slots for offsets [4, 4] break sum(offsets) == len(slot_mapping).
    status, out = run(LOAD_HASH_8_4, ns)
    assert status == 2 and out.startswith("failed to load, EMS_INVALID_ARGUMENT") and "sum(offsets)" in out
    # With 8 slots it loads §8.2's blocks back, byte for byte, into zeroed tensors.
    code = mend(mend(LOAD_HASH_8_4, *SIX_SLOTS), "hashes = [0x1111, 0x2222]", "hashes = [0xABCD, 0x1234]")
    status, out = run(code, ns)
    assert (status, out) == (None, "succeed to load key num 2.\nCcResult(success=2, total=2)\n")
    assert slots_equal(ns, before, list(range(8)))
    # The example's own keys were never saved: a miss, not an error.
    status, out = run(mend(LOAD_HASH_8_4, *SIX_SLOTS), ns)
    assert (status, out) == (None, "succeed to load key num 0.\nCcResult(success=0, total=2)\n")


def test_8_2_save_token_then_8_4_load_token_round_trip(ns: Namespace) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    # As written, the token examples pass `hashes = hashes, offsets = offsets` (copied from the
    # hash example): with the 8.2 hash example's values, 6 slots for offsets [4, 4] are refused.
    run(SAVE_HASH_8_2, ns)
    status, out = run(SAVE_TOKEN_8_2, ns)
    assert status == 2 and "EMS_INVALID_ARGUMENT" in out and "sum(offsets)" in out
    status, out = run(mend(SAVE_TOKEN_8_2, *TOKEN_CALL_TYPO), ns)  # typo: the token arguments
    assert (status, out) == (None, "CcResult(success=2, total=2)\n")
    zero_kv(ns)
    status, out = run(mend(LOAD_TOKEN_8_4, *TOKEN_CALL_TYPO), ns)  # typo: the token arguments
    assert (status, out) == (None, "succeed to load key num 2.\nCcResult(success=2, total=2)\n")
    assert slots_equal(ns, before, list(range(6)))


# -- §8.3 异步保存 KVCache, §8.5 异步加载 KVCache --------------------------------------------------

ASYNC_SAVE_HASH_8_3 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步save请求，增加save并发能力。
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    hashes = [0x1111, 0x2222]
    offsets = [4, 4]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17]
    hashes = [0xAAAA, 0xBBBB]
    offsets = [4, 4]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
'''

ASYNC_SAVE_TOKEN_8_3 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步save请求，增加save并发能力。
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    token_ids = [101, 102, 103, 104, 105, 106]
    mask = [1, 1, 1, 1, 1, 1]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    token_ids = [201, 202, 203, 204, 205, 206, 207, 208, 209]
    mask = [0, 0, 0, 0, 1, 1, 1, 1]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
'''

ASYNC_LOAD_HASH_8_5 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步save请求，增加save并发能力。
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    hashes = [0x1111, 0x2222]
    offsets = [4, 4]
    future_list.append(cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets,
option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17]
    hashes = [0xAAAA, 0xB BBBB]
    offsets = [4, 4]
    future_list.append(cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets,
option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
'''

ASYNC_LOAD_TOKEN_8_5 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
# 多次异步下发异步save请求，增加save并发能力。
try:
    for idx in range(2):
        slot_mapping = [0, 1, 2, 3, 4, 5]
        tonken_ids = [102, 103, 104, 105, 106]
        mask = [0, 0, 0, 0, 1, 1]
        future_list.append(cc.async_load(slot_mapping = slot_mapping, tonken_ids = tonken_ids, mask = mask,
option = option))
        slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7, 8]
        tonken_ids = [201, 202, 203, 204, 205, 206, 207, 208, 209]
        mask = [0, 0, 0, 0, 0, 1, 1, 1]
        future_list.append(cc.async_load(slot_mapping = slot_mapping, tonken_ids = tonken_ids, mask = mask,
option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
'''

FIRST_OF_TWO = ("    slot_mapping = [0, 1, 2, 3, 4, 5]\n", "    slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]\n")


def test_8_3_async_save_hash_then_8_5_async_load_hash(ns: Namespace) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    # As written, the first call's 6 slots for offsets [4, 4] are refused before it is issued.
    status, out = run(ASYNC_SAVE_HASH_8_3, ns)
    assert status == 2 and out.startswith("failed to save, EMS_INVALID_ARGUMENT") and "sum(offsets)" in out
    status, out = run(mend(ASYNC_SAVE_HASH_8_3, *FIRST_OF_TWO), ns)
    assert (status, out) == (None, "result:CcResult(success=2, total=2)\n" * 2)
    zero_kv(ns)
    # §8.5: `0xB BBBB` is a typo (a syntax error) for the 0xBBBB that §8.3 saved.
    load = mend(ASYNC_LOAD_HASH_8_5, "0xB BBBB", "0xBBBB")
    status, out = run(load, ns)
    assert status == 2 and "sum(offsets)" in out
    status, out = run(mend(load, *FIRST_OF_TWO), ns)
    assert (status, out) == (None, "result:CcResult(success=2, total=2)\n" * 2)
    assert slots_equal(ns, before, [*range(8), *range(10, 18)])


def test_8_3_async_save_token_then_8_5_async_load_token(ns: Namespace) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    # As written, the second call has 9 slots and tokens but 8 mask entries.
    status, out = run(ASYNC_SAVE_TOKEN_8_3, ns)
    assert status == 2 and "EMS_INVALID_ARGUMENT" in out and "mask" in out
    # Its first save was issued before the second was refused, and runs on. Wait for it: the
    # mended run would find its blocks PENDING and count them saved before they are readable.
    (orphan,) = ns["future_list"]
    assert orphan.result() == CcResult(2, 2)
    save = mend(ASYNC_SAVE_TOKEN_8_3, "mask = [0, 0, 0, 0, 1, 1, 1, 1]",
                "mask = [0, 0, 0, 0, 1, 1, 1, 1, 1]")  # one mask entry per token
    status, out = run(save, ns)
    # 6 tokens: a full chunk and a partial one; 9 tokens, the first 4 masked: a full chunk
    # and a partial one (a key per chunk after the mask).
    assert (status, out) == (None, "result:CcResult(success=2, total=2)\n" * 2)
    # §8.5 as written spells the keyword `tonken_ids`: refused, naming it.
    status, out = run(ASYNC_LOAD_TOKEN_8_5, ns)
    assert status == 2 and "EMS_INVALID_ARGUMENT" in out and "tonken_ids" in out
    load = ASYNC_LOAD_TOKEN_8_5.replace("tonken_ids", "token_ids")  # typo, 6 occurrences
    # Mended, its lengths still differ (5 tokens for 6 slots; 8 mask entries for 9).
    status, out = run(load, ns)
    assert status == 2 and "EMS_INVALID_ARGUMENT" in out
    load = mend(load, "token_ids = [102, 103, 104, 105, 106]", "token_ids = [101, 102, 103, 104, 105, 106]")
    load = mend(load, "mask = [0, 0, 0, 0, 0, 1, 1, 1]", "mask = [0, 0, 0, 0, 1, 1, 1, 1, 1]")
    zero_kv(ns)
    status, out = run(load, ns)
    # Each round: the 101.. prompt's partial chunk after its mask, then the 201.. prompt's
    # chunk 205-208 and partial chunk 209, all saved by §8.3.
    assert (status, out) == (None, ("result:CcResult(success=1, total=1)\n"
                                    "result:CcResult(success=2, total=2)\n") * 2)
    # Tokens 207-209, saved from slots 16-18, are in slots 6-8 now (slots 4-5 take both
    # prompts' loads, in either order).
    assert slots_equal(ns, before, [6, 7, 8], [16, 17, 18])


# -- §8.6 检查异步 IO 状态, §8.7 获取异步 IO 结果, §8.8 同步查询 KvCache ------------------------------

IS_READY_HASH_8_6 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
# 发起异步保存
future = cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
# 使用 is_ready 非阻塞检查
if cc.is_ready(future):
    print("async_save(hash) 已完成")
else:
    print("async_save(hash) 仍在进行中")
'''

IS_READY_TOKEN_8_6 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
# 发起异步保存
future = cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option)
# 使用 is_ready 非阻塞检查
if cc.is_ready(future):
    print("async_save(token) 已完成")
else:
    print("async_save(token) 仍在进行中")
'''

GET_RESULT_HASH_8_7 = '''
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
# 异步保存，获取结果
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    fut = cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
    res = cc.get_result(fut)
    print("async_save(hash) result:", res)
except EmsException as e:
    print("async_save(hash) result:", res)
# 异步读取，获取结果
try:
    fut = cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
    res = cc.get_result(fut)
    print("async_load(hash) result:", res)
except EmsException as e:
    print(f"async_load(hash) failed: {e}")
'''

GET_RESULT_TOKEN_8_7 = '''
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
# 异步保存，获取结果
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
try:
    fut = cc.async_save(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=option)
    res = cc.get_result(fut)
    print("async_save(token) result:", res)
except EmsException as e:
    print(f"async_save(token) failed: {e}")
# 异步读取，获取结果
try:
    fut = cc.async_load(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=option)
    res = cc.get_result(fut)
    print("async_load(token) result:", res)
except EmsException as e:
    print(f"async_load(token) failed: {e}")
'''

EXISTS_8_8 = '''
# 设置请求的超时时间
option = CcKvOption(timeout=5000)
# 组成参数列表
hashes = [0xABCD, 0x1234]
# 可以根据不同异常，采取不同处理方式，例如超时错误可以重试。
try:
    cc_result = cc.exists(hashes = hashes, option = option)
except EmsException as e:
    print(f"failed to exists, {e}.")
    exit(2)
print(cc_result)
'''


@pytest.mark.parametrize("example", [IS_READY_HASH_8_6, IS_READY_TOKEN_8_6])
def test_8_6_is_ready(ns: Namespace, example: str) -> None:
    registered(ns)
    status, out = run(example, ns)
    assert status is None and out.rstrip().endswith(("已完成", "仍在进行中")), out
    cc, future = ns["cc"], ns["future"]
    keys = 2 if "hashes" in example else 1  # the token example's mask leaves one chunk
    assert cc.get_result(future) == CcResult(keys, keys)
    assert cc.is_ready(future) is True


def test_8_7_get_result_hash_and_token(ns: Namespace) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    status, out = run(GET_RESULT_HASH_8_7, ns)
    assert (status, out) == (None, "async_save(hash) result: CcResult(success=2, total=2)\n"
                                   "async_load(hash) result: CcResult(success=2, total=2)\n")
    status, out = run(GET_RESULT_TOKEN_8_7, ns)
    # mask skips the first chunk (already cached): one key, the partial chunk of 2 tokens.
    assert (status, out) == (None, "async_save(token) result: CcResult(success=1, total=1)\n"
                                   "async_load(token) result: CcResult(success=1, total=1)\n")
    assert slots_equal(ns, before, list(range(8)))


def test_8_8_exists(ns: Namespace) -> None:
    registered(ns)
    assert run(EXISTS_8_8, ns) == (None, "CcResult(success=0, total=2)\n")
    run(SAVE_HASH_8_2, ns)
    assert run(EXISTS_8_8, ns) == (None, "CcResult(success=2, total=2)\n")


def test_8_8_exists_names_an_unknown_keyword(ns: Namespace) -> None:
    registered(ns)
    code = mend(EXISTS_8_8, "option = option)", "option = option, token_ids = [1])")
    status, out = run(code, ns)
    assert status == 2 and "EMS_INVALID_ARGUMENT" in out and "token_ids" in out


# -- §9.1 获取错误码, §9.2 获取详细信息 ---------------------------------------------------------------

RETRY_9_1 = '''
import os
import time
import torch, torch_npu
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
from ems.common.exception import EmsErrorCode
# 初始化cc配置
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config_v1=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
# 设置save请求的超时时间
option = CcKvOption(timeout=100)
# hash语义下的保存和加载显存数据，参数: slot_mapping + hashes + offsets
block_size = 4
# 组成参数列表
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
# 支持超时重试。
retries = 0
while True:
    try:
        result = cc.load(slot_mapping, hashes, offsets, option)
        break
    except EmsException as e:
        if e.status_code() != EmsErrorCode.EMS_IO_TIMEOUT or retries >= 3:
            print(f"failed to load cause unrecoverable error or retries is more than 3: {e.status_code()}.")
            exit(2)
        else:
            # 增加超时时间，并睡眠10ms后重试
            option.timeout = 1000
            time.sleep(0.01)
            print(f"retry after sleep 10ms.")
print(f"load result: {result}")
'''

MESSAGE_9_2 = '''
import os
import torch, torch_npu
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
# 初始化cc配置
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config_v1=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
# hash语义下的保存和加载显存数据，参数: slot_mapping + hashes + offsets
block_size = 4
# 组成参数列表
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
# 多次异步下发异步load请求，增加load并发能力。
try:
    result = cc.load(slot_mapping, hashes, offsets, option)
except EmsException as e:
    print(f"failed to load, message: {e.message()}")
'''

EIGHT_SLOTS = ("slot_mapping = [0, 1, 2, 3, 4, 5]\n", "slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]\n")


def test_9_1_as_written_stops_on_its_invalid_argument(ns: Namespace) -> None:
    registered(ns)  # the example loads into the kvcache this process registered (§8.1)
    status, out = run(RETRY_9_1, ns)
    # EmsErrorCode is an IntEnum: the f-string shows EMS_INVALID_ARGUMENT's value.
    assert (status, out) == (2, "failed to load cause unrecoverable error or retries is more than 3: "
                                f"{int(EmsErrorCode.EMS_INVALID_ARGUMENT)}.\n")


def test_9_1_retries_a_timeout_with_a_longer_timeout_on_the_used_option(ns: Namespace,
                                                                       sdk_env: Any) -> None:
    registered(ns)
    before = kv_snapshot(ns)
    ns["cc"].save(list(range(8)), hashes=[0x1111, 0x2222], offsets=[4, 4])
    zero_kv(ns)
    daemon = sdk_env
    # The daemon stops answering for longer than the first attempt's 100 ms and resumes
    # well within the retry's 1000 ms: the first load times out, the retry succeeds. The
    # loads ask the daemon: through the shared index they would not wait for it at all.
    client = Ems._client
    index, client.index = client.index, None
    os.kill(daemon.pid, signal.SIGSTOP)
    resume = threading.Timer(0.4, os.kill, (daemon.pid, signal.SIGCONT))
    resume.start()
    try:
        status, out = run(mend(RETRY_9_1, *EIGHT_SLOTS), ns)
    finally:
        resume.join()
        os.kill(daemon.pid, signal.SIGCONT)
        client.index = index
    assert status is None, out
    assert out.startswith("retry after sleep 10ms.\n")
    assert out.endswith("load result: CcResult(success=2, total=2)\n")
    assert ns["option"].timeout == 1000
    assert slots_equal(ns, before, list(range(8)))


def test_9_2_message(ns: Namespace) -> None:
    registered(ns)
    status, out = run(MESSAGE_9_2, ns)
    # As written the load breaks sum(offsets) == len(slot_mapping): the message says so.
    assert status is None and out.startswith("failed to load, message: ") and "sum(offsets)" in out
    status, out = run(mend(MESSAGE_9_2, *EIGHT_SLOTS), ns)
    assert (status, out) == (None, "")
    assert ns["result"].total == 2


# -- the reference's tables, where no example shows them -----------------------------------------


def test_table_8_4_mask_is_optional(ns: Namespace) -> None:
    # Tables 8-4/8-9/8-15/8-20: mask 是否必选 否, 默认取值 None (no prefix skipped).
    registered(ns)
    before = kv_snapshot(ns)
    cc, tokens = ns["cc"], [101, 102, 103, 104, 105, 106]
    assert cc.save(slot_mapping=list(range(6)), token_ids=tokens) == CcResult(2, 2)
    zero_kv(ns)
    assert cc.load(slot_mapping=list(range(6)), token_ids=tokens, mask=None) == CcResult(2, 2)
    assert slots_equal(ns, before, list(range(6)))
    # The same keys as with an all-ones mask: found by the §8.4 token example, mended.
    zero_kv(ns)
    status, out = run(mend(LOAD_TOKEN_8_4, *TOKEN_CALL_TYPO), ns)
    assert (status, out) == (None, "succeed to load key num 2.\nCcResult(success=2, total=2)\n")
